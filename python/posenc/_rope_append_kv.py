"""RoPE straight into a KV cache: the Python front end of ``torch.ops.posenc.rope_append_kv``."""

from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from posenc._common import _bool_arg, _optional_tensor_args, _refuse_captured_writes
from posenc._qk_norm_rope import check_norm_settings
from posenc._rope import RopeConfig, config_of, rope_op_arguments, with_rope_settings

# The schema's defaults of the op's arguments, so that a call passes only those that
# differ: torch.ops parses each keyword it is given (about half a microsecond each, a decoding
# step's cost).
_OWN_DEFAULTS = {a.name: a.default_value for a in torch.ops.posenc.rope_append_kv.default._schema.arguments}


def _scale_arg(scale: Union[float, Tensor, None], name: str, fn: str) -> Optional[Tensor]:
    """A cache scale as the op takes it: None, or a float32 tensor (a number becomes a 0-d
    CPU tensor: no copy to a device, no sync; the op checks its value)."""
    if scale is None or isinstance(scale, Tensor):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{fn}: expected {name} to be a float or a float32 tensor, got {type(scale).__name__}")
    return torch.tensor(float(scale), dtype=torch.float32)


@with_rope_settings
def rope_append_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    offset: Union[int, Tensor] = 0,
    positions: Optional[Tensor] = None,
    slot_mapping: Optional[Tensor] = None,
    seq_len: Optional[int] = None,
    inplace: bool = False,
    return_k: bool = False,
    k_scale: Union[float, Tensor, None] = None,
    v_scale: Union[float, Tensor, None] = None,
    q_weight: Optional[Tensor] = None,
    k_weight: Optional[Tensor] = None,
    eps: float = _OWN_DEFAULTS["eps"],
    weight_offset: float = _OWN_DEFAULTS["weight_offset"],
    norm: str = _OWN_DEFAULTS["norm"],
    config: Optional[RopeConfig] = None,
    **rope: Any,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Rotates q and k (RoPE, as :func:`apply_rope`) and writes the rotated k and v into a KV
    cache, in one pass over q, k and v (one kernel launch): a decoding step's RoPE and cache
    update. ``k_cache`` and ``v_cache`` are written in place; no autograd (inference: inputs
    that require grad under grad mode are an error).

    Args:
        q, k, v: the new tokens. Layout "bshd": (batch, seq, heads, head_dim); "bhsd"
            (Hugging Face): (batch, heads, seq, head_dim); "thd" (paged cache):
            (tokens, heads, head_dim). k and v have the cache's kv_heads (GQA/MQA: q may have
            more); v may have its own head_dim. float16, bfloat16, float32 or float64.
        k_cache, v_cache: of k's dtype (v has k's dtype too), or FP8 (``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2``, for k and v of float32, bfloat16 or float16), on their
            device. "bshd": (batch, max_len, kv_heads, head_dim); "bhsd": (batch, kv_heads,
            max_len, head_dim) (Hugging Face's static cache); "thd": paged, (num_blocks,
            block_size, kv_heads, head_dim).
        offset: the cache lengths so far, an int or an int64 (batch,) tensor (0-dim: the
            same for every row; "thd" takes an int): token s of row
            b goes to cache row ``offset[b] + s`` (contiguous caches), rotated at that
            position unless ``positions`` are given. For "thd" an int added to the default
            positions (0 beside ``positions``: a ValueError otherwise).
        positions: the positions the new tokens turn at (as :func:`apply_rope`'s; (tokens,)
            for "thd"); default: their cache rows ("thd": ``offset + 0 .. tokens-1``).
        slot_mapping: "thd" only: int64 (tokens,), the cache slot of each token, ``block *
            block_size + index``; -1: rotated but not written (padding, speculative tokens).
            A slot given twice is a ValueError on the CPU; on CUDA it is not checked (as a
            repeated index of ``index_put_``: the slot's contents are then unspecified).
        base, interleaved, rotary_dim, scaling, sections, sections_mode, seq_len: the RoPE
            settings of :func:`apply_rope`.
        rotary_offset: the first rotated feature (default 0), as :func:`apply_rope`'s: k's
            features outside ``[rotary_offset, rotary_offset + rotary_dim)`` (DeepSeek's nope
            part) are written to the cache unrotated.
        inplace: rotate q (and k, with ``return_k``) in their own storage.
        return_k: also return the rotated k.
        k_scale, v_scale: FP8 caches only (default None, which an FP8 cache reads as 1.0; a scale
            given with a cache of k's dtype is a ValueError): the per-tensor scale of each cache, a
            Python float or a 0-d / 1-element float32 tensor on the CPU or on the cache's
            device (a CUDA graph can hold the latter; its value is then checked by the
            kernel). An FP8 cache holds, bit for bit (a NaN's sign aside), what the same call
            on float32 copies of k and v writes into a float32 cache, divided by the scale in
            float32, saturated to the format's largest finite value (448 for e4m3fn, 57344 for
            e5m2: a finite value never becomes NaN or inf) and rounded to nearest even: ``(x32 /
            scale).clamp(-max, max).to(cache.dtype)``. k is rotated once, in float32, before
            it is scaled.
        q_weight, k_weight, eps, weight_offset, norm: QK-norm (Qwen3, Gemma 3, OLMo 2
            decoding): with both weights, q and k are normalised exactly as
            :func:`qk_norm_rope` normalises them with these arguments, then rotated and
            written, in the same one pass: q and the returned k are ``qk_norm_rope``'s
            outputs, the cache holds its k (an FP8 cache: ``qk_norm_rope``'s k of a float32
            copy of k and ``k_weight``, quantised as above).
        config: a parsed :class:`~posenc.functional.RopeConfig` instead of RoPE's keywords
            (as :func:`apply_rope`).

    Every row or slot written must lie in the cache: on the CPU an ``IndexError`` is raised
    before anything is written (the caches unchanged); CUDA kernels never write outside the
    cache (an out-of-range row stops the kernel with a device-side assert, as ATen's
    indexing; by construction, not run: no GPU has run posenc's CUDA kernels). Returns the
    rotated q, or (q, k) with ``return_k``.
    """
    fn = "rope_append_kv"
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(t).__name__}")
    _optional_tensor_args(fn, slot_mapping=slot_mapping, q_weight=q_weight, k_weight=k_weight)
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{fn}: expected q_weight and k_weight together (QK-norm) or neither, got "
                         f"{'q_weight' if k_weight is None else 'k_weight'} alone")
    check_norm_settings(fn, eps, weight_offset, norm)
    config = config_of(q, config, fn, **rope)
    # RoPE's arguments exactly as apply_rope normalises them (no packed sequences here).
    arguments = rope_op_arguments(q, config, positions=positions, offset=offset, cu_seqlens=None,
                                  check_inputs=False, seq_len=seq_len, fn=fn)
    # Its own arguments, those given only (a None tensor or a setting at its default is left out).
    for name, value in (("slot_mapping", slot_mapping), ("q_weight", q_weight), ("k_weight", k_weight)):
        if value is not None:
            arguments[name] = value
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None:
            arguments[name] = _scale_arg(value, name, fn)
    return_k, inplace = _bool_arg(fn, "return_k", return_k), _bool_arg(fn, "inplace", inplace)
    for name, value in (("return_k", return_k), ("eps", float(eps)), ("weight_offset", float(weight_offset)),
                        ("norm", norm)):
        if value != _OWN_DEFAULTS[name]:
            arguments[name] = value
    _refuse_captured_writes(fn, k_cache=k_cache, v_cache=v_cache, q=q if inplace else None,
                            k=k if inplace and return_k else None)
    if inplace:
        # Without return_k, the overload whose schema reads k (keep_k): k is not written.
        op = torch.ops.posenc.rope_append_kv_.default if return_k else torch.ops.posenc.rope_append_kv_.keep_k
        op(q, k, v, k_cache, v_cache, **arguments)
        return (q, k) if return_k else q
    out_q, out_k = torch.ops.posenc.rope_append_kv(q, k, v, k_cache, v_cache, **arguments)
    return (out_q, out_k) if return_k else out_q
