"""RoPE with cos/sin tables, the Hugging Face way: ``rope_cos_sin`` builds the tables
(``LlamaRotaryEmbedding``'s layout, posenc's frequencies) and ``apply_rope_cos_sin`` rotates q
and k with given tables (``apply_rotary_pos_emb``'s convention), for code that already passes
``position_embeddings=(cos, sin)`` around.

``apply_rope_cos_sin`` is a plain-PyTorch composite for now (autograd through ATen); its
argument checks are kept apart from the math (``_apply_cos_sin_reference``) so that a fused
op of the same signature can replace the math alone.
"""

from __future__ import annotations

import numbers
from typing import Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from posenc._rope import resolve_config_keys, rope_frequencies

_COS_SIN_LAYOUTS = ("bhsd", "bshd")


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
        positions: integer (seq,) or (batch, seq) positions (Hugging Face's ``position_ids``).
        dim: the head dimension; the tables cover its first ``rotary_dim`` features.
        base, scaling, rotary_dim: as :func:`posenc.functional.apply_rope`: base default 10000
            (or the dict's ``rope_theta``), a transformers 4 or 5 ``rope_scaling`` /
            ``rope_parameters`` dict ("default", "linear", "dynamic", "yarn", "llama3"), rotary
            width default ``dim`` (or ``int(dim * partial_rotary_factor)`` from the dict).
        dtype: the tables' dtype (angles are computed in float64, rounded once).
        attention_scaling: multiply cos and sin by the scaling's attention factor (yarn's
            ``attention_factor`` / mscale, 1 for the others), as transformers does.
        max_position_embeddings: the model's ``max_position_embeddings``: the default of
            ``original_max_position_embeddings`` for "yarn" and "dynamic", as transformers fills it
            from the config.

    Returns ``(cos, sin)`` of shape ``positions.shape + (rotary_dim,)`` on ``positions``' device,
    with the pair frequencies duplicated as ``cat((freqs, freqs), -1)``:
    ``cos[..., s, j] = cos(positions[..., s] * inv_freq[j % (rotary_dim // 2)]) * factor``. For
    "dynamic" the longest position of the call sets the scale (read from ``positions``: one
    device sync), as transformers' ``dynamic_rope_update``.
    """
    fn = "rope_cos_sin"
    if not isinstance(positions, Tensor):
        raise TypeError(f"{fn}: expected positions to be a Tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{fn}: expected positions to be an integer tensor (int64 position_ids), got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"{fn}: expected positions of shape (seq,) or (batch, seq), got {tuple(positions.shape)}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0:
        raise ValueError(f"{fn}: expected dim (the head dimension) to be a positive int, got {dim!r}")
    dim = int(dim)
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral)):
        raise TypeError(f"{fn}: expected rotary_dim to be an int or None, got {rotary_dim!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{fn}: expected dtype to be a floating-point torch.dtype, got {dtype!r}")
    if max_position_embeddings is not None and (
        isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, numbers.Integral)
        or max_position_embeddings <= 0
    ):
        raise ValueError(f"{fn}: expected max_position_embeddings to be a positive int or None, "
                         f"got {max_position_embeddings!r}")
    scaling, base, rotary_dim, sections, _ = resolve_config_keys(
        scaling, base=base, rotary_dim=None if rotary_dim is None else int(rotary_dim), head_dim=dim,
        sections=None, sections_mode="axial", fn=fn)
    if sections is not None:
        raise ValueError(f"{fn}: multi-axis RoPE (mrope_section) has no single cos/sin table here; "
                         f"use posenc.functional.apply_rope(..., sections=...)")
    rotary_dim = dim if rotary_dim is None else rotary_dim
    if rotary_dim <= 0 or rotary_dim > dim or rotary_dim % 2:
        raise ValueError(f"{fn}: expected rotary_dim to be even and in [2, dim={dim}], got {rotary_dim}")
    rope_type = None
    if isinstance(scaling, Mapping):
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if (
            rope_type in ("yarn", "dynamic")
            and scaling.get("original_max_position_embeddings") is None
            and max_position_embeddings is not None
        ):
            scaling = {**scaling, "original_max_position_embeddings": int(max_position_embeddings)}
    seq_len = 0
    if rope_type == "dynamic" and positions.numel():
        seq_len = int(positions.max()) + 1
    inv_freq, factor = rope_frequencies(rotary_dim, base=base, scaling=scaling, seq_len=seq_len)
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float64)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling and factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def _apply_cos_sin_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x * cos + rotate(x) * sin`` over the first ``cos.shape[-1]`` features of x (the rest
    pass through), with cos/sin already broadcastable to x; rotate is Hugging Face's
    ``rotate_half`` (``cat(-x2, x1)``) or, ``interleaved``, GPT-J's ``rotate_every_two``. The
    same operations in the same order as transformers, so equal dtypes give its bits."""
    rot = cos.shape[-1]
    full = rot == x.shape[-1]
    x_rot = x if full else x[..., :rot]
    if interleaved:
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-x_rot[..., rot // 2:], x_rot[..., : rot // 2]), dim=-1)
    out = (x_rot * cos) + (rotated * sin)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if full else torch.cat((out, x[..., rot:]), dim=-1)


def _check_cos_sin_arguments(
    q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, layout: str, interleaved: bool
) -> None:
    fn = "apply_rope_cos_sin"
    for name, value in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(f"{fn}: expected {name} to be a floating-point tensor, got {value.dtype}")
    if not isinstance(layout, str) or layout not in _COS_SIN_LAYOUTS:
        raise ValueError(f"{fn}: unknown layout {layout!r}; expected one of {', '.join(_COS_SIN_LAYOUTS)}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{fn}: expected interleaved to be a bool, got {interleaved!r}")
    shape = "(batch, heads, seq, head_dim)" if layout == "bhsd" else "(batch, seq, heads, head_dim)"
    seq_dim = 2 if layout == "bhsd" else 1
    if q.dim() != 4:
        raise ValueError(f"{fn}: expected q of shape {shape} for layout {layout!r}, got {tuple(q.shape)}")
    if k is not None:
        if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[seq_dim] != q.shape[seq_dim] or k.shape[3] != q.shape[3]:
            raise ValueError(f"{fn}: expected k of shape {shape} with q's batch, seq and head_dim (heads may "
                             f"differ), got k {tuple(k.shape)} and q {tuple(q.shape)}")
        if k.dtype != q.dtype or k.device != q.device:
            raise ValueError(f"{fn}: expected k on q's device with q's dtype ({q.dtype}, {q.device}), "
                             f"got {k.dtype}, {k.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"{fn}: expected cos and sin of the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.device != q.device:
            raise ValueError(f"{fn}: expected {name} on q's device {q.device}, got {table.device}")
    batch, seq, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if cos.dim() not in (2, 3) or cos.shape[-2] != seq or (cos.dim() == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(f"{fn}: expected cos and sin of shape (seq, rotary_dim) or (batch, seq, rotary_dim) "
                         f"with seq={seq} and batch={batch} (or 1), got {tuple(cos.shape)}")
    rot = cos.shape[-1]
    if rot <= 0 or rot % 2 or rot > head_dim:
        raise ValueError(f"{fn}: expected the tables' last dimension (rotary_dim) to be even and in "
                         f"[2, head_dim={head_dim}], got {rot}")


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

    ``out = x * cos + rotate(x) * sin``, returned in x's dtype (computed in the promotion of x's
    and the tables' dtypes). Returns the rotated q, or (q, k) when k is given. Differentiable in
    q, k, cos and sin.
    """
    _check_cos_sin_arguments(q, k, cos, sin, layout, interleaved)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    head_dim = 1 if layout == "bhsd" else 2
    cos, sin = cos.unsqueeze(head_dim), sin.unsqueeze(head_dim)
    out_q = _apply_cos_sin_reference(q, cos, sin, interleaved)
    if k is None:
        return out_q
    return out_q, _apply_cos_sin_reference(k, cos, sin, interleaved)

