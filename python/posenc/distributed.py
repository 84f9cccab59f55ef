"""posenc under ``torch.distributed``: DTensor sharding rules for the ``torch.ops.posenc`` ops,
context-parallel helpers, and the glue that lets the modules take DTensor inputs.

``import posenc`` does not import this module (nor DTensor's ``torch.distributed.tensor``). Importing it
registers the sharding rules (:func:`register_sharding_rules`, idempotent, also callable by
hand). What each op accepts, per mesh dimension (R = ``Replicate()``, S(d) = ``Shard(d)``,
P = ``Partial()`` (sum); anything else is redistributed by DTensor to the cheapest rule, at
worst to R, so no placement gives a silently wrong answer):

``rope`` / ``rope_`` (q, k: canonical dims batch b, seq s, heads h of the layout):
    * all R;
    * q, k S(h) (any layout, "thd" included), index tensors R;
    * q, k P (rotation is linear), index tensors R;
    * q, k S(b) (not "thd"): positions with a batch dimension S on it, per-row ``offsets`` S(0),
      other index tensors R. With "dynamic" scaling and ``seq_len=-1`` (read from the call)
      only when every index tensor stays R (the longest position is then the same on every rank);
    * q, k S(s) (not "thd") only when ``positions`` are given, sharded alike on their last
      dimension (default positions would be ``0 .. S_local-1`` on every rank); not for
      "dynamic" with ``seq_len=-1``: pass the global ``seq_len`` (the module does: its range
      check reads the global bounds);
    * "thd" is never token-sharded: ``cu_seqlens`` describe the whole pack. For packed
      context parallelism call the op on local tensors with :func:`packed_shard`'s
      per-shard ``cu_seqlens`` and offsets.

    ``rope_`` (in place) runs only on the placements q and k already have (a redistributed
    copy would be rotated instead of the caller's tensor): otherwise it raises.

``qk_norm_rope`` / ``qk_norm_rope_backward`` (the norm is not linear: never P):
    * all R; q, k S(b) and S(s) as ``rope`` (positions, offsets alike), the weights R;
    * q, k S(h) for ``norm="head"`` only. ``norm="hidden"`` (OLMo 2) normalises over all of a
      token's heads, a reduction across head shards: it has no heads-sharded rule, so DTensor
      redistributes heads-sharded q and k (all-gathers them to R) before the op, and the
      outputs come back R (correct; call it before sharding heads to avoid the gather).
    * the backward's weight gradients (sums over tokens, and heads for "head") are P when q
      and k are sharded, R when replicated.

    ``qk_norm_rope_`` (in place) has the same strategies and, as ``rope_``, runs only on
    the placements q and k already have: otherwise it raises.

``add_position_forward`` / ``add_position`` (x: batch b, seq s, hidden 2; table ``(L, d)`` or ``(1, L, d)``):
    * all R;
    * without dropout (p == 0): x S(b) with (batch, seq) positions S(0) ((seq,) and (1, seq) positions R);
      x S(2) with the table S(-1) (hidden sharding, tensor parallel); x S(s) only with
      positions given and sharded alike (sequence parallel). The table is never sharded on
      its position dimension inside the op (FSDP2 gathers it before the forward).
    * with dropout (p > 0) only R: the mask is drawn from the element index of the tensor
      the kernel sees, so a shard would get another mask than the same elements of the whole
      tensor. Replicated, every rank draws the full tensor's mask, identical on all ranks and
      equal to a single-process run when every rank's generator is seeded alike (as DTensor's
      own random ops require).

``add_position_backward`` (the dropout mask applied to a gradient; its ``rng``, the key or
    the CPU's saved mask bits, always R): R -> R, P -> P; S only for p == 0.
    ``add_position_backward_with_table``: R; P -> (P, P); for p == 0 also grad S(b) / S(s)
    (positions alike) -> grad_table P (a sum over the shards' rows) and grad S(2) ->
    grad_table S(1).

``sinusoidal_table``: positions R or S(d) -> the table S(d) (never on the d_model dimension).

``position_bounds`` / ``rope_position_bounds`` read values (a host-side check; the device-side
    ``rope_position_extremes`` alike): for DTensor
    arguments they gather the index tensors (small, int64) and compute the global bounds on
    every rank, so a range error is raised on every rank alike and "dynamic" scaling sees the
    global longest position. q and k are not gathered (only their global shape matters).

``make_positions``, ``resample_position_table``, ``timestep_embedding`` are compositions of
    ATen ops, which DTensor shards by ATen's own rules (``timestep_embedding`` makes a plain
    frequency tensor inside: run it under ``implicit_replication()``; torch 2.11's DTensor has no rule for
    the bicubic upsampling of ``resample_position_table``: resample ``full_tensor()``). ``rope_frequencies``,
    ``rope_grid_positions``, ``sinusoidal_2d_table``, ``rope_scaling_spec`` take no tensor.
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

import posenc  # noqa: F401  (loads the ops)
from posenc._common import _int_arg, _tensor_arg
from posenc._rope import LAYOUT_AXES, LENGTH_SCALED_TYPES

__all__ = [
    "register_sharding_rules",
    "replicate_like",
    "sequence_positions",
    "accept_dtensor_inputs",
    "context_parallel_indices",
    "context_parallel_positions",
    "shard_sequence",
    "packed_shard",
]

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    raise ImportError("posenc.distributed needs torch.distributed, which this torch build lacks")

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: E402

_registered = False


# ----------------------------------------------------------------------------------------
# Sharding rules
# ----------------------------------------------------------------------------------------

R = Replicate()
P = Partial()


def _rope_dims(layout: str) -> Tuple[Optional[int], Optional[int], int]:
    """(batch, seq, heads) dims of q/k for a layout (_rope.LAYOUT_AXES); packed tokens (no
    batch dim: "thd") are not sharded by sequence either."""
    batch, seq, heads = LAYOUT_AXES[layout]
    return batch, None if batch is None else seq, heads


def _add_batch_and_sequence_shardings(a: dict, b_dim: Optional[int], s_dim: Optional[int], add) -> None:
    """The batch- and sequence-sharded strategies of the ops that rotate as rope does (rope,
    qk_norm_rope): ``add(qk, positions, offsets)`` for each. Batch: (batch, seq) positions
    and per-row offsets shard with q's batch. Sequence: only with explicit positions, sharded
    along their last dim. A length-scaled type that reads its length from the call
    ("dynamic" without seq_len) gets neither where a shard could see another length."""
    if b_dim is None:
        return
    q, pos, offs = a["q"], a["positions"], a["offsets"]
    dynamic_from_call = a["rope_type"] in LENGTH_SCALED_TYPES and a["seq_len"] < 0
    pos_p = R
    if pos is not None:
        pos_batch_dim = 1 if len(a["sections"]) > 0 else 0
        if pos.ndim == pos_batch_dim + 2 and pos.shape[pos_batch_dim] == q.shape[b_dim]:
            pos_p = Shard(pos_batch_dim)
    offs_p = Shard(0) if offs is not None else R
    if not (dynamic_from_call and (isinstance(pos_p, Shard) or offs is not None)):
        add(Shard(b_dim), pos_p, offs_p)
    if pos is not None and pos.ndim >= 1 and not dynamic_from_call:
        add(Shard(s_dim), Shard(pos.ndim - 1), R)


def _rope_rule(a: dict, outputs: str) -> list:
    """Strategies for rope (outputs "qk"), rope_ (outputs "") and their arguments ``a``
    (name -> DTensorSpec, None or value, defaults filled in)."""
    q, k = a["q"], a["k"]
    layout = a["layout"] if a["layout"] in LAYOUT_AXES else "bshd"
    b_dim, s_dim, h_dim = _rope_dims(layout)
    strategies = []

    def add(qk, positions=R, offsets=R):
        out = [qk, qk if k is not None else R] if outputs == "qk" else []
        strategies.append((out, dict(q=qk, k=qk, positions=positions, offsets=offsets, cu_seqlens=R)))

    add(R)
    if q.ndim == (3 if layout == "thd" else 4):
        add(Shard(h_dim))
        add(P)
        _add_batch_and_sequence_shardings(a, b_dim, s_dim, add)
    return strategies


def _qk_norm_rope_rule(a: dict, backward: bool, in_place: bool = False) -> list:
    """Strategies for qk_norm_rope (outputs q, k), qk_norm_rope_ (in place: no outputs) and
    the backward (grad q, grad k, grad q_weight, grad k_weight). The norm is not linear: no
    Partial inputs. Batch- and sequence-sharded calls (positions sharded as for rope) and, for norm "head",
    heads-sharded ones run locally on replicated weights; the weight gradients, sums over
    tokens (and heads), are then Partial. norm "hidden" reduces over a token's heads, so it
    has no heads-sharded strategy: DTensor redistributes heads-sharded q and k (to
    replicated, or to a batch or sequence sharding the call allows) before the op."""
    q = a["q"]
    layout = a["layout"] if a["layout"] in LAYOUT_AXES else "bshd"
    b_dim, s_dim, h_dim = _rope_dims(layout)
    strategies = []

    def add(qk, positions=R, offsets=R):
        weights_grad = R if qk == R else P
        outs = [] if in_place else [qk, qk] + ([weights_grad, weights_grad] if backward else [])
        inputs = dict(q=qk, k=qk, q_weight=R, k_weight=R, positions=positions, offsets=offsets, cu_seqlens=R)
        if backward:
            inputs.update(grad_q=qk, grad_k=qk)
        strategies.append((outs, inputs))

    add(R)
    if q.ndim == (3 if layout == "thd" else 4):
        if a["norm"] == "head":
            add(Shard(h_dim))
        _add_batch_and_sequence_shardings(a, b_dim, s_dim, add)
    return strategies


def _batch_positions(pos: Any, batch: int) -> Any:
    """add_position's positions beside a batch-sharded x: (batch, seq) ones sharded alike;
    (seq,) and (1, seq) ones, which serve every row, replicated."""
    return Shard(0) if pos is not None and pos.ndim == 2 and pos.shape[0] == batch and batch != 1 else R


def _add_position_rule(a: dict, outputs: int) -> list:
    """Strategies for add_position_forward (outputs 2: out, rng) and add_position (1)."""
    x, table, pos = a["x"], a["table"], a["positions"]
    b_dim, s_dim = (0, 1) if a["batch_first"] else (1, 0)
    strategies = []

    def add(out, x_p, table_p=R, pos_p=R):
        strategies.append(([out, R][:outputs], dict(x=x_p, table=table_p, positions=pos_p)))

    add(R, R)
    if a["p"] == 0 and x.ndim == 3:
        add(Shard(b_dim), Shard(b_dim), R, _batch_positions(pos, x.shape[b_dim]))
        add(Shard(2), Shard(2), Shard(table.ndim - 1), R)
        if pos is not None and pos.ndim >= 1:
            add(Shard(s_dim), Shard(s_dim), R, Shard(pos.ndim - 1))
    return strategies


def _add_position_backward_rule(a: dict) -> list:
    strategies = [([R], dict(grad=R, rng=R)), ([P], dict(grad=P, rng=R))]
    if a["p"] == 0:
        strategies += [([Shard(d)], dict(grad=Shard(d), rng=R)) for d in range(a["grad"].ndim)]
    return strategies


def _backward_with_table_rule(a: dict) -> list:
    grad, pos = a["grad"], a["positions"]
    b_dim, s_dim = (0, 1) if a["batch_first"] else (1, 0)
    need_x = a["need_x"]
    strategies = []

    def add(gx, gt, grad_p, pos_p=R):
        strategies.append(([gx if need_x else R, gt], dict(grad=grad_p, rng=R, positions=pos_p)))

    add(R, R, R)
    add(P, P, P)
    if a["p"] == 0 and grad.ndim == 3:
        add(Shard(b_dim), P, Shard(b_dim), _batch_positions(pos, grad.shape[b_dim]))
        add(Shard(2), Shard(1), Shard(2))
        if pos is not None and pos.ndim >= 1:
            add(Shard(s_dim), P, Shard(s_dim), Shard(pos.ndim - 1))
    return strategies


def _rope_cos_sin_rule(a: dict) -> list:
    """apply_rope_cos_sin: linear in q and k, so heads-sharded, Partial, batch-sharded (with
    per-row tables sharded alike) and sequence-sharded (tables sharded on their seq dim)."""
    q, k, cos = a["q"], a["k"], a["cos"]
    if a["layout"] not in ("bshd", "bhsd"):  # the op's layouts; any other it refuses, replicated
        return [([R, R], dict(q=R, k=R, cos=R, sin=R))]
    _, s_dim, h_dim = LAYOUT_AXES[a["layout"]]
    strategies = []

    def add(qk, tables=R):
        strategies.append(([qk, qk if k is not None else R], dict(q=qk, k=qk, cos=tables, sin=tables)))

    add(R)
    if q.ndim == 4 and cos.ndim in (2, 3):
        add(Shard(h_dim))
        add(P)
        per_row = cos.ndim == 3 and cos.shape[0] == q.shape[0] and q.shape[0] > 1
        add(Shard(0), Shard(0) if per_row else R)
        add(Shard(s_dim), Shard(cos.ndim - 2))
    return strategies


def _sinusoidal_table_rule(a: dict) -> list:
    return [([R], dict(positions=R))] + [
        ([Shard(d)], dict(positions=Shard(d))) for d in range(a["positions"].ndim)
    ]


def _register_rule(op, rule, mutated: Sequence[str] = ()) -> None:
    """Registers ``rule(arguments) -> [(output placements, {tensor argument: placement})]``
    (one mesh dimension; expanded over the mesh as register_sharding does) as op's DTensor
    strategy. ``mutated``: tensor arguments written in place, which must keep their
    placements (checked on the expanded strategies).

    Not torch's public ``register_sharding``: it derives the cache key itself (static
    arguments from the first int on), which drops rope's None index tensors and, for ops with
    no int argument (apply_rope_cos_sin, add_position_backward), their layout or dropout
    settings; nor does it check in-place ops' second tensor (rope_'s k). The private pieces
    here are the registration, RuntimeSchemaInfo and the expansion over the mesh."""
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    schema = op._schema
    names = [arg.name for arg in schema.arguments]
    defaults = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    # DTensor caches a decision per key: the tensor arguments' specs plus the arguments from
    # static_argnum on. A None before static_argnum is left out of the key, so with the first
    # non-tensor argument there (register_sharding's choice, the first int) rope's
    # positions=X, offsets=None and positions=None, offsets=Y (equal specs) shared one
    # decision although the rule places them apart (test: distributed_checks
    # sharding_cache_keys). From 0 every argument is in the key, None included. (Lists are
    # hashed as tuples; the schemas have no keyword-only arguments, whose key would be
    # static_kwargkey.)
    assert not any(arg.kwarg_only for arg in schema.arguments), f"{op}: keyword-only arguments need static_kwargkey"

    def spec_of(value):
        if isinstance(value, OpStrategy):
            return value.strategies[0].output_spec
        return value

    def strategy(op_schema):
        args = dict(defaults)
        order = []  # argument names in the order DTensor lists its inputs: args, then kwargs
        for name, value in zip(names, op_schema.args_schema):
            args[name] = spec_of(value)
            order.append(name)
        for name, value in op_schema.kwargs_schema.items():
            args[name] = spec_of(value)
            order.append(name)
        single = []
        for outs, inputs in rule(args):
            single.append(list(outs) + [inputs.get(name, R) if _is_spec(args[name]) else None for name in order])
        result = expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, single, input_index=len(schema.returns),
            inplace_op=op_schema.is_inplace_op(),
        )
        if mutated:
            tensor_names = [name for name in order if _is_spec(args[name])]
            keep = []
            for spec in result.strategies:
                if all(
                    spec.input_specs[tensor_names.index(name)].placements == args[name].placements
                    for name in mutated if name in tensor_names
                ):
                    keep.append(spec)
            if not keep:
                current = {name: tuple(args[name].placements) for name in mutated if name in tensor_names}
                raise RuntimeError(
                    f"{op}: no sharding rule keeps the placements {current} of the tensors it writes in "
                    f"place; redistribute them first (e.g. to Replicate or heads-sharded), or use the "
                    f"out-of-place op (inplace=False)"
                )
            result = OpStrategy(keep)
        return result

    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
        op, strategy, RuntimeSchemaInfo(static_argnum=0, static_kwargkey=None, needs_pytree=True)
    )


def _is_spec(value) -> bool:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(value, DTensorSpec)


def _bounds_handler(cls, op_call, types, args, kwargs):
    """position_bounds / rope_position_bounds / rope_position_extremes of DTensor arguments:
    the bounds of the global tensors, on every rank (a torch_dispatch rule of DTensor for
    these ops; rope_position_extremes returns a plain tensor)."""
    names = [arg.name for arg in op_call._schema.arguments]
    new_args = []
    for name, value in zip(names, args):
        new_args.append(_bounds_argument(name, value))
    new_kwargs = {name: _bounds_argument(name, value) for name, value in (kwargs or {}).items()}
    return op_call(*new_args, **new_kwargs)


def _bounds_argument(name, value):
    if not isinstance(value, DTensor):
        return value
    if name in ("q", "k"):
        local = value.to_local()
        return torch.empty_strided(tuple(value.shape), (0,) * value.ndim, dtype=local.dtype, device=local.device)
    return value.full_tensor()


def register_sharding_rules() -> None:
    """Registers the DTensor sharding rules of the posenc ops (see the module docstring).
    Idempotent; called when ``posenc.distributed`` is imported."""
    global _registered
    if _registered:
        return
    ops = torch.ops.posenc
    _register_rule(ops.rope.default, lambda a: _rope_rule(a, "qk"))
    _register_rule(ops.rope_.default, lambda a: _rope_rule(a, ""), mutated=("q", "k"))
    _register_rule(ops.add_position_forward.default, lambda a: _add_position_rule(a, 2))
    _register_rule(ops.add_position.default, lambda a: _add_position_rule(a, 1))
    _register_rule(ops.add_position_backward.default, _add_position_backward_rule)
    _register_rule(ops.add_position_backward_with_table.default, _backward_with_table_rule)
    _register_rule(ops.sinusoidal_table.default, _sinusoidal_table_rule)
    _register_rule(ops.apply_rope_cos_sin.default, _rope_cos_sin_rule)
    _register_rule(ops.qk_norm_rope.default, lambda a: _qk_norm_rope_rule(a, False))
    _register_rule(ops.qk_norm_rope_backward.default, lambda a: _qk_norm_rope_rule(a, True))
    _register_rule(ops.qk_norm_rope_.default, lambda a: _qk_norm_rope_rule(a, False, in_place=True),
                   mutated=("q", "k"))
    # Public API (torch.library) for what DTensor's private _custom_op_handlers table does.
    torch.library.register_torch_dispatch(ops.position_bounds.default, DTensor, _bounds_handler)
    torch.library.register_torch_dispatch(ops.rope_position_bounds.default, DTensor, _bounds_handler)
    torch.library.register_torch_dispatch(ops.rope_position_extremes.default, DTensor, _bounds_handler)
    _registered = True


# ----------------------------------------------------------------------------------------
# Plain tensors beside DTensors
# ----------------------------------------------------------------------------------------


def replicate_like(like: Tensor, tensor: Optional[Tensor]) -> Optional[Tensor]:
    """``tensor`` as a ``Replicate()`` DTensor on the mesh of the DTensor ``like`` (no
    communication: every rank must hold the same values, as for any replicated tensor).
    DTensors, non-tensors and a plain ``like`` pass through unchanged."""
    if not isinstance(like, DTensor) or not isinstance(tensor, Tensor) or isinstance(tensor, DTensor):
        return tensor
    mesh = like.device_mesh
    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)


def sequence_positions(like: Tensor, seq_dim: int, offset: int = 0, batch_dim: Optional[int] = None) -> Tensor:
    """Positions ``offset .. offset + S - 1`` of the sequence dimension ``seq_dim`` of the
    DTensor ``like``, placed as ``like`` places that dimension (sharded where it is sharded,
    else replicated): what a sequence-sharded call needs. int64 ``(S,)``, or ``(B, S)`` with
    ``batch_dim`` (then sharded on the batch as well where ``like`` is). A plain ``like``
    gives a plain tensor."""
    fn = "sequence_positions"
    like, seq_dim = _tensor_arg(fn, "like", like), _int_arg(fn, "seq_dim", seq_dim)
    offset = _int_arg(fn, "offset", offset)
    if batch_dim is not None:
        batch_dim = _int_arg(fn, "batch_dim", batch_dim)
    seq = like.shape[seq_dim]
    device = like.to_local().device if isinstance(like, DTensor) else like.device
    positions = torch.arange(offset, offset + seq, dtype=torch.int64, device=device)
    if batch_dim is not None:
        positions = positions.expand(like.shape[batch_dim], seq).contiguous()
    if not isinstance(like, DTensor):
        return positions
    seq_dim %= like.ndim
    placements = []
    for placement in like.placements:
        if isinstance(placement, Shard) and placement.dim % like.ndim == seq_dim:
            placements.append(Shard(positions.dim() - 1))
        elif (isinstance(placement, Shard) and batch_dim is not None
              and placement.dim % like.ndim == batch_dim % like.ndim):
            placements.append(Shard(0))
        else:
            placements.append(Replicate())
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(positions, like.device_mesh, placements, src_data_rank=None)


def _first_dtensor(values: Iterable):
    for value in values:
        if isinstance(value, DTensor):
            return value
    return None


def accept_dtensor_inputs(module: torch.nn.Module) -> torch.nn.Module:
    """Lets a posenc module (or any module) take DTensor inputs beside plain tensors: during a
    call with a DTensor argument, the plain tensor arguments (positions, per-row offsets,
    cu_seqlens) and the module's own plain buffers (``PositionalEncoding.pe``) are seen as
    ``Replicate()`` DTensors on its mesh (no communication: plain tensors must hold the same
    values on every rank). The buffers are wrapped for the call only, so plain calls keep
    working (a buffer that forward reassigns keeps its new value, plain again when it is
    replicated); calls from several threads go through the module one at a time. Parameters
    must already be DTensors (``distribute_module``, ``parallelize_module``,
    ``fully_shard``): a plain parameter with DTensor inputs is a RuntimeError. Returns the
    module."""
    # One call at a time through the module (its buffers are swapped for a DTensor call, which
    # a call in another thread would see), nested calls in the same thread allowed; each
    # thread's calls in progress stack up: {name: (plain buffer, its wrapper)}.
    lock = threading.RLock()
    local = threading.local()

    def before(mod, args, kwargs):
        lock.acquire()
        wrapped = {}
        local.__dict__.setdefault("calls", []).append(wrapped)  # first: the forward hook pops it
        like = _first_dtensor(list(args) + list(kwargs.values()))
        if like is None:
            return None
        for name, param in mod.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                raise RuntimeError(
                    f"{type(mod).__name__}: parameter {name!r} is a plain tensor but the input is a DTensor; "
                    f"distribute the module's parameters first (distribute_module, parallelize_module or "
                    f"fully_shard)"
                )
        for name, buf in list(mod._buffers.items()):
            if isinstance(buf, Tensor) and not isinstance(buf, DTensor):
                wrapped[name] = (buf, replicate_like(like, buf))
                mod._buffers[name] = wrapped[name][1]
        args = tuple(replicate_like(like, a) for a in args)
        kwargs = {key: replicate_like(like, value) for key, value in kwargs.items()}
        return args, kwargs

    def after(mod, args, kwargs, output):
        calls = local.__dict__.get("calls")
        if not calls:  # a hook before ours raised: ours never ran (nor took the lock)
            return
        try:
            for name, (plain, wrapper) in calls.pop().items():
                current = mod._buffers.get(name)
                if current is wrapper:
                    mod._buffers[name] = plain
                elif isinstance(current, DTensor) and all(p.is_replicate() for p in current.placements):
                    # Reassigned by forward (self.count = self.count + 1): the new value, plain again.
                    mod._buffers[name] = current.to_local()
        finally:
            lock.release()

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True, always_call=True)
    return module


# ----------------------------------------------------------------------------------------
# Context parallelism (sequence split over ranks, local tensors)
# ----------------------------------------------------------------------------------------

LoadBalance = Union[None, bool, str, Tensor, object]


def context_parallel_indices(seq_len: int, world_size: int, rank: int, load_balance: LoadBalance = None,
                             device=None) -> Tensor:
    """The global sequence indices held by ``rank`` when a sequence of ``seq_len`` is split
    over ``world_size`` ranks, int64, in the rank's local order:

    * ``load_balance`` None / False: contiguous chunks, as ``Shard(seq_dim)`` splits
      (``torch.chunk``: chunks of ``ceil(seq_len / world_size)``, the last ones shorter);
    * True / "head_tail": torch's context-parallel load balancer (``_HeadTailLoadBalancer``,
      the "zigzag" split): ``2 * world_size`` equal chunks, rank r holding chunk r then chunk
      ``2 * world_size - 1 - r`` (seq_len must divide by ``2 * world_size``);
    * a rearrange-index tensor (``(seq,)``, ``(1, seq)`` or ``(batch, seq)``, e.g. a
      load balancer's ``_generate_indices()``) or a load balancer object itself: the
      rearranged sequence split into contiguous chunks; ``(batch, seq)`` gives ``(batch, S_local)``.
      Each row must be a permutation of ``0 .. seq_len - 1`` (checked: a device-side assert
      for CUDA indices, not run: no GPU here; a ValueError for others).
    """
    fn = "context_parallel_indices"
    seq_len = _int_arg(fn, "seq_len", seq_len)
    if seq_len < 0:
        raise ValueError(f"{fn}: expected seq_len >= 0, got {seq_len}")
    world_size, rank = _check_rank(world_size, rank, fn)
    if load_balance is None or load_balance is False:
        chunks = torch.arange(seq_len, device=device).chunk(world_size)
        return chunks[rank] if rank < len(chunks) else torch.arange(0, device=device)
    if load_balance is True or load_balance == "head_tail":
        if seq_len % (2 * world_size) != 0:
            raise ValueError(f"context_parallel_indices: head-tail load balancing needs seq_len divisible by "
                             f"2 * world_size = {2 * world_size}, got seq_len={seq_len}")
        c = seq_len // (2 * world_size)
        head = torch.arange(rank * c, (rank + 1) * c, device=device)
        tail = torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c, device=device)
        return torch.cat([head, tail])
    if isinstance(load_balance, str):
        raise ValueError(f"context_parallel_indices: unknown load_balance {load_balance!r}; expected None, "
                         f"'head_tail', an index tensor or a load balancer")
    if isinstance(load_balance, Tensor):
        indices = load_balance
    elif callable(getattr(load_balance, "_generate_indices", None)):
        indices = load_balance._generate_indices()
    else:
        raise TypeError(f"{fn}: expected load_balance to be None, a bool, 'head_tail', an index tensor or a load "
                        f"balancer (an object with _generate_indices()), got {load_balance!r}")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"{fn}: expected integer rearrange indices, got {indices.dtype}")
    indices = indices.to(device=device if device is not None else indices.device, dtype=torch.int64)
    if indices.dim() not in (1, 2) or indices.shape[-1] != seq_len:
        raise ValueError(f"{fn}: expected rearrange indices of shape (seq_len,) or (batch, seq_len) with "
                         f"seq_len={seq_len}, got shape {tuple(indices.shape)}")
    if indices.dim() == 2 and indices.shape[0] == 1:
        indices = indices[0]
    # Each row a permutation (a repeated or missing index would give a rank the wrong tokens):
    # read on the CPU (a ValueError), asserted on a CUDA device (no host sync per call).
    permutation = (indices.sort(dim=-1).values == torch.arange(seq_len, device=indices.device)).all()
    message = f"{fn}: expected each row of the rearrange indices to be a permutation of 0 .. seq_len - 1"
    if indices.is_cuda:
        torch._assert_async(permutation, message)
    elif not bool(permutation):
        raise ValueError(f"{message} = {seq_len - 1}")
    if seq_len % world_size != 0:
        raise ValueError(f"context_parallel_indices: rearranged sequences split evenly; seq_len={seq_len} does "
                         f"not divide by world_size={world_size}")
    n = seq_len // world_size
    return indices[..., rank * n:(rank + 1) * n]


def context_parallel_positions(seq_len: int, world_size: int, rank: int, load_balance: LoadBalance = None, *,
                               positions: Optional[Tensor] = None, offset: int = 0, device=None) -> Tensor:
    """Positions of ``rank``'s tokens for RoPE or add-position calls on local shards of a
    context-parallel sequence split (see :func:`context_parallel_indices`): int64
    ``(S_local,)`` (or ``(batch, S_local)``), the global positions ``offset + index``, or
    the entries of ``positions`` (the unsplit sequence's own positions, ``(seq,)`` or
    ``(batch, seq)``, e.g. per-document positions of a packed row; multi-axis ones
    ``(n_axes, seq)`` or ``(n_axes, batch, seq)``) at those indices. Pass them as
    ``positions=`` with the local q/k or x: the results are the slices of the unsplit
    call's. With per-row indices (``(batch, seq)`` rearrangements) 2-D positions are read as
    ``(batch, seq)``: give multi-axis ones as ``(n_axes, batch, seq)``.

    ``world_size`` is the number of ranks the sequence of ``seq_len`` tokens is split over,
    ``rank`` the one whose tokens are returned; ``load_balance`` chooses the split as in
    :func:`context_parallel_indices`: None / False contiguous chunks, True / "head_tail"
    torch's head-tail ("zigzag") chunks, or a rearrange-index tensor or load balancer."""
    fn = "context_parallel_positions"
    offset = _int_arg(fn, "offset", offset)
    if positions is not None:
        positions = _tensor_arg(fn, "positions", positions)
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"{fn}: expected integer positions, got {positions.dtype}")
        if positions.dim() == 0 or positions.shape[-1] != _int_arg(fn, "seq_len", seq_len):
            raise ValueError(f"{fn}: expected positions of the unsplit sequence, with seq_len={seq_len} entries "
                             f"in their last dimension, got shape {tuple(positions.shape)}")
    indices = context_parallel_indices(seq_len, world_size, rank, load_balance, device=device)
    if positions is None:
        return indices + offset
    positions = positions.to(torch.int64)
    if indices.dim() == 1:
        return positions[..., indices.to(positions.device)] + offset
    batch = indices.shape[0]
    if positions.dim() == 1:
        positions = positions.expand(batch, -1)
    if positions.dim() not in (2, 3) or positions.shape[-2] != batch:
        raise ValueError(f"context_parallel_positions: with per-row rearrange indices of shape {tuple(indices.shape)}, "
                         f"expected positions of shape (seq,), (batch={batch}, seq) or (n_axes, batch={batch}, seq), "
                         f"got {tuple(positions.shape)}")
    return positions.gather(-1, indices.to(positions.device).expand(*positions.shape[:-1], -1)) + offset


