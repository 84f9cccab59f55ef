"""RoPE with cos/sin tables, the Hugging Face way: ``rope_cos_sin`` builds the tables
(``LlamaRotaryEmbedding``'s layout, posenc's frequencies) and ``apply_rope_cos_sin`` rotates q
and k with given tables (``apply_rotary_pos_emb``'s convention), for code that already passes
``position_embeddings=(cos, sin)`` around.

``apply_rope_cos_sin`` is the op ``torch.ops.posenc.apply_rope_cos_sin`` (one fused kernel
for q and k, CPU and CUDA, backward in C++ the transposed rotation); Python normalises
types, the op checks values.
"""

from __future__ import annotations

import numbers
from typing import Mapping, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from posenc._common import _bool_arg, _check_positive_int, _float_arg, _specialised, _static_numel, _untraced
from posenc._dtensor import is_dtensor, place_beside
from posenc._rope import (_SCHEMA_DEFAULTS, LENGTH_SCALED_TYPES, MAX_POSITION, PARTIAL_ROTARY_KEY_TYPES,
                          _host_frequencies, check_one_baseline, heads_batch_rule, resolve_config_keys,
                          scaling_arguments)


def rope_cos_sin(
    positions: Tensor,
    dim: int,
    *,
    base: Optional[float] = None,
    scaling: Optional[Mapping] = None,
    rotary_dim: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    attention_scaling: bool = True,
    max_position_embeddings: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """``(cos, sin)`` tables of RoPE in the Hugging Face layout (``LlamaRotaryEmbedding``).

    Args:
        positions: integer (seq,) or (batch, seq) positions (Hugging Face's ``position_ids``),
            within [-2**53, 2**53] (a ValueError on the CPU, a device-side assert on CUDA, a
            RuntimeError under torch.compile; not checked under vmap, a TorchDispatchMode or
            torch.jit.trace).
        dim: the head dimension; the tables cover its first ``rotary_dim`` features.
        base, scaling, rotary_dim: as :func:`posenc.functional.apply_rope`: base default 10000
            (or the dict's ``rope_theta``), a transformers 4 or 5 ``rope_scaling`` /
            ``rope_parameters`` dict ("default", "linear", "dynamic", "yarn", "llama3", "longrope",
            "proportional"), rotary
            width default ``dim`` (or ``int(dim * partial_rotary_factor)`` from the dict).
        dtype: the tables' dtype (angles, cos and sin are computed in float64, then converted by
            ``Tensor.to(dtype)``: through float32 for float16 and bfloat16, as torch converts).
        attention_scaling: multiply cos and sin by the scaling's attention factor (yarn's or
            longrope's ``attention_factor``, yarn's mscale; 1 for the others), as transformers does.
        max_position_embeddings: the model's ``max_position_embeddings``: the default of
            ``original_max_position_embeddings`` for "yarn" and "dynamic" and of "longrope"'s ``factor``
            (max_position_embeddings / original), as transformers fills them
            from the config (the types' facts: ``posenc._rope.ORIGINAL_FROM_MODEL_TYPES``,
            ``FACTOR_FROM_MODEL_TYPES``).

    Returns ``(cos, sin)`` of shape ``positions.shape + (rotary_dim,)`` on ``positions``' device,
    with the pair frequencies duplicated as ``cat((freqs, freqs), -1)``:
    ``cos[..., s, j] = cos(positions[..., s] * inv_freq[j % (rotary_dim // 2)]) * factor``. For
    "dynamic" and "longrope" the longest position of the call sets the scale (read from ``positions``: one
    device sync), as transformers' ``dynamic_rope_update``; under ``torch.compile`` their
    tables are made outside the graph (a graph break: ``fullgraph=True`` and torch.export
    refuse them), and torch.jit.trace refuses them (it would fix the scale at the traced
    positions). Under torch.compile every other table is a constant of the graph: a number
    argument that changes between calls (``base``, ``dim``, a scaling value) recompiles.
    """
    fn = "rope_cos_sin"
    if not isinstance(positions, Tensor):
        raise TypeError(f"{fn}: expected positions to be a Tensor, got {type(positions).__name__}")
    # uint64 too: past 2**63 it has no int64 twin, and its range is not checked (int64's is).
    if positions.is_floating_point() or positions.is_complex() or positions.dtype in (torch.bool, torch.uint64):
        raise TypeError(f"{fn}: expected positions to be an integer tensor (int64 position_ids), got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"{fn}: expected positions of shape (seq,) or (batch, seq), got {tuple(positions.shape)}")
    dim = _check_positive_int(fn, "dim (the head dimension)", dim)
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral)):
        raise TypeError(f"{fn}: expected rotary_dim to be an int or None, got {rotary_dim!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{fn}: expected dtype to be a floating-point torch.dtype, got {dtype!r}")
    if max_position_embeddings is not None:
        max_position_embeddings = _check_positive_int(fn, "max_position_embeddings", max_position_embeddings)
    scaling, base, rotary_dim, sections, _ = resolve_config_keys(
        scaling, base=base, rotary_dim=None if rotary_dim is None else int(rotary_dim), head_dim=dim,
        sections=None, sections_mode=None, fn=fn)
    if sections is not None:
        raise ValueError(f"{fn}: multi-axis RoPE (mrope_section) has no single cos/sin table here; "
                         f"use posenc.functional.apply_rope(..., sections=...)")
    rotary_dim = dim if rotary_dim is None else rotary_dim
    if rotary_dim <= 0 or rotary_dim > dim or rotary_dim % 2:
        raise ValueError(f"{fn}: expected rotary_dim to be even and in [2, dim={dim}], got {rotary_dim}")
    # The model's defaults (max_position_embeddings) and the length a type scales by come from
    # the types' facts (scaling_arguments, LENGTH_SCALED_TYPES), as for apply_rope.
    rope_type, values = scaling_arguments(scaling, max_position_embeddings)
    check_one_baseline(fn, rope_type, scaling, max_position_embeddings)
    if rope_type in PARTIAL_ROTARY_KEY_TYPES and rotary_dim != dim:
        # As apply_rope refuses it (the op's rotary-width rule): "proportional" turns pairs of
        # the whole head, its exponents over dim; over a narrower rotary_dim there are two readings.
        raise ValueError(f"{fn}: rope_type {rope_type!r} turns pairs of the whole head (its "
                         f"partial_rotary_factor says how many): expected rotary_dim = dim = {dim} or None, "
                         f"got {rotary_dim}")
    if rope_type in LENGTH_SCALED_TYPES and torch.jit.is_tracing():
        raise RuntimeError(f"{fn}: {rope_type!r} tables scale by the longest position, read from the positions' "
                           f"values, which torch.jit.trace would fix at the traced ones; rotate with "
                           f"posenc.functional.apply_rope, whose op reads them at run time")
    base = _SCHEMA_DEFAULTS["base"] if base is None else _float_arg(fn, "base", base)
    if torch.compiler.is_compiling():
        # A number torch.compile made a symbol (a dim, rotary_dim, base or scaling value that
        # changed between calls, or dynamic=True) is specialised to its value, as a constant
        # one is: the frequencies are computed on the host (_host_frequencies), from constants.
        rotary_dim, base = int(_specialised(rotary_dim)), _specialised(base)
        values = [_specialised(v) for v in values]
    args = (positions, rotary_dim, base, rope_type, tuple(values), _bool_arg(fn, "attention_scaling",
                                                                              attention_scaling), dtype)
    if rope_type in LENGTH_SCALED_TYPES and torch.compiler.is_compiling():
        # The scale depends on the positions' values (their maximum, read on the host), which a
        # graph cannot hold: under torch.compile the tables are made outside it (a graph
        # break, as transformers' dynamic_rope_update has), not from a length traced as a
        # symbol (which crashed the second call with another length).
        return torch.compiler.disable(_tables)(*args)
    return _tables(*args)


