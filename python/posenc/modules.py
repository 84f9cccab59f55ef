"""nn.Module front ends of the posenc ops.

Each module's forward calls the function users call (:mod:`posenc.functional`), which calls
the op: one road, through ``nn.Module.__call__`` (hooks, profiler, module traces see every
call). The add-position modules' forward is also what ``torch.jit.script`` compiles: under
``torch.jit.is_scripting()`` it calls the op the function calls (the host-side checks and
DTensor placement are eager-only), so a scripted module computes what the eager one does, in
train and eval mode, and scripting leaves the Python model as it was (no twin). No ``from __future__ import
annotations`` here: TorchScript reads the annotations as types.
"""

import math
import numbers
import types
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from posenc import _rope, functional
from posenc._common import _check_positive_int, _check_probability
from posenc._dtensor import is_dtensor, place_beside
from posenc._helpers import Timesteps

__all__ = ["PositionalEncoding", "LearnedPositionalEncoding", "RotaryPositionalEncoding", "Timesteps"]


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
            and not torch.jit.is_tracing()):
        torch.ops.posenc.position_bounds(positions, max_len)


class _AddPositionModule(nn.Module):
    """Shared front end: ``forward(x, offset=0, positions=None) = dropout(x + pe[rows])``
    through the fused op, with the classic ``nn.Dropout`` child and argument checks.

    ``check_positions`` (attribute, default True): range-check CUDA ``positions`` on the
    host in eager mode, which costs one device sync. Set it to False in a hot loop whose
    positions are known to be valid (or under CUDA graph capture); an out-of-range position
    then stops the kernel with a device-side assert (a RuntimeError at the next sync).
    """

    pe: Tensor
    check_positions: bool = True

    def __init__(self, d_model: int, dropout: float, max_len: int, batch_first: bool) -> None:
        super().__init__()
        self.d_model = _check_positive_int("d_model", d_model)
        self.max_len = _check_positive_int("max_len", max_len)
        self.batch_first = bool(batch_first)
        # An nn.Dropout child as in the classic class: `module.dropout.p` stays settable.
        self.dropout = nn.Dropout(p=_check_probability("dropout", dropout))

    def forward(self, x: Tensor, offset: int = 0, positions: Optional[Tensor] = None) -> Tensor:
        """``dropout(x + pe[0, offset:offset+S])``, or ``pe[0, positions]`` when given:
        :func:`posenc.functional.add_position` with the module's table and dropout."""
        p = self.dropout.p if self.training else 0.0
        if torch.jit.is_scripting():  # what TorchScript compiles: the op the function calls
            return torch.ops.posenc.add_position(x, self.pe, positions, offset, self.batch_first, p)
        pe, positions = self._host_side(x, offset, positions)
        return functional.add_position(x, pe, positions=positions, offset=offset, batch_first=self.batch_first, p=p)

    def _host_side(self, x: Tensor, offset: int, positions: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        """What eager mode checks on the host and places beside a DTensor x, for forward:
        (pe, positions) to call the function with."""
        if isinstance(offset, bool):  # the op's SymInt would take True as 1
            raise TypeError(f"{type(self).__name__}: expected offset to be an int, got {offset!r}")
        if positions is not None and self.check_positions:
            _check_positions_on_host(positions, self.pe.shape[1])
        if is_dtensor(x):
            return self._beside_dtensor(x, positions)
        return self.pe, positions

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
        return f"d_model={self.d_model}, max_len={self.max_len}, batch_first={self.batch_first}"



class PositionalEncoding(_AddPositionModule):
    r"""Fixed sinusoidal positional encoding with fused dropout.

    A drop-in replacement for the classic ``PositionalEncoding(d_model, dropout,
    max_len=5000)`` of the Annotated Transformer: same arguments, a persistent float32
    buffer ``pe`` of shape (1, max_len, d_model) (so ``state_dict()`` holds exactly
    ``pe``), and ``forward(x) = dropout(x + pe[:, :S])``, computed in one pass.

    Args:
        d_model: embedding width. Odd values work: the last column is a sine.
        dropout: dropout probability applied in training mode.
        max_len: number of positions in ``pe``.
        batch_first: x is (batch, seq, d_model) if True (the classic layout), else
            (seq, batch, d_model) (the PyTorch-tutorial layout).
        base: wavelength base of the sinusoids (10000 in the paper).

    ``pe`` is built in float64 and rounded once: every entry is within 2**-25 of the
    exact value (the classic float32 construction is off by up to ~4e-4 at max_len 5000).
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
    ) -> None:
        super().__init__(d_model, dropout, max_len, batch_first)
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 1 < base < math.inf:
            raise ValueError(f"expected base to be a finite number > 1, got {base!r}")
        self.base = float(base)
        positions = torch.arange(self.max_len, dtype=torch.int64)
        table = functional.sinusoidal_table(positions, self.d_model, base=self.base)
        self.register_buffer("pe", table.unsqueeze(0))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}"


class LearnedPositionalEncoding(_AddPositionModule):
    r"""Learned absolute position embeddings (BERT, GPT-2, ViT) with fused dropout.

    Same arguments and forward as :class:`PositionalEncoding`, but ``pe`` is an
    ``nn.Parameter`` of shape (1, max_len, d_model), initialised from a normal distribution
    with std ``init_std`` truncated at +-2 std (TensorFlow BERT's truncated_normal
    initializer; the resulting std is about 0.88 init_std. timm's ViT calls
    ``trunc_normal_(std=.02)`` with bounds +-2 in absolute terms, in effect untruncated, and
    Hugging Face BERT a plain normal: call ``nn.init`` on ``pe`` to match either). Its gradient is the
    sum over the batch of the gradient reaching x, for exactly the positions used.

    A ViT-style ``pos_embed`` of shape (1, N, d) loads directly through ``load_state_dict``
    (key ``pe``); a BERT/GPT-2 table of shape (max_len, d) (``position_embeddings.weight``,
    ``wpe.weight``) loads through :meth:`load_table`.
    """

    def __init__(
        self,
        d_model: int,
        dropout: float = 0.1,
        max_len: int = 5000,
        *,
        batch_first: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(d_model, dropout, max_len, batch_first)
        if isinstance(init_std, bool) or not isinstance(init_std, numbers.Real) or not 0 <= init_std < math.inf:
            raise ValueError(f"expected init_std to be a finite non-negative number, got {init_std!r}")
        self.init_std = float(init_std)
        self.pe = nn.Parameter(torch.empty(1, self.max_len, self.d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_std == 0:
            nn.init.zeros_(self.pe)  # trunc_normal_ divides by its (zero) width
        else:
            nn.init.trunc_normal_(self.pe, std=self.init_std, a=-2 * self.init_std, b=2 * self.init_std)

    @torch.no_grad()
    def load_table(self, table: Tensor) -> None:
        """Copy a (max_len, d_model) or (1, max_len, d_model) table into ``pe``."""
        if not isinstance(table, Tensor) or table.dim() not in (2, 3) or (
            table.dim() == 3 and table.shape[0] != 1
        ) or tuple(table.shape[-2:]) != tuple(self.pe.shape[1:]):
            shape = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
            raise ValueError(
                f"load_table: expected a table of shape ({self.max_len}, {self.d_model}) or "
                f"(1, {self.max_len}, {self.d_model}), got {shape}"
            )
        with torch.no_grad():
            if is_dtensor(self.pe) and not is_dtensor(table):
                # FSDP2 / DTensor-sharded pe: the plain table is the whole (replicated) one and
                # each rank copies its own shard of it.
                from torch.distributed.tensor import distribute_tensor

                table = distribute_tensor(table.reshape(self.pe.shape).to(self.pe.device), self.pe.device_mesh,
                                          self.pe.placements)
            self.pe.copy_(table.reshape(self.pe.shape))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init_std={self.init_std}"


def _check_length_baseline(scaling: dict, rope_type: str, max_len: int) -> None:
    """A type that scales by length with original_max_position_embeddings defaulting to the
    model's ("dynamic") rescales only when a call's positions pass that baseline, and the
    module refuses positions at or beyond max_len: a baseline at or above max_len (or the
    default, max_len) would make the scaling a silent no-op."""
    orig = scaling.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError(
            f"RotaryPositionalEncoding: {rope_type!r} scaling needs 'original_max_position_embeddings' "
            f"(the context length the model was trained on, Hugging Face's max_position_embeddings), "
            f"below max_len={max_len}: positions beyond it are what it rescales"
        )
    if orig >= max_len:
        raise ValueError(
            f"RotaryPositionalEncoding: {rope_type!r} scaling with original_max_position_embeddings={orig} "
            f">= max_len={max_len} would never apply (positions stop below max_len); expected it below max_len"
        )


class RotaryPositionalEncoding(nn.Module):
    r"""Rotary position embedding (RoPE, Su et al.) of queries and keys, fused for q and k.

    ``q, k = rope(q, k)`` returns rotated copies (one kernel launch for both); ``x =
    rope(x)`` rotates one tensor (torchtune's ``RotaryPositionalEmbeddings`` call form).
    Positions are ``0 .. seq-1`` plus ``offset`` (an int, or an int64 (batch,) tensor of
    per-sequence KV-cache lengths), or ``positions`` (int64 (seq,) or (batch, seq)).

    Args:
        dim: head_dim of q and k.
        max_len: positions must lie in ``[0, max_len)``; a clear error is raised otherwise
            (the functional :func:`posenc.functional.apply_rope` has no limit).
        base: RoPE base ("rope_theta"; default 10000, or the scaling dict's ``rope_theta``).
        interleaved: rotate adjacent pairs (GPT-J, Meta LLaMA, torchtune) instead of halves
            (GPT-NeoX, Hugging Face ``rotate_half``).
        rotary_dim: rotate only the first ``rotary_dim`` features (partial rotary);
            default ``dim`` (``2 * sum(sections)`` with sections).
        scaling: None or a Hugging Face ``rope_scaling`` dict ("linear", "dynamic", "yarn",
            "llama3", "longrope" or "proportional"). "dynamic" needs
            ``original_max_position_embeddings`` below ``max_len`` (the trained context,
            Hugging Face's ``max_position_embeddings``: positions beyond it are what it
            rescales); for "yarn" it defaults to ``max_len``, and "longrope"'s ``factor`` to
            ``max_len / original_max_position_embeddings``.
        layout: "bshd" (default), "bhsd", "sbhd" or "thd" (packed, with ``cu_seqlens``).
        sections, sections_mode: multi-axis RoPE (Qwen2-VL M-RoPE, axial 2-D/3-D RoPE), as
            in :func:`posenc.functional.apply_rope`; positions are then (n_axes, ...) and
            every coordinate must lie in ``[0, max_len)``.

    ``inv_freq`` is a non-persistent float32 buffer (Hugging Face's name and convention, so
    state_dicts stay clean) holding the frequencies for inspection; the kernel evaluates them
    itself in float64 from the configuration, so a dtype cast of the module does not change
    the numbers. ``attention_scaling`` is yarn's factor on cos and sin (1 otherwise).

    ``check_positions`` (attribute, default True): positions given as CUDA tensors are
    range-checked on the host in eager mode, one device sync; set it to False in a hot loop
    whose positions are known to be valid.
    """

    inv_freq: Tensor
    check_positions: bool = True

    def __init__(
        self,
        dim: int,
        max_len: int = 4096,
        base: Optional[float] = None,
        *,
        interleaved: bool = False,
        rotary_dim: Optional[int] = None,
        scaling: Optional[Mapping[str, Any]] = None,
        layout: str = "bshd",
        sections: Optional[Sequence[int]] = None,
        sections_mode: str = "axial",
    ) -> None:
        super().__init__()
        self.dim = _check_positive_int("dim", dim)
        self.max_len = _check_positive_int("max_len", max_len)
        # A transformers 4/5 dict's rope_theta, partial_rotary_factor and mrope_section set
        # base, rotary_dim and sections (an explicit argument that disagrees is an error).
        scaling, base, rotary_dim, sections, sections_mode = _rope.resolve_config_keys(
            scaling, base=base, rotary_dim=rotary_dim, head_dim=self.dim, sections=sections,
            sections_mode=sections_mode, fn="RotaryPositionalEncoding")
        base = 10000.0 if base is None else base
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 1 < base < math.inf:
            raise ValueError(f"expected base to be a finite number > 1, got {base!r}")
        sections = None if sections is None else _rope._sections(sections)
        if rotary_dim is None:  # all of dim, or what the sections rotate
            rotary_dim = self.dim if sections is None else 2 * sum(max(s, 0) for s in sections)
        rotary_dim = _check_positive_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 != 0 or rotary_dim > self.dim:
            raise ValueError(f"expected rotary_dim to be even and at most dim={self.dim}, got {rotary_dim}")
        if layout not in _rope.LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(_rope.LAYOUTS)}")
        self._scaling = None if scaling is None else dict(scaling)
        # The configuration, parsed once (with the model defaults max_len gives the scaling
        # keys) and passed on at every call; the settings below read it (read-only: a
        # changed setting would have to be parsed again: build a new module).
        self.rope_config = _rope.RopeConfig.parse(
            head_dim=self.dim, base=float(base), interleaved=interleaved, rotary_dim=rotary_dim,
            scaling=self._scaling, layout=layout, sections=sections, sections_mode=sections_mode,
            max_position_embeddings=self.max_len, fn="RotaryPositionalEncoding")
        c = self.rope_config
        if c.rope_type in _rope.LENGTH_SCALED_TYPES and c.rope_type in _rope.ORIGINAL_FROM_MODEL_TYPES:
            _check_length_baseline(self._scaling, c.rope_type, self.max_len)
        # Checks every value once (the op's own checks) and gives the frequencies.
        inv_freq, factor = torch.ops.posenc.rope_frequencies(
            c.rotary_dim, c.base, c.rope_type, list(c.scaling), 0, list(c.sections), c.sections_mode
        )
        self.attention_scaling = float(factor)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(
        self,
        q: Tensor,
        k: Optional[Tensor] = None,
        *,
        positions: Optional[Tensor] = None,
        offset: Union[int, Tensor] = 0,
        cu_seqlens: Optional[Tensor] = None,
        input_pos: Optional[Tensor] = None,
        seq_len: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Rotated q, or (q, k) when k is given. ``input_pos`` is torchtune's name for
        ``positions`` ((batch, seq) or (seq,)), so the module can serve as a torchtune
        attention's ``pos_embeddings``. ``seq_len``: as in :func:`posenc.functional.apply_rope`
        ("dynamic" scaling's length; the global one for a shard of the sequence), default the
        longest position of the call."""
        if input_pos is not None:
            if positions is not None:
                raise ValueError("RotaryPositionalEncoding: got both positions and input_pos (torchtune's name "
                                 "for positions); pass one")
            positions = input_pos
        if q.dim() >= 1 and q.shape[-1] != self.dim:
            raise ValueError(f"expected q with head_dim {self.dim} (the module's dim), got shape {tuple(q.shape)}")
        longest = self._check_range(q, positions, offset, cu_seqlens)
        return _rope.apply_rope(
            q, k, positions=positions, offset=offset, cu_seqlens=cu_seqlens, config=self.rope_config,
            seq_len=seq_len if seq_len is not None or longest is None else max(longest + 1, 0),
        )

    def __setstate__(self, state: dict) -> None:
        """A module pickled before its configuration was parsed once (posenc before
        2026-12-03: the settings as attributes) is rebuilt into a RopeConfig."""
        if "rope_config" not in state and "base" in state:
            state = dict(state)
            settings = {name: state.pop(name, None) for name in
                        ("base", "interleaved", "rotary_dim", "layout", "sections", "sections_mode")}
            state["_scaling"] = state.pop("scaling", None)
            state["rope_config"] = _rope.RopeConfig.parse(
                head_dim=state["dim"], scaling=state["_scaling"], max_position_embeddings=state["max_len"],
                fn="RotaryPositionalEncoding", **settings)
        super().__setstate__(state)

    # The settings, read from the parsed configuration.
    @property
    def base(self) -> float:
        return self.rope_config.base

    @property
    def interleaved(self) -> bool:
        return self.rope_config.interleaved

    @property
    def rotary_dim(self) -> int:
        return self.rope_config.rotary_dim

    @property
    def layout(self) -> str:
        return self.rope_config.layout

    @property
    def sections(self) -> Optional[Tuple[int, ...]]:
        return self.rope_config.sections or None  # a tuple: the setting cannot be edited in place

    @property
    def sections_mode(self) -> str:
        return self.rope_config.sections_mode

    @property
    def scaling(self) -> Optional[Mapping[str, Any]]:
        # A read-only view: an edit in place would not reach the parsed configuration.
        return None if self._scaling is None else types.MappingProxyType(self._scaling)

    def _check_range(
        self, q: Tensor, positions: Optional[Tensor], offset: Union[int, Tensor], cu_seqlens: Optional[Tensor]
    ) -> Optional[int]:
        """Positions must lie in [0, max_len). Free for an int offset; with index tensors
        the op posenc::rope_position_bounds reads them back (a sync on CUDA), only when
        check_positions is set (CUDA) and not under torch.compile. Returns the longest
        position when it was read from tensors (so "dynamic" need not read it again)."""
        if q.dim() != (3 if self.layout == "thd" else 4):
            return  # the rope op raises for a wrong rank, with its own message
        offsets = offset if isinstance(offset, Tensor) else None
        if offsets is None and (isinstance(offset, bool) or not isinstance(offset, (int, torch.SymInt))):
            return  # apply_rope raises a TypeError naming offset
        if positions is None and offsets is None and cu_seqlens is None:
            # Positions offset .. offset + seq - 1: no tensor to read, traceable.
            b, s, _ = _rope.LAYOUT_AXES[self.layout]
            batch, seq = (1 if b is None else q.shape[b]), q.shape[s]  # the op's rule: no token, no bound
            lo, hi = (offset, offset + seq - 1) if batch > 0 and seq > 0 else (0, -1)
        else:
            tensors = [t for t in (positions, offsets, cu_seqlens) if isinstance(t, Tensor)]
            on_cuda = any(t.is_cuda for t in tensors)
            # torch.jit.trace cannot record an op that returns ints: a traced module, like a
            # compiled one, keeps the kernels' own checks.
            if (torch.compiler.is_compiling() or torch.jit.is_tracing() or (on_cuda and not self.check_positions)
                    or q.is_meta or any(t.is_meta for t in tensors)):
                return None  # nothing to read: traced, unchecked, or shapes only (meta)
            lo, hi = torch.ops.posenc.rope_position_bounds(
                q, positions=positions, offsets=offsets, offset=0 if offsets is not None else offset,
                cu_seqlens=cu_seqlens, rotary_dim=self.rotary_dim, layout=self.layout,
                sections=list(self.rope_config.sections), sections_mode=self.sections_mode,
            )
        if hi >= lo and (lo < 0 or hi >= self.max_len):
            torch.ops.posenc.position_range_check(lo, hi, self.max_len)  # raises the one IndexError
        return hi if positions is not None or offsets is not None or cu_seqlens is not None else None

    def __prepare_scriptable__(self) -> nn.Module:
        """Its forward returns q alone or (q, k) depending on its arguments, a type
        TorchScript cannot give a caller: say what works instead."""
        raise RuntimeError(
            f"posenc: {type(self).__name__} cannot be compiled by torch.jit.script (its forward returns q "
            "or (q, k) depending on whether k is given, which TorchScript cannot type). Export the model "
            "instead: torch.jit.trace(model, example_inputs) for TorchScript, or torch.export.export + "
            "torch._inductor.aoti_compile_and_package for AOTInductor (README, 'Deploy to C++'); or call "
            "torch.ops.posenc.rope from scripted code"
        )

    def extra_repr(self) -> str:
        extra = f"dim={self.dim}, max_len={self.max_len}, base={self.base}, interleaved={self.interleaved}"
        if self.rotary_dim != self.dim:
            extra += f", rotary_dim={self.rotary_dim}"
        if self.scaling is not None:
            extra += f", scaling={self._scaling}"
        if self.sections is not None:
            extra += f", sections={list(self.sections)}, sections_mode={self.sections_mode!r}"
        return extra + f", layout={self.layout!r}"
