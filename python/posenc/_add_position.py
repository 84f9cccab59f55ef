"""The add_position family's Python front end: :func:`add_position`, ``dropout(x +
table[positions], p)`` fused in one pass (op ``torch.ops.posenc.add_position``, autograd in
C++), and the modules built on it, :class:`PositionalEncoding` (the fixed sinusoidal table)
and :class:`LearnedPositionalEncoding` (a trained one). Re-exported by
:mod:`posenc.functional` and :mod:`posenc.modules`.

The modules' forward calls the function users call, ``posenc.functional.add_position``,
which calls the op: one road, through ``nn.Module.__call__`` (hooks, profiler, module traces
see every call). It is also what ``torch.jit.script`` compiles: under
``torch.jit.is_scripting()`` it calls the op the function calls (the host-side checks and
DTensor placement are eager-only), so a scripted module computes what the eager one does, in
train and eval mode, and scripting leaves the Python model as it was (no twin). No ``from
__future__ import annotations`` here: TorchScript reads the annotations as types.
"""

import math
import warnings
from typing import Any, Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.nn.utils import parametrize

from posenc._common import (_TABLE_DTYPES, _bool_arg, _check_positive_int, _check_probability, _float_arg,
                             _forward_as_written, _global_hooks, _int_arg, _integer, _optional_tensor_args, _own_hooks,
                             _real, _runs_as_written, _static_numel, _table_dtype, _tensor_arg, _written_forward)
from posenc._dtensor import is_dtensor, place_beside, placed_as


def _offset_arg(fn: str, offset: Union[int, Tensor]) -> Union[int, Tensor]:
    """add_position's offset checked: an int (a numpy integer as one, a dynamic int kept) or a
    one-element integer tensor; TypeError / ValueError naming ``fn`` otherwise."""
    if isinstance(offset, Tensor):
        # The op's SymInt would truncate a float tensor (3.7 as 3); a meta one has no value.
        if (offset.is_floating_point() or offset.is_complex() or offset.dtype == torch.bool
                or _static_numel(offset) != 1 or offset.is_meta):
            raise TypeError(f"{fn}: expected offset to be an int or a one-element integer tensor, got {offset!r}")
    elif isinstance(offset, bool) or (not torch.compiler.is_compiling() and _integer(offset) is None):
        raise TypeError(f"{fn}: expected offset to be an int, got {offset!r}")  # True would count as 1
    elif isinstance(offset, (int, torch.SymInt)) or not torch.compiler.is_compiling():
        # ValueError past int64; a numpy integer as an int; a dynamic int stays one. (Under
        # torch.compile another type, a numpy integer, is the op's to read: operator.index
        # fails in Dynamo.)
        offset = _int_arg(fn, "offset", offset)
    return offset


def _offset_as_rows(offset: Union[int, Tensor]) -> bool:
    """Whether a tensor offset is added on the device as positions offset .. offset + seq - 1
    (the same rows and bits) rather than read as the op's int: under torch.compile (the op's
    SymInt would read the value, .item(): a graph per value, and no graph at all under
    aot_eager / inductor), under torch.jit.trace (which would record the value as a
    constant: a traced decode step would add its trace-time rows ever after), and for an
    offset on a device in eager mode (reading it would be a device sync per call), and for
    one a torch.func transform wraps (under vmap a value per sample, which no int holds). A CPU
    offset in eager mode is read (free). The rows are then checked as positions are: an
    offset past the table is the kernel's IndexError for positions (a device-side assert on
    CUDA; the modules' check_positions checks them first), not the host's ValueError."""
    if not isinstance(offset, Tensor) or is_dtensor(offset):
        return False
    return (torch.compiler.is_compiling() or torch.jit.is_tracing() or offset.device.type != "cpu"
            or torch._C._functorch.is_functorch_wrapped_tensor(offset))


def _rows_of_offset(x: Tensor, offset: Tensor, batch_first: bool) -> Tensor:
    """Positions offset .. offset + seq - 1 on x's device (_offset_as_rows)."""
    seq = x.shape[1] if batch_first and x.dim() == 3 else x.shape[0]
    # No cast (a traced .to() records the example's dtype too): a graph fed a float offset
    # later gets float positions, the op's TypeError, where a cast to int64 would truncate
    # it silently (_offset_arg checked the example). A CPU scalar adds on any device.
    off = offset.reshape(())
    if off.device != x.device and off.device.type != "cpu":
        off = off.to(x.device)
    return torch.arange(seq, device=x.device) + off