def _check_position_range(positions: Tensor) -> None:
    """int64 positions within the range apply_rope's op takes (MAX_POSITION, from the op:
    [-2**53, 2**53]; past it the float64 angle rounds the position, 2**60 + 1 got 2**60's
    tables). A plain CPU tensor: its extremes against that range (aminmax, a few microseconds),
    and, out of it, the op's own bounds op on a stand-in q (its shape only) raises the op's
    ValueError. On CUDA, and under torch.compile, ``rope_position_extremes`` keeps its verdict
    on the device (an invalid call's bounds are (int64 min, int64 max)) and
    torch._assert_async refuses it (no host sync). The narrower integer dtypes cannot leave
    the range (uint64 is refused before). Not checked: tensors under a transform, a
    TorchDispatchMode (any: FakeTensorMode and make_fx cannot read values) or
    torch.jit.trace, DTensors (one rank alone would raise), meta tensors, other devices."""
    if (positions.dtype != torch.int64 or _static_numel(positions) == 0 or positions.is_meta or is_dtensor(positions)
            or not (positions.is_cpu or positions.is_cuda)):
        return
    compiling = torch.compiler.is_compiling()
    if not compiling and (torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
                          or type(positions) is not Tensor
                          or torch._C._functorch.is_functorch_wrapped_tensor(positions)):
        return
    if not (compiling or positions.is_cuda):
        lo, hi = positions.aminmax()
        if -MAX_POSITION <= int(lo) and int(hi) <= MAX_POSITION:
            return
    rows = positions if positions.dim() == 2 else positions.unsqueeze(0)
    q = torch.empty_strided((*rows.shape, 1, 2), (0, 0, 0, 0), device=positions.device)
    if compiling or positions.is_cuda:
        lo = torch.ops.posenc.rope_position_extremes(q, positions=rows)[0]
        torch._assert_async(lo != torch.iinfo(torch.int64).min, "rope_cos_sin: expected positions within "
                            "[-2**53, 2**53] (integers exact in the float64 angle)")
    else:
        torch.ops.posenc.rope_position_bounds(q, positions=rows)  # raises the op's ValueError


