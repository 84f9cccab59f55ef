"""Fused QK-norm + RoPE: the Python front end of ``torch.ops.posenc.qk_norm_rope``."""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from posenc._common import _bool_arg, _check_positive_int, _refuse_captured_writes, _table_dtype
from posenc._dtensor import is_dtensor, place_beside, placed_as
from posenc._rope import (LAYOUT_AXES, RopeConfig, _ParsedOnce, config_of, heads_batch_rule, rope_op_arguments,
                          rotary_width, with_rope_settings)

NORMS = ("head", "hidden")
# The norm's defaults, as qk_norm_rope's schema (and rope_append_kv's, the same settings) states them.
NORM_DEFAULTS = {a.name: a.default_value for a in torch.ops.posenc.qk_norm_rope.default._schema.arguments
                 if a.name in ("eps", "weight_offset", "norm")}


def check_norm_settings(fn: str, eps: Any, weight_offset: Any, norm: Any) -> None:
    """The norm's settings as the ops take them (qk_norm_rope, rope_append_kv's QK-norm)."""
    if not isinstance(norm, str):
        raise TypeError(f"{fn}: expected norm to be a str, 'head' or 'hidden'; got {norm!r}")
    if norm not in NORMS:
        raise ValueError(f"{fn}: unknown norm {norm!r}; expected 'head' (each head's vector: Qwen3, Gemma 3) "
                         f"or 'hidden' (each token's whole projection: OLMo 2)")
    for name, value in (("eps", eps), ("weight_offset", weight_offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's too, as the op takes them
            raise TypeError(f"{fn}: expected {name} to be a float, got {value!r}")
    if not 0 < eps < math.inf:  # comparisons, not math.isfinite: a float torch.compile made dynamic
        raise ValueError(f"{fn}: expected eps > 0 (added to the mean square), got {eps}")
    if not -math.inf < weight_offset < math.inf:
        raise ValueError(f"{fn}: expected a finite weight_offset, got {weight_offset}")


@with_rope_settings
def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    *,
    eps: float = NORM_DEFAULTS["eps"],
    weight_offset: float = NORM_DEFAULTS["weight_offset"],
    norm: str = NORM_DEFAULTS["norm"],
    positions: Optional[Tensor] = None,
    offset: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    seq_len: Optional[int] = None,
    inplace: bool = False,
    check_inputs: bool = False,
    config: Optional[RopeConfig] = None,
    **rope: Any,
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

    Args:
        q, k: as :func:`apply_rope`'s (every layout; k may have fewer heads).
        q_weight, k_weight: the RMSNorm weights of q and of k (Hugging Face's
            ``q_norm.weight`` and ``k_norm.weight``): ``(head_dim,)`` for ``norm="head"``,
            ``(heads * head_dim,)`` of q's (resp. k's) heads for ``norm="hidden"``.
        eps, weight_offset, norm: the norm's settings, as above (defaults: Qwen3's).
        positions, offset, cu_seqlens: the positions the normalised q and k turn at, as
            :func:`apply_rope`'s: int64 (seq,) or (batch, seq) positions (default ``0 ..
            seq-1``; with ``sections`` one coordinate per axis), plus ``offset`` (an int, or an
            int64 tensor of one offset per sequence), restarting at each sequence of
            ``cu_seqlens`` for "thd".
        seq_len: for "dynamic" and "longrope" scaling, the length they scale for, as
            :func:`apply_rope`'s (default: read from the call).
        check_inputs: also check CUDA ``cu_seqlens`` on the host in eager mode (one device
            sync), as :func:`apply_rope`'s.
        base, interleaved, rotary_dim, rotary_offset, scaling, layout, sections, sections_mode: the
            RoPE settings of :func:`apply_rope`. With ``rotary_offset`` (or a ``rotary_dim``
            below head_dim) the whole vector is normalised and only the rotary features turn.
        inplace: write the results into q and k (inference: no autograd) and return them.
        config: a parsed :class:`~posenc.functional.RopeConfig` instead of RoPE's keywords
            (as :func:`apply_rope`).

    Returns ``(q, k)``.
    """
    fn = "qk_norm_rope"
    for name, t in (("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(t).__name__}")
    check_norm_settings(fn, eps, weight_offset, norm)
    config = config_of(q, config, fn, **rope)
    arguments = rope_op_arguments(q, config, positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                                  check_inputs=check_inputs, seq_len=seq_len, fn=fn)
    q_weight, k_weight = place_beside(q, q_weight, k_weight)
    if _bool_arg(fn, "inplace", inplace):  # the op refuses a call that would record a graph (its autograd kernel)
        _refuse_captured_writes(fn, q=q, k=k)
        torch.ops.posenc.qk_norm_rope_(
            q, k, q_weight, k_weight, eps=float(eps), weight_offset=float(weight_offset), norm=norm, **arguments)
        return q, k
    out_q, out_k = torch.ops.posenc.qk_norm_rope(
        q, k, q_weight, k_weight, eps=float(eps), weight_offset=float(weight_offset), norm=norm, **arguments)
    return (placed_as(out_q, q), placed_as(out_k, k)) if is_dtensor(q) else (out_q, out_k)


class _NormWeight(torch.nn.Module):
    """Holds one norm's ``weight`` (Hugging Face's ``q_norm`` / ``k_norm`` submodules)."""

    def __init__(self, size: int, init: float, device=None, dtype=None) -> None:
        super().__init__()
        self.init_value = float(init)
        self.weight = torch.nn.Parameter(torch.full((size,), self.init_value, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The weight's initial value again (after ``to_empty``: meta-device construction)."""
        self.weight.fill_(self.init_value)