def add_position(
    x: Tensor,
    table: Tensor,
    *,
    positions: Optional[Tensor] = None,
    offset: int = 0,
    batch_first: bool = True,
    p: float = 0.0,
    training: bool = True,
) -> Tensor:
    """``dropout(x + table[positions], p)`` in one fused pass.

    ``x`` is (batch, seq, d) when ``batch_first`` else (seq, batch, d); ``table`` is
    (max_len, d) or (1, max_len, d). Without ``positions`` rows ``offset .. offset+seq-1``
    are added (``offset`` an int or a one-element integer tensor; beside ``positions`` only
    the int 0, else a ValueError). ``positions`` is (seq,), (1, seq) or (batch, seq) whatever
    ``batch_first`` (as torch's ``key_padding_mask``): with ``batch_first=False`` pass (batch, seq) too (a (seq, batch)
    tensor of a square x would be read transposed). Dropout applies only when ``training``,
    with p resolved to multiples of 2**-16 (16 Philox bits an element) and the survivors
    scaled by 1/(1-p): the output's expectation is x within 2**-17/(1-p) relative (8e-6 at
    p = 0.1); past p = 0.9999 the kept share is far from 1 - p (docs/guide/sinusoidal.md);
    backward uses the forward's mask (saved as bits on the CPU, regenerated from its Philox
    (seed, offset) on CUDA). DTensor
    ``positions`` are range-checked as a whole (gathered: every rank raises the IndexError).
    """
    fn = "add_position"
    _tensor_arg(fn, "x", x), _tensor_arg(fn, "table", table)
    _optional_tensor_args(fn, positions=positions)
    offset = _offset_arg(fn, offset)
    batch_first, training = _bool_arg(fn, "batch_first", batch_first), _bool_arg(fn, "training", training)
    if not isinstance(p, torch.SymFloat):  # checked in eval mode too, with the op's message
        p = _float_arg(fn, "p", p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"posenc: expected dropout probability p in [0, 1], got {p}")
    if positions is not None and isinstance(offset, Tensor):
        # The op takes an int offset beside positions (0: not given); a tensor's value would be
        # read on the host, which compiled and exported code cannot do: refused on every road.
        raise ValueError(f"posenc: pass either offset or positions, not both (got a tensor offset beside "
                         f"positions: leave offset at its default 0); got offset={offset!r}")
    if positions is None and _offset_as_rows(offset):
        positions, offset = _rows_of_offset(x, offset, batch_first), 0
    table, positions = place_beside(x, table, positions)  # plain beside a DTensor x: replicated
    if is_dtensor(positions) and positions.dtype == torch.int64 and not torch.compiler.is_compiling():
        # The kernel checks each rank's shard: one rank alone would raise (the others block
        # in their next collective). The bounds of the global positions raise on every rank.
        torch.ops.posenc.position_bounds(positions, table.shape[-2])
    p = p if training else 0.0
    # (Not under torch.compile: Dynamo cannot trace the interpreter stack's read; func.md.)
    if not torch.compiler.is_compiling() and p > 0:
        x = _batched_by_randomness(x)
    out = torch.ops.posenc.add_position(x, table, positions, offset, batch_first, p)
    return placed_as(out, x) if is_dtensor(x) else out


def _batched_by_randomness(x: Tensor) -> Tensor:
    """x (the same values, bit for bit) batched wherever a vmap's randomness asks for a draw per
    sample. Under vmap, torch calls a custom op's batching rule only where an input is batched
    at that level; where none is, it calls the op once below the vmap, and the dropout drew one
    mask for every sample under randomness="different" and did not raise under "error" (a
    torch.func audit). A random op of torch's own, drawn here, follows the contract: batched
    under "different" (then so is x, and the op's rule draws per sample), refused under "error"
    with torch's message. Under "same" at every level nothing is drawn (the op's one call, or its
    rule, draws one mask for all samples from the generator's state as it is). Outside vmap,
    x as it is: the interpreter stack is read once."""
    functorch = torch._C._functorch
    stack = functorch.get_interpreter_stack() or ()
    if all(functorch.CVmapInterpreterPtr(i).randomness() == functorch.RandomnessType.Same
           for i in stack if i.key() == functorch.TransformType.Vmap):
        return x  # no vmap, or "same" at every level
    return torch.where(torch.rand((), device=x.device) >= 0, x, x)


# The modules call the functions through posenc.functional, the module users call (and
# patch); imported once add_position, which it re-exports from here, is defined, so either
# module may be imported first.
from posenc import functional  # noqa: E402