def shard_sequence(x: Tensor, dim: int, world_size: int, rank: int, load_balance: LoadBalance = None) -> Tensor:
    """``rank``'s shard of dimension ``dim`` of the full tensor ``x`` under the split of
    :func:`context_parallel_indices` (the local q, k or x of a context-parallel rank).
    ``world_size`` is the number of ranks dimension ``dim`` is split over; ``load_balance``
    chooses the split as there: None / False contiguous chunks (as ``Shard(dim)``), True /
    "head_tail" torch's head-tail ("zigzag") chunks, or a rearrange-index tensor or load
    balancer. Batch-dependent rearrangements ((batch, seq) indices) need ``x`` with the batch
    first."""
    x, dim = _tensor_arg("shard_sequence", "x", x), _int_arg("shard_sequence", "dim", dim)
    indices = context_parallel_indices(x.shape[dim], world_size, rank, load_balance, device=x.device)
    if indices.dim() == 1:
        return x.index_select(dim, indices)
    dim %= x.dim()
    shape = [1] * x.dim()
    shape[0], shape[dim] = indices.shape
    gather = indices.reshape(shape).expand(*[indices.shape[1] if d == dim else s for d, s in enumerate(x.shape)])
    return x.gather(dim, gather)


def packed_shard(
    cu_seqlens: Tensor, indices: Tensor, offsets: Union[int, Tensor, None] = None
) -> Tuple[Tensor, Tensor]:
    """Per-shard ``(cu_seqlens, offsets)`` for a "thd" (packed) RoPE call on a context-parallel
    shard: ``indices`` are the global token indices the shard holds, in its order (e.g.
    :func:`context_parallel_indices` of the token count). Each maximal run of consecutive
    tokens of one sequence becomes one local sequence, whose offset is where the run starts
    in its sequence (plus ``offsets``, the global call's int or per-sequence offsets). Then
    ``apply_rope(q_local, cu_seqlens=cu, offset=offs, layout="thd")`` equals
    ``apply_rope(q, cu_seqlens=cu_seqlens, offset=offsets, layout="thd")[indices]``.
    Returns cu_seqlens (cu_seqlens's dtype) and int64 offsets, on cu_seqlens's device.
    On a GPU it reads the device twice (the indices' range check, and the number of runs,
    which sizes the outputs): a step of preparing a packed batch, not of a layer."""
    fn = "packed_shard"
    for name, t in (("cu_seqlens", cu_seqlens), ("indices", indices)) + (
            (("offsets", offsets),) if isinstance(offsets, Tensor) else ()):
        _tensor_arg(fn, name, t)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{fn}: expected {name} to be an integer tensor, got {t.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{fn}: expected cu_seqlens of shape (num_seqs + 1,), got {tuple(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.numel() - 1
    if isinstance(offsets, Tensor) and offsets.shape != (num_seqs,):
        raise ValueError(f"{fn}: expected offsets of shape (num_seqs,) = ({num_seqs},), got {tuple(offsets.shape)}")
    cu = cu_seqlens.to(torch.int64)
    idx = indices.to(device=cu.device, dtype=torch.int64).reshape(-1)
    # One read back: cu_seqlens' start, its order and total, and the indices' range.
    bad_cu = (cu[1:] < cu[:-1]).any() if num_seqs else cu.new_zeros((), dtype=torch.bool)
    zero = cu.new_zeros(())
    first, unordered, lo, hi, total = torch.stack([
        cu[0], bad_cu.long(), idx.min() if idx.numel() else zero, idx.max() if idx.numel() else zero, cu[-1]]).tolist()
    if first != 0 or unordered:
        raise ValueError(f"{fn}: expected cu_seqlens to start at 0 and not decrease, got {cu_seqlens.tolist()}")
    if idx.numel() and (lo < 0 or hi >= total):
        raise ValueError(f"{fn}: token indices must lie in [0, {total}), got {lo}..{hi}")
    seq_id = torch.searchsorted(cu[1:], idx, right=True)
    new_run = torch.ones_like(idx, dtype=torch.bool)
    if idx.numel() > 1:
        new_run[1:] = (idx[1:] != idx[:-1] + 1) | (seq_id[1:] != seq_id[:-1])
    starts = torch.nonzero(new_run).reshape(-1)
    lengths = torch.diff(torch.cat([starts, starts.new_full((1,), idx.numel())]))  # no host-to-device copy
    local_cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(cu_seqlens.dtype)
    run_seq = seq_id[starts]
    local_offsets = idx[starts] - cu[run_seq]
    if isinstance(offsets, Tensor):
        local_offsets = local_offsets + offsets.to(device=cu.device, dtype=torch.int64)[run_seq]
    elif offsets is not None:
        if isinstance(offsets, bool) or not isinstance(offsets, numbers.Integral):
            raise TypeError(f"packed_shard: expected offsets to be None, an int or a tensor, got {offsets!r}")
        local_offsets = local_offsets + int(offsets)
    return local_cu, local_offsets


def _check_rank(world_size: int, rank: int, fn: str) -> Tuple[int, int]:
    world_size, rank = _int_arg(fn, "world_size", world_size), _int_arg(fn, "rank", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return world_size, rank


register_sharding_rules()
