"""Re-rotating cached keys: the Python front end of ``torch.ops.posenc.rope_shift_kv_``."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from posenc._common import _in_int64, _integer, _refuse_captured_writes
from posenc._rope import RopeConfig, config_of, with_rope_settings
from posenc._rope_append_kv import _scale_arg


def _seq_len_arg(value: Any, name: str, fn: str) -> Any:
    if value is None:
        return None
    number = _integer(value)  # a numpy integer as an int
    if number is None:
        raise TypeError(f"{fn}: expected {name} to be an int or None, got {value!r}")
    if isinstance(number, int) and number < 0:
        raise ValueError(f"{fn}: expected {name} >= 0 (the longest position + 1) or None, got {number}")
    return _in_int64(fn, name, number)


@with_rope_settings
def rope_shift_kv(
    k_cache: Tensor,
    from_positions: Tensor,
    to_positions: Tensor,
    *,
    rows: Optional[Tensor] = None,
    slot_mapping: Optional[Tensor] = None,
    k_scale: Union[float, Tensor, None] = None,
    from_seq_len: Optional[int] = None,
    to_seq_len: Optional[int] = None,
    config: Optional[RopeConfig] = None,
    **rope: Any,
) -> Tensor:
    """Rotates cached keys in place from the positions they were written at to new ones:
    context shifting (llama.cpp's K-shift), attention sinks (StreamingLLM: keep the first
    tokens, drop a window, move the rest down with index copies, then re-rotate them), or a
    cached segment re-used at another offset. No autograd (inference).

    Each row turns by the angle it must have minus the angle it has, pair by pair: the RoPE
    angle of ``to_positions`` with ``to_seq_len`` minus that of ``from_positions`` with
    ``from_seq_len``, both under the one configuration (``base``, ``scaling``...). For every
    scaling type this is exact, also where the frequencies depend on the length ("dynamic"
    NTK, "longrope"'s short/long factors): it is not a rotation by the position difference.
    The attention factor ("yarn", "longrope") is already in the cached values and is not
    applied again. So ``rope_shift_kv(rope(k, old), old, new)`` equals ``rope(k, new)`` to
    the rounding of the working precision (the turn's cos and sin are combined in float32,
    float64 for float64 caches, from float64 angles).

    Args:
        k_cache: the cache, written in place. Layout "bshd": (batch, max_len, kv_heads,
            head_dim); "bhsd" (Hugging Face's static cache): (batch, kv_heads, max_len,
            head_dim); "thd": paged, (num_blocks, block_size, kv_heads, head_dim). float16,
            bfloat16, float32, float64, or FP8 (``torch.float8_e4m3fn``,
            ``torch.float8_e5m2``): dequantised (``value * k_scale`` in float32), rotated in
            float32, quantised back with the same scale as :func:`rope_append_kv` writes
            (divided, saturated, rounded to nearest even).
        from_positions, to_positions: int64, the positions the rows were written at and
            the ones they move to: (n,) or (batch, n) for "bshd"/"bhsd" ((1, n) shared), (n,)
            for "thd"; with ``sections`` (multi-axis RoPE) a leading axis of n_axes.
        rows: "bshd"/"bhsd": int64 (n,) or (batch, n), the cache rows turned (default
            0 .. n-1). Each row at most once per batch row (a ValueError on the CPU: it
            would turn twice).
        slot_mapping: "thd" only: int64 (n,), slot ``block * block_size + index`` of each
            position; -1: not turned. Each slot at most once.
        k_scale: FP8 caches only (default None, which an FP8 cache reads as 1.0; a scale given
            with a cache of k's dtype is a ValueError): the cache's per-tensor scale, a Python float
            or a 0-d / 1-element float32 tensor on the CPU or on the cache's device.
        from_seq_len, to_seq_len: for "dynamic" and "longrope", the length each end scaled
            for (as ``seq_len`` of :func:`apply_rope` / :func:`rope_append_kv` when the keys
            were written, and for the new positions); None: the longest of its positions + 1
            (a device sync for CUDA positions, as ``apply_rope``'s default).
        base, interleaved, rotary_dim, scaling, layout, sections, sections_mode, rotary_offset: the
            RoPE settings of :func:`apply_rope`.
        config: a parsed :class:`~posenc.functional.RopeConfig` instead of the keywords.

    Every row or slot must lie in the cache: on the CPU an ``IndexError`` is raised before
    anything is written; CUDA kernels never write outside the cache (a device-side assert;
    by construction, not run: no GPU has run posenc's CUDA kernels).
    Returns ``k_cache``.
    """
    fn = "rope_shift_kv"
    for name, t in (("k_cache", k_cache), ("from_positions", from_positions), ("to_positions", to_positions)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(t).__name__}")
    config = config_of(k_cache, config, fn, **rope)
    arguments = dict(config.op_kwargs)
    for name, value in (("rows", rows), ("slot_mapping", slot_mapping)):
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{fn}: expected {name} to be an int64 tensor or None, got {type(value).__name__}")
        if value is not None:
            arguments[name] = value
    scale = _scale_arg(k_scale, "k_scale", fn)
    if scale is not None:
        arguments["k_scale"] = scale
    for name, value in (("from_seq_len", from_seq_len), ("to_seq_len", to_seq_len)):
        value = _seq_len_arg(value, name, fn)
        if value is not None:
            arguments[name] = value
    _refuse_captured_writes(fn, k_cache=k_cache)
    torch.ops.posenc.rope_shift_kv_(k_cache, from_positions, to_positions, **arguments)
    return k_cache