def _vmapped(t: Tensor) -> bool:
    """Whether t is batched by a vmap at any level (under the wrappers of inner transforms:
    vmap(grad(f)) wraps a vmapped tensor made inside f for grad)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _tables(positions: Tensor, rotary_dim: int, base: float, rope_type: str, values: Tuple[float, ...],
            attention_scaling: bool, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """rope_cos_sin's tables from its checked, parsed arguments."""
    _check_position_range(positions)
    seq_len = 0
    if rope_type in LENGTH_SCALED_TYPES and positions.numel():
        if positions.is_meta:
            raise ValueError(f"rope_cos_sin: rope_type {rope_type!r} scales by the longest position, which "
                             f"positions on the meta device do not hold")
        if _vmapped(positions):  # (torch's message asked to file a bug)
            raise RuntimeError(f"rope_cos_sin: rope_type {rope_type!r} scales by the call's longest position, "
                               f"which a vmap over positions cannot read per sample (a value on the host); "
                               f"call it per sample (a loop over the samples)")
        # The longest position of the whole call: a sharded DTensor's max() read on the host
        # is its own shard's (each rank scaled by another length).
        seq_len = int((positions.full_tensor() if is_dtensor(positions) else positions).max()) + 1
    inv_freq, factor = _host_frequencies(rotary_dim, base, rope_type, values, seq_len)
    # Copied without a stream sync (pageable host memory is staged at the call, so the list may go).
    with _untraced():  # under torch.jit.trace, a constant of the graph (as the table of a config is)
        inv_freq = torch.tensor(inv_freq, dtype=torch.float64).to(positions.device, non_blocking=True)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling and factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _check_cos_sin_types(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, layout: str,
                         interleaved: bool) -> bool:
    fn = "apply_rope_cos_sin"
    for name, value in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(value).__name__}")
    if not isinstance(layout, str):
        raise TypeError(f"{fn}: expected layout to be a str, got {layout!r}")
    return _bool_arg(fn, "interleaved", interleaved)  # a numpy bool as a bool


def apply_rope_cos_sin(
    q: Tensor,
    k: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str = "bhsd",
    interleaved: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Rotate q (and k) with given RoPE tables, as transformers' ``apply_rotary_pos_emb``.

    Args:
        q, k: (batch, heads, seq, head_dim) for layout "bhsd" (Hugging Face), (batch, seq,
            heads, head_dim) for "bshd"; k may be None, or have fewer heads (GQA/MQA).
        cos, sin: (seq, rotary_dim) or (batch, seq, rotary_dim) (batch 1 broadcasts), as
            :func:`rope_cos_sin` or a transformers rotary embedding returns them; broadcast over
            heads (``unsqueeze_dim`` 1 for "bhsd", 2 for "bshd"). Only the first ``rotary_dim``
            features are rotated; the rest pass through (partial rotary, GPT-NeoX).
        interleaved: pairs are halves ``(i, i + rotary_dim/2)`` with
            ``rotate_half(x) = cat(-x2, x1)`` (Llama; tables ``cat(freqs, freqs)``), or, when
            True, adjacent ``(2i, 2i+1)`` (GPT-J's ``rotate_every_two``; tables
            ``repeat_interleave(freqs, 2)``).

    ``out = x * cos + rotate(x) * sin``, computed in float32 (float64 for float64 q; the tables
    are converted) and rounded once to q's dtype (transformers' ``apply_rotary_pos_emb`` promotes
    a bfloat16 q with float32 tables to a float32 result; its models cast the tables to q's
    dtype first and round each product and the sum in it, a few steps of q's dtype from this
    one rounding), in one fused kernel for q and k. Returns the
    rotated q, or (q, k) when k is given. Differentiable in q, k, cos and sin (the tables'
    gradients are sums over heads, composed of torch ops; x is saved only when they need it).
    """
    interleaved = _check_cos_sin_types(q, k, cos, sin, layout, interleaved)
    cos, sin = place_beside(q, cos, sin)  # plain tables beside a DTensor q: replicated
    out_q, out_k = torch.ops.posenc.apply_rope_cos_sin(q, k, cos, sin, layout=layout, interleaved=interleaved)
    return out_q if k is None else (out_q, out_k)


# vmap: the samples join the heads (tables shared; batched tables: one call per sample).
torch.library.register_vmap("posenc::apply_rope_cos_sin", heads_batch_rule(
    torch.ops.posenc.apply_rope_cos_sin.default, ("q", "k"), lambda a: 1 if a["layout"] == "bhsd" else 2))