def _check_positions_on_host(positions: Tensor, max_len: int) -> None:
    """Range-check CUDA int64 positions (CPU ones are checked inside the kernel; other
    dtypes get the op's TypeError).

    Op ``position_bounds`` (shared with the C++ modules): one read-back of the smallest and
    largest position, one device sync, IndexError outside [0, max_len). The CUDA kernel
    checks on the device too, but a device-side assert is a RuntimeError at the next sync
    that leaves the CUDA context unusable, so eager mode checks here first. Under
    torch.compile the host check is left out (it would break the graph); the kernel's stays.
    """
    if (positions.is_cuda and positions.dtype == torch.int64 and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not is_dtensor(positions)):  # add_position checks those
        torch.ops.posenc.position_bounds(positions, max_len)


def _fusable_dropout(dropout: nn.Module) -> bool:
    """Whether the module's dropout child can run inside the fused op: exactly an
    ``nn.Dropout`` (a subclass may override forward) running ``nn.Dropout.forward`` as written
    (not a forward set on the child or on the class), that no hook would see, forward or
    backward (the fused op has no Dropout module call for a backward hook to attach to)."""
    return type(dropout) is nn.Dropout and _runs_as_written(dropout, _DROPOUT_FORWARD)


_DROPOUT_FORWARD = _written_forward(nn.Dropout)  # nn.Dropout.forward as torch wrote it


def _unfused_by_global_hooks_in_a_recomputable_call(dropout: nn.Module) -> bool:
    """Whether a training-mode dropout child that would fuse but for a global hook runs in a
    call that reentrant activation checkpointing makes: its forward (under no_grad) or its
    recomputation (inside a backward). The recomputation then decides again, and a hook
    present in only one of the two (a FlopCounterMode around the forward) sends the other to
    the fused op, whose mask is another draw: a wrong gradient, which the module warns of
    (found by an audit; the non-reentrant form raises a CheckpointError)."""
    return (not torch.compiler.is_compiling() and type(dropout) is nn.Dropout and dropout.training
            and dropout.p > 0 and _forward_as_written(dropout, _DROPOUT_FORWARD) and not _own_hooks(dropout)
            and _global_hooks() and (not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1))


