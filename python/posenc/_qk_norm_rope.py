"""Fused QK-norm + RoPE: the Python front end of ``torch.ops.posenc.qk_norm_rope``."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from posenc._dtensor import place_beside
from posenc._rope import rope_op_arguments

NORMS = ("head", "hidden")


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    norm: str = "head",
    positions: Optional[Tensor] = None,
    offset: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    base: Optional[float] = None,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    scaling: Optional[Mapping] = None,
    layout: str = "bshd",
    sections: Optional[Sequence[int]] = None,
    sections_mode: str = "axial",
    seq_len: Optional[int] = None,
    inplace: bool = False,
    check_inputs: bool = False,
) -> Tuple[Tensor, Tensor]:
    """RMSNorm of q and k, then RoPE, in one pass (forward and backward): Qwen3 / Qwen3-MoE
    (``norm="head"``), Gemma 3 (``weight_offset=1.0``: its ``1 + w``), OLMo 2
    (``norm="hidden"``).

    Each vector x (one head's, ``norm="head"``, weights of shape ``(head_dim,)``; or a token's
    whole q (resp. k) projection, ``norm="hidden"``, weights ``(heads * head_dim,)``, heads
    major) becomes ``x * rsqrt(mean(x**2) + eps) * (weight + weight_offset)``, computed in
    float32 (float64 for float64 inputs), then is rotated exactly as :func:`apply_rope` does
    with the same arguments (every layout, GQA, partial rotary, scaling types, multi-axis,
    packed "thd", per-row offsets); the outputs have q's dtype, rounded once. Weights have q's
    dtype (or float32 when q is float16/bfloat16). Gradients flow to q, k and both weights
    (one fused backward); double backward goes through a composite of ATen ops.

    ``inplace=True`` writes the results into q and k (inference: no autograd) and returns
    them. Returns ``(q, k)``.
    """
    fn = "qk_norm_rope"
    for name, t in (("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(t).__name__}")
    if not isinstance(norm, str) or norm not in NORMS:
        raise ValueError(f"{fn}: unknown norm {norm!r}; expected 'head' (each head's vector: Qwen3, Gemma 3) "
                         f"or 'hidden' (each token's whole projection: OLMo 2)")
    for name, value in (("eps", eps), ("weight_offset", weight_offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{fn}: expected {name} to be a float, got {value!r}")
    if not eps > 0:
        raise ValueError(f"{fn}: expected eps > 0 (added to the mean square), got {eps}")
    arguments = rope_op_arguments(
        q, positions=positions, offset=offset, cu_seqlens=cu_seqlens, base=base, interleaved=interleaved,
        rotary_dim=rotary_dim, scaling=scaling, layout=layout, sections=sections, sections_mode=sections_mode,
        check_inputs=check_inputs, seq_len=seq_len, fn=fn)
    q_weight, k_weight = place_beside(q, q_weight, k_weight)
    if inplace:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight)):
            raise RuntimeError(f"{fn}: inplace=True overwrites q and k, which autograd cannot differentiate; use "
                               f"inplace=False for training, or run under torch.no_grad()")
        out_q, out_k = torch.ops.posenc.qk_norm_rope(
            q, k, q_weight, k_weight, eps=float(eps), weight_offset=float(weight_offset), norm=norm, **arguments)
        q.copy_(out_q)
        k.copy_(out_k)
        return q, k
    return torch.ops.posenc.qk_norm_rope(
        q, k, q_weight, k_weight, eps=float(eps), weight_offset=float(weight_offset), norm=norm, **arguments)