@with_rope_settings
class QKNormRotary(_ParsedOnce, torch.nn.Module):
    r"""RMSNorm of q and k followed by RoPE, fused (:func:`posenc.functional.qk_norm_rope`),
    owning the two norm weights under Hugging Face's names, ``q_norm.weight`` and
    ``k_norm.weight``, so that an attention layer's checkpoint loads as is.

    Args:
        head_dim: features per head.
        eps, weight_offset, norm: as :func:`~posenc.functional.qk_norm_rope`: Qwen3 (defaults),
            Gemma 3 (``weight_offset=1.0``; weights start at 0), OLMo 2 (``norm="hidden"``:
            then ``num_heads`` and ``num_kv_heads`` size the weights).
        num_heads, num_kv_heads: q's and k's head counts (needed for ``norm="hidden"``).
        base, interleaved, rotary_dim, rotary_offset, scaling, layout, sections, sections_mode: RoPE's,
            as :func:`~posenc.functional.apply_rope` (``rotary_offset``: the first rotated
            feature; every feature is normalised).

    ``q, k = m(q, k, positions=..., offset=...)``.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        eps: float = NORM_DEFAULTS["eps"],
        weight_offset: float = NORM_DEFAULTS["weight_offset"],
        norm: str = NORM_DEFAULTS["norm"],
        num_heads: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        device=None,
        dtype=None,
        **rope: Any,
    ) -> None:
        super().__init__()
        head_dim = _check_positive_int("QKNormRotary", "head_dim", head_dim)
        check_norm_settings("QKNormRotary", eps, weight_offset, norm)
        if norm == "hidden" and (num_heads is None or num_kv_heads is None):
            raise ValueError("QKNormRotary: norm='hidden' normalises each token's whole projection: pass num_heads "
                             "and num_kv_heads (the weights have num_heads * head_dim and num_kv_heads * head_dim "
                             "values)")
        # Checked when given, also where norm="head" does not read them (a typo is not ignored).
        if num_heads is not None:
            num_heads = _check_positive_int("QKNormRotary", "num_heads", num_heads)
        if num_kv_heads is not None:
            num_kv_heads = _check_positive_int("QKNormRotary", "num_kv_heads", num_kv_heads)
        lq = head_dim if norm == "head" else num_heads * head_dim
        lk = head_dim if norm == "head" else num_kv_heads * head_dim
        for name, size in (("num_heads", lq), ("num_kv_heads", lk)):  # as the C++ module refuses it
            if size > 2**63 - 1:
                raise ValueError(f"QKNormRotary: expected {name} * head_dim to fit in int64, got {size}")
        if dtype is not None:  # the norm weights' (a dtype the ops take, as the other modules' tables)
            dtype = _table_dtype("QKNormRotary", dtype)
        init = 1.0 - weight_offset  # effective weights start at 1 (Gemma's zeros for offset 1)
        self.q_norm = _NormWeight(lq, init, device, dtype)
        self.k_norm = _NormWeight(lk, init, device, dtype)
        self.eps, self.weight_offset, self.norm = eps, weight_offset, norm
        # RoPE's configuration, parsed once (RopeConfig) and passed on at each call.
        self.rope_config = RopeConfig.parse(head_dim=head_dim, fn="QKNormRotary", **rope)
        # Copied (lists in the scaling dict too): a later edit of the caller's would show here,
        # not in the parsed configuration.
        self._rope_keywords = tuple((name, copy.deepcopy(value)) for name, value in rope.items() if value is not None)
        rotary_width(self.rope_config)  # the op checks the values now, for heads of head_dim features

    def __setstate__(self, state: dict) -> None:
        """A module pickled before its configuration was parsed once (posenc before
        2026-12-03: a rope_options dict) gets its RopeConfig."""
        if "rope_config" not in state and "rope_options" in state:
            state = dict(state)
            state["rope_config"] = RopeConfig.parse(head_dim=state["head_dim"], fn="QKNormRotary",
                                                    **state.pop("rope_options"))
        if "head_dim" in state:  # before 2026-12-07 a plain (writable) attribute: the config's head_dim
            state = dict(state)
            del state["head_dim"]
        super().__setstate__(state)

    @property
    def head_dim(self) -> int:
        """Features per head (read-only: the RoPE configuration was parsed for it, and the
        weights sized by it; build a new module to change it)."""
        return self.rope_config.head_dim

    def forward(self, q: Tensor, k: Tensor, *, positions: Optional[Tensor] = None, offset: Union[int, Tensor] = 0,
                cu_seqlens: Optional[Tensor] = None, seq_len: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        return qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, eps=self.eps,
                            weight_offset=self.weight_offset, norm=self.norm, positions=positions, offset=offset,
                            cu_seqlens=cu_seqlens, seq_len=seq_len, config=self.rope_config)

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """Its forward takes keyword-only arguments, which TorchScript does not compile: say
        what works instead (TorchScript's own message names no way out)."""
        raise RuntimeError(
            f"posenc: {type(self).__name__} cannot be compiled by torch.jit.script (its forward takes "
            "keyword-only arguments, which TorchScript does not support). Export the model instead: "
            "torch.jit.trace(model, example_inputs) for TorchScript, or torch.export.export + "
            "torch._inductor.aoti_compile_and_package for AOTInductor (docs/deploy.md); or call "
            "torch.ops.posenc.qk_norm_rope from scripted code"
        )

    def extra_repr(self) -> str:
        extra = f"head_dim={self.head_dim}, eps={self.eps}, weight_offset={self.weight_offset}, norm={self.norm!r}"
        if self.norm == "hidden":
            extra += (f", num_heads={self.q_norm.weight.shape[0] // self.head_dim}, "
                      f"num_kv_heads={self.k_norm.weight.shape[0] // self.head_dim}")
        # RoPE's keywords as given to the constructor (a module unpickled from before they were kept: none).
        return extra + "".join(f", {name}={value!r}" for name, value in getattr(self, "_rope_keywords", ()))


# vmap: the samples join the heads when each head is normalised alone (norm "head", weights
# and positions shared); norm "hidden" spans a token's heads: one call per sample.
torch.library.register_vmap("posenc::qk_norm_rope", heads_batch_rule(
    torch.ops.posenc.qk_norm_rope.default, ("q", "k"), lambda a: LAYOUT_AXES[a["layout"]][2],
    foldable=lambda a: a["norm"] == "head"))