class _AddPositionModule(nn.Module):
    """Shared front end: ``forward(x, offset=0, positions=None) = dropout(x + pe[rows])``
    through the fused op, with the classic ``nn.Dropout`` child and argument checks.

    ``check_positions`` (attribute, default True): range-check CUDA ``positions`` (and the
    rows of a CUDA tensor ``offset``, which is added on the device: reading it would be a sync
    of its own) on the host in eager mode, which costs one device sync. Set it to False in a hot loop whose
    positions are known to be valid (or under CUDA graph capture); an out-of-range position
    then stops the kernel with a device-side assert (a RuntimeError at the next sync). DTensor
    positions are checked whatever it says (their global bounds, gathered: one rank's kernel
    raising alone would leave the others blocked in their next collective).
    """

    pe: Tensor
    check_positions: bool = True
    _scripted_fused_dropout: bool = True  # set by __prepare_scriptable__

    def __init__(self, d_model: int, dropout: float, batch_first: bool) -> None:
        super().__init__()
        # The constructor's width (an attribute, which a scripted module keeps; a property
        # would not be: TorchScript hands back the property object). What forward, load_table
        # and repr read is pe's last size, which follows a replaced table.
        self.d_model = _check_positive_int(type(self).__name__, "d_model", d_model)
        self.batch_first = _bool_arg(type(self).__name__, "batch_first", batch_first)
        # An nn.Dropout child as in the classic class: `module.dropout.p` stays settable.
        self.dropout = nn.Dropout(p=_check_probability(type(self).__name__, "dropout", dropout))

    @property
    def max_len(self) -> int:
        """The positions ``pe`` holds (its second-to-last size): it follows a table that is
        replaced or loaded, as forward does."""
        return self.pe.shape[-2]

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        """``dropout(x + pe[0, offset:offset+S])``, or ``pe[0, positions]`` when given:
        :func:`posenc.functional.add_position` with the module's table and dropout.

        The dropout is fused into the add while the ``dropout`` child is a plain
        ``nn.Dropout`` without hooks (forward or backward, its own or global) running
        ``nn.Dropout.forward`` as written, in the child's own training mode
        (``module.dropout.eval()`` switches it off, as in the classic class). A child that is
        replaced (``nn.Identity()``, another dropout, a subclass), hooked or given another
        ``forward`` is
        called on ``x + pe[rows]`` as the classic class calls it, so it runs and its hooks see
        what they would see there. The two draw different masks from one generator state:
        a recomputation (activation checkpointing) must see the hooks its forward saw."""
        dropout = self.dropout
        if torch.jit.is_scripting():  # what TorchScript compiles: the op the function calls
            pe = self._table(self.pe)
            if self._scripted_fused_dropout and hasattr(dropout, "p"):
                if not 0.0 <= dropout.p <= 1.0:  # in eval mode too, as nn.Dropout
                    raise ValueError("posenc: expected dropout probability p in [0, 1], got " + str(dropout.p))
                p = dropout.p if dropout.training else 0.0
                return torch.ops.posenc.add_position(x, pe, positions, offset, self.batch_first, p)
            return dropout(torch.ops.posenc.add_position(x, pe, positions, offset, self.batch_first, 0.0))
        pe, positions, offset = self._host_side(x, offset, positions)
        pe = self._table(pe)
        fused = _fusable_dropout(dropout)
        # The child's own mode, as nn.Dropout reads it (module.train(); module.dropout.eval()
        # turns dropout off; module.eval(); module.dropout.train() is MC dropout).
        # p is checked in eval mode too, as nn.Dropout's F.dropout checks it.
        p, training = (dropout.p, dropout.training) if fused else (0.0, False)
        if not fused and _unfused_by_global_hooks_in_a_recomputable_call(dropout):
            warnings.warn(f"{type(self).__name__}: its dropout runs as nn.Dropout (not fused) because a global "
                          f"module hook is registered (FlopCounterMode, ModuleTracker, "
                          f"register_module_forward_hook), under no_grad or inside a backward: if this is "
                          f"torch.utils.checkpoint(use_reentrant=True)'s forward or recomputation and the hook "
                          f"is not there in the other one, the two draw different masks and the gradient is "
                          f"wrong; use use_reentrant=False (which refuses that) or keep the hook for both",
                          stacklevel=2)
        y = functional.add_position(x, pe, positions=positions, offset=offset, batch_first=self.batch_first, p=p,
                                    training=training)
        return y if fused else dropout(y)

    def _table(self, pe: Tensor) -> Tensor:
        """The table forward adds (LearnedPositionalEncoding: its padding row frozen)."""
        return pe

    def __prepare_scriptable__(self) -> "_AddPositionModule":
        """Called by ``torch.jit.script`` before it compiles forward: records whether the
        dropout child is fusable as eager mode decides it (_fusable_dropout: a plain
        nn.Dropout running its forward as written, without hooks; TorchScript cannot test a module's class reliably: its
        isinstance knows only module classes it has compiled before)."""
        self._scripted_fused_dropout = _fusable_dropout(self.dropout)
        return self

    def _host_side(
        self, x: Tensor, offset: Union[int, Tensor], positions: Optional[Tensor]
    ) -> Tuple[Tensor, Optional[Tensor], Union[int, Tensor]]:
        """What eager mode checks on the host and places beside a DTensor x, for forward:
        (pe, positions, offset) to call the function with."""
        if positions is None and self.check_positions:
            offset = _offset_arg("add_position", offset)
            if _offset_as_rows(offset):  # a device offset's rows, checked as positions are
                positions, offset = _rows_of_offset(x, offset, self.batch_first), 0
        if positions is not None and self.check_positions:
            _check_positions_on_host(positions, self.max_len)
        if is_dtensor(x):
            return (*self._beside_dtensor(x, positions), offset)
        return self.pe, positions, offset

    def _beside_dtensor(self, x: Tensor, positions: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """(pe, positions) for a DTensor x, as the functions place their plain tensors: a plain
        buffer ``pe`` (PositionalEncoding's fixed table, the same on every rank) and plain
        positions become Replicate() DTensors on x's mesh. A plain parameter ``pe``
        (LearnedPositionalEncoding not distributed yet) is refused: each rank would train its
        own copy."""
        if isinstance(self.pe, nn.Parameter) and not is_dtensor(self.pe):
            raise RuntimeError(
                f"{type(self).__name__}: parameter 'pe' is a plain tensor but the input is a DTensor; "
                f"distribute the module's parameters first (distribute_module, parallelize_module or "
                f"fully_shard)"
            )
        pe, positions = place_beside(x, self.pe, positions)
        return pe, positions

    def extra_repr(self) -> str:
        return f"d_model={self.pe.shape[-1]}, max_len={self.max_len}, batch_first={self.batch_first}"


class PositionalEncoding(_AddPositionModule):
    r"""Fixed sinusoidal positional encoding with fused dropout.

    A drop-in replacement for the classic ``PositionalEncoding(d_model, dropout,
    max_len=5000)`` of the Annotated Transformer: same arguments, a persistent buffer ``pe``
    of shape (1, max_len, d_model) in the default dtype unless ``dtype=`` (so ``state_dict()`` holds exactly
    ``pe``), and ``forward(x) = dropout(x + pe[:, :S])``, computed in one pass. The output
    keeps x's dtype (the classic ``x + pe`` promotes half x with a float32 ``pe`` to
    float32).

    Args:
        d_model: embedding width. Odd values work: the last column is a sine.
        dropout: dropout probability applied in training mode.
        max_len: number of positions in ``pe``.
        batch_first: x is (batch, seq, d_model) if True (the classic layout), else
            (seq, batch, d_model) (the PyTorch-tutorial layout).
        base: wavelength base of the sinusoids (10000 in the paper).
        device, dtype: ``pe``'s device and dtype (torch's factory arguments, as
            ``nn.Embedding`` takes them; float16, bfloat16, float32 or float64), default the
            default device and dtype.

    ``pe`` is built in float64 and rounded once to its dtype: in float32 every entry is
    within 2**-25 of the exact value (the classic float32 construction is off by up to ~4e-4
    at max_len 5000); in another dtype, within half an ulp of it.
    The forward adds rows of ``pe`` as it is, so a loaded or edited table is honoured.

    A DTensor ``x`` needs no wrapper: ``pe`` (a buffer, the same on every rank) and plain
    ``positions`` are used as ``Replicate()`` on x's mesh, as the functions place plain
    tensors (:class:`LearnedPositionalEncoding`, whose ``pe`` is trained, needs its parameter
    distributed first).
    """

    def __init__(
        self,
        d_model: int,
        dropout: float = 0.1,
        max_len: int = 5000,
        *,
        batch_first: bool = True,
        base: float = 10000.0,
        device: Optional[Union[torch.device, str, int]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(d_model, dropout, batch_first)
        max_len = _check_positive_int(type(self).__name__, "max_len", max_len)
        fn, expected = type(self).__name__, "a finite number > 1"
        if not 1 < _real(fn, "base", base, expected) < math.inf:
            raise ValueError(f"{fn}: expected base to be {expected}, got {base!r}")
        self._base = float(base)
        # In the default dtype (float32 unless torch.set_default_dtype), as the classic
        # module's torch.zeros(max_len, d_model) is, unless dtype says otherwise.
        self.register_buffer("pe", torch.empty(1, max_len, self.d_model, device=device,
                                               dtype=None if dtype is None else _table_dtype(fn, dtype)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Build ``pe`` in place (what ``__init__`` calls): the sinusoidal table computed on
        the CPU in float64 (libm's bits, whatever ``pe``'s device: CUDA's sin and cos are
        not glibc's), rounded once to ``pe``'s dtype and copied to its device. What
        ``to_empty`` leaves uninitialised (meta-device construction, FSDP's
        ``param_init_fn``) and an edited table become the table again; a meta ``pe`` has no
        values to build."""
        if self.pe.is_meta:
            return
        positions = torch.arange(self.pe.shape[-2], dtype=torch.int64, device="cpu")  # not the default device
        dtype = self.pe.dtype if self.pe.dtype in _TABLE_DTYPES else torch.float64  # rounded once either way
        table = functional.sinusoidal_table(positions, self.pe.shape[-1], base=self.base, dtype=dtype)
        table = table.view(self.pe.shape)
        if is_dtensor(self.pe):  # distribute_module: each rank's part of the whole table
            from torch.distributed.tensor import distribute_tensor

            table = distribute_tensor(table.to(self.pe.device), self.pe.device_mesh, self.pe.placements,
                                      src_data_rank=None)  # every rank built the same table
        self.pe.copy_(table)

    @property
    def base(self) -> float:
        """The wavelength base the constructor and :meth:`reset_parameters` build ``pe`` with
        (read-only). A loaded (``load_state_dict``) or assigned ``pe`` is used as it is, whatever
        base made it; this attribute does not follow it."""
        return self._base

    def __setstate__(self, state: dict) -> None:
        if "base" in state:  # pickled before 2026-12-05, when base was a plain attribute
            state = dict(state)
            state["_base"] = state.pop("base")
        super().__setstate__(state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}"


def _normalised_padding_idx(padding_idx: Any, max_len: int) -> Optional[int]:
    """LearnedPositionalEncoding's padding_idx as nn.Embedding reads it: None, or an int in
    [-max_len, max_len), a negative one counted from the end."""
    if padding_idx is None:
        return None
    index = _integer(padding_idx)
    if index is None:
        raise TypeError(f"LearnedPositionalEncoding: expected padding_idx to be an int or None, got {padding_idx!r}")
    return _padding_row(int(index), max_len)


def _padding_row(index: int, rows: int) -> int:
    """padding_idx in [-rows, rows) as its row (a negative one from the end); out of range
    refused. TorchScript compiles it too (a scripted module's padding_idx skips __setattr__)."""
    if index < -rows or index >= rows:
        raise ValueError("LearnedPositionalEncoding: expected padding_idx in [-max_len, max_len) = [" + str(-rows)
                         + ", " + str(rows) + "), got " + str(index))
    return index + rows if index < 0 else index


class LearnedPositionalEncoding(_AddPositionModule):
    r"""Learned absolute position embeddings (BERT, GPT-2, ViT) with fused dropout.

    Same arguments and forward as :class:`PositionalEncoding` (``batch_first``: x is (batch,
    seq, d_model) if True, the default, else (seq, batch, d_model)), plus ``init_std`` and
    ``padding_idx`` (below); ``pe`` is an ``nn.Parameter`` of shape (1, max_len, d_model),
    initialised from a normal distribution with std ``init_std`` truncated at +-2 std
    (TensorFlow BERT's truncated_normal initializer; the resulting std is about 0.88 init_std. timm's ViT calls
    ``trunc_normal_(std=.02)`` with bounds +-2 in absolute terms, in effect untruncated, and
    Hugging Face BERT a plain normal: call ``nn.init`` on ``pe`` to match either). Its gradient is the
    sum over the batch of the gradient reaching x, for exactly the positions used.

    A ViT-style ``pos_embed`` of shape (1, N, d) loads directly through ``load_state_dict``
    (key ``pe``); a BERT/GPT-2 table of shape (max_len, d) (``position_embeddings.weight``,
    ``wpe.weight``) loads through :meth:`load_table`.

    ``padding_idx`` (``nn.Embedding``'s, as fairseq, RoBERTa and XLM-R give their position
    tables: :func:`~posenc.functional.make_positions` puts padding tokens on that row): the
    row is zeroed by :meth:`reset_parameters` and gets no gradient (forward adds it as it is,
    so a loaded or edited row is added; it is read detached in each call with grad enabled:
    a graph traced or exported under no_grad has no freeze). A negative value counts from
    the end. ``device`` and ``dtype``: ``pe``'s, as :class:`PositionalEncoding` takes them.
    """

    padding_idx: Optional[int] = None  # modules pickled before the argument have none

    def __init__(
        self,
        d_model: int,
        dropout: float = 0.1,
        max_len: int = 5000,
        *,
        batch_first: bool = True,
        init_std: float = 0.02,
        padding_idx: Optional[int] = None,
        device: Optional[Union[torch.device, str, int]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(d_model, dropout, batch_first)
        max_len = _check_positive_int(type(self).__name__, "max_len", max_len)
        fn, expected = type(self).__name__, "a finite non-negative number"
        if not 0 <= _real(fn, "init_std", init_std, expected) < math.inf:
            raise ValueError(f"{fn}: expected init_std to be {expected}, got {init_std!r}")
        self.init_std = float(init_std)
        self.padding_idx = _normalised_padding_idx(padding_idx, max_len)
        self.pe = nn.Parameter(torch.empty(1, max_len, self.d_model, device=device,
                                           dtype=None if dtype is None else _table_dtype(fn, dtype)))
        self.reset_parameters()

    def __setattr__(self, name: str, value: Any) -> None:
        # padding_idx set after construction is read as the constructor reads it (a negative
        # one from the end; out of range refused): -1 froze no row (a fuzzing audit).
        if name == "padding_idx" and ("pe" in self.__dict__.get("_parameters", {}) or hasattr(type(self), "pe")):
            value = _normalised_padding_idx(value, self.max_len)
        super().__setattr__(name, value)

    def reset_parameters(self) -> None:
        if self.init_std == 0:
            nn.init.zeros_(self.pe)  # trunc_normal_ divides by its (zero) width
        else:
            nn.init.trunc_normal_(self.pe, std=self.init_std, a=-2 * self.init_std, b=2 * self.init_std)
        if self.padding_idx is not None:
            with torch.no_grad():
                # Through a mask beside pe, not pe[..., p, :].zero_(): on a table sharded over
                # positions (FSDP2's Shard(1)) DTensor's indexing gathers, and the zeros went
                # to a copy (the row stayed random, and frozen).
                self.pe.masked_fill_(~self._padding_keep(self.pe), 0.0)

    def _table(self, pe: Tensor) -> Tensor:
        """pe with no gradient reaching row padding_idx (the same values: the row is read
        detached, its forward-mode tangent too, so jacfwd and jacrev agree); pe itself without
        padding_idx, or for a table nothing differentiates (no copy): under no_grad or frozen,
        and no forward-mode tangent or torch.func transform on it (torch.func.jvp's table does
        not require grad: its tangent was kept where a dual of a trainable one lost it).
        Decided per call: a graph exported under no_grad has no freeze. Compiled, the freeze
        is always taken (a tangent traced under torch.compile cannot be told apart; the where
        fuses into the add); traced by torch.jit.trace, whenever pe requires grad (the trace's
        check runs the module again under no_grad: a graph without the freeze there failed
        it, a TracingCheckError)."""
        padding_idx = self.padding_idx
        if padding_idx is None:
            return pe
        if not (torch.is_grad_enabled() and pe.requires_grad):
            untracked = True  # scripted: grad mode alone decides
            if not torch.jit.is_scripting():
                untracked = not (torch.compiler.is_compiling() or (torch.jit.is_tracing() and pe.requires_grad)
                                 or torch._C._functorch.is_functorch_wrapped_tensor(pe)
                                 or fwAD.unpack_dual(pe).tangent is not None)
            if untracked:
                return pe
        return torch.where(self._padding_keep(pe), pe, pe.detach())

    def _padding_keep(self, pe: Tensor) -> Tensor:
        """(max_len, 1) bool: False at row padding_idx; replicated beside a DTensor pe (FSDP2,
        tensor parallel)."""
        padding_idx = self.padding_idx
        assert padding_idx is not None
        rows = pe.shape[-2]
        # A scripted module's padding_idx set after scripting skips __setattr__: read as the
        # constructor reads it here too (-1 froze no row there; out of range refused).
        keep = (torch.arange(rows, device=pe.device) != _padding_row(padding_idx, rows)).view(-1, 1)
        if not torch.jit.is_scripting():  # (TorchScript compiles no DTensor test)
            keep = place_beside(pe, keep)[0]
        return keep

    @torch.no_grad()
    def load_table(self, table: Tensor) -> None:
        """Copy a (max_len, d_model) or (1, max_len, d_model) table into ``pe``."""
        if not isinstance(table, Tensor):
            raise TypeError(f"load_table: expected table to be a Tensor, got {type(table).__name__}")
        if table.dim() not in (2, 3) or (table.dim() == 3 and table.shape[0] != 1) or (
            tuple(table.shape[-2:]) != tuple(self.pe.shape[1:])
        ):
            raise ValueError(
                f"load_table: expected a table of shape ({self.max_len}, {self.pe.shape[-1]}) or "
                f"(1, {self.max_len}, {self.pe.shape[-1]}), got {tuple(table.shape)}"
            )
        if table.is_complex() or (table.is_meta and not self.pe.is_meta):  # copy_ would drop the imaginary
            # part / has no data to copy (a meta module, deferred init, loads a meta table as a no-op)
            raise TypeError(f"load_table: expected a real table that holds data, got dtype {table.dtype} on "
                            f"{table.device}")
        with torch.no_grad():
            if is_dtensor(self.pe) and not is_dtensor(table):
                # FSDP2 / DTensor-sharded pe: the plain table is the whole (replicated) one and
                # each rank copies its own shard of it.
                from torch.distributed.tensor import distribute_tensor

                table = distribute_tensor(table.reshape(self.pe.shape).to(self.pe.device), self.pe.device_mesh,
                                          self.pe.placements)
            if parametrize.is_parametrized(self, "pe"):
                # pe is computed from its parametrization's original: a copy into it went to the
                # computed copy and was lost (a fuzzing audit). Set as `module.pe = table` sets it,
                # through the parametrization's right_inverse (torch refuses one without).
                self.pe = table.reshape(self.pe.shape).to(self.pe.device, self.pe.dtype)  # as copy_ casts
                return
            if "pe" not in self._parameters:  # computed by a hook (torch.nn.utils.weight_norm)
                raise RuntimeError("load_table: pe is computed from other parameters here (a hook such as "
                                   "torch.nn.utils.weight_norm's): load those, or remove the hook first")
            self.pe.copy_(table.reshape(self.pe.shape))

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{super().extra_repr()}, init_std={self.init_std}{padding}"


def _empty_batch(op: "torch._ops.OpOverload", args: tuple, in_dims: tuple, out_dims: Any) -> Any:
    """A vmap over no sample (batch size 0): the op's outputs with a leading 0, their per-sample
    shapes and dtypes from its Meta kernel (no data read, no random number drawn)."""
    device = next(a.device for a in args if isinstance(a, Tensor))
    sample = [(torch.empty(a.shape[:d] + a.shape[d + 1:], dtype=a.dtype, device="meta") if d is not None
               else a.to("meta")) if isinstance(a, Tensor) else a for a, d in zip(args, in_dims)]
    outs = op(*sample)
    empty = [torch.empty((0, *o.shape), dtype=o.dtype, device=device) for o in (outs if isinstance(outs, tuple) else
                                                                                 (outs,))]
    return (tuple(empty) if isinstance(outs, tuple) else empty[0]), out_dims


def _dropout_batch_rule(op: "torch._ops.OpOverload", rng_output: bool):
    """vmap of an add_position op: one call per sample (as torch's fallback), but keeping
    vmap's ``randomness`` contract for the dropout draw, as torch's own dropout does: "error"
    raises, "same" gives every sample one mask, "different" (and p == 0) draws per sample.
    Under "same" the first sample draws, and the others get its mask from its rng state:
    add_position_backward(add_position(x, table, p=0) in the op's compute precision, rng, p),
    the op's own numbers bit for bit, with one draw from the generator (restoring its state
    before each sample, as this did, rewound the process's generator under other threads'
    draws). ``rng_output``: the op also returns its rng state (add_position_forward), shared
    by the samples under "same"."""
    schema = op._schema.arguments
    names = [a.name for a in schema]
    defaults = [a.default_value for a in schema]

    def rule(info, in_dims, *args, **kwargs):
        n = len(args)
        args = tuple(args) + tuple(kwargs.get(nm, d) for nm, d in zip(names[n:], defaults[n:]))
        in_dims = tuple(in_dims) + (None,) * (len(args) - n)
        p = args[names.index("p")]
        random = p > 0
        if random and info.randomness == "error":
            raise RuntimeError(
                f"vmap: called random operation while in randomness error mode ({op._schema.name} with "
                f"p={p}). Please either use the 'same' or 'different' randomness flags on vmap or perform the "
                "randomness operation out of vmap")
        same = random and info.randomness == "same"
        if info.batch_size == 0:
            return _empty_batch(op, args, in_dims, (0, 0) if rng_output else 0)

        def sample(i):
            return [a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)]

        results = []
        if same and info.batch_size > 0:
            first = sample(0)
            out, rng = op(*first) if rng_output else torch.ops.posenc.add_position_forward(*first, False)
            results.append((out, rng) if rng_output else out)
            for i in range(1, info.batch_size):
                xi, table, positions, offset, batch_first = sample(i)[:5]
                wide = xi if xi.dtype == torch.float64 else xi.float()  # the op's compute precision
                summed = torch.ops.posenc.add_position(wide, table, positions, offset, batch_first, 0.0)
                out = torch.ops.posenc.add_position_backward(summed, rng, p).to(xi.dtype)
                results.append((out, rng) if rng_output else out)
        else:
            results = [op(*sample(i)) for i in range(info.batch_size)]
        if not rng_output:
            return torch.stack(results), 0
        out = torch.stack([r[0] for r in results])
        if same or not random:
            return (out, results[0][1]), (0, None)
        return (out, torch.stack([r[1] for r in results])), (0, 0)

    return rule


torch.library.register_vmap("posenc::add_position", _dropout_batch_rule(torch.ops.posenc.add_position.default, False))
torch.library.register_vmap(
    "posenc::add_position_forward", _dropout_batch_rule(torch.ops.posenc.add_position_forward.default, True))


def _backward_batch_rule(info, in_dims, grad, rng, p):
    """vmap of add_position_backward (the gradient of a vmapped add_position with dropout):
    one call per sample, each with its sample's rng state (batched under "different"
    randomness) or the shared one ("same"): the mask is drawn by each element's index in its
    sample, so the samples cannot be one call (torch's fallback did the same loop, with a
    performance warning that asked users to file an issue on PyTorch)."""
    grad_dim, rng_dim = in_dims[0], in_dims[1]
    if info.batch_size == 0:
        return _empty_batch(torch.ops.posenc.add_position_backward.default, (grad, rng, p), tuple(in_dims) + (None,), 0)
    outs = []
    for i in range(info.batch_size):
        g = grad if grad_dim is None else grad.select(grad_dim, i)
        r = rng if rng_dim is None else rng.select(rng_dim, i)
        outs.append(torch.ops.posenc.add_position_backward(g, r, p))
    return torch.stack(outs), 0


torch.library.register_vmap("posenc::add_position_backward", _backward_batch_rule)
