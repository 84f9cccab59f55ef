"""Functional forms of the posenc encodings."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from posenc._dtensor import place_beside
from posenc._rope import RopeConfig, apply_rope, grid_positions, rope_frequencies
from posenc._rope_append_kv import rope_append_kv
from posenc._rope_cos_sin import apply_rope_cos_sin, rope_cos_sin
from posenc._qk_norm_rope import qk_norm_rope

__all__ = [
    "RopeConfig",
    "add_position",
    "apply_rope",
    "apply_rope_cos_sin",
    "grid_positions",
    "make_positions",
    "qk_norm_rope",
    "resample_position_table",
    "rope_append_kv",
    "rope_cos_sin",
    "rope_frequencies",
    "sinusoidal_2d_table",
    "sinusoidal_table",
    "timestep_embedding",
]


from posenc._common import _float_arg, _int_arg, _table_dtype, _tensor_arg  # noqa: E402,F401


def sinusoidal_table(
    positions: Tensor, d_model: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The fixed sinusoidal encoding of Vaswani et al. (2017) at ``positions``.

    ``positions`` may be integer or floating point, of any shape; the result has shape
    ``positions.shape + (d_model,)`` with interleaved columns
    ``PE[..., 2i] = sin(pos * base**(-2i/d_model))`` and ``PE[..., 2i+1] = cos(...)``.
    An odd ``d_model`` ends with a sine column. Values are computed in float64 and rounded
    once to ``dtype``.
    """
    if not isinstance(positions, Tensor):
        raise TypeError(f"sinusoidal_table: expected positions to be a Tensor, got {type(positions).__name__}")
    dtype = _table_dtype("sinusoidal_table", dtype)
    return torch.ops.posenc.sinusoidal_table(positions, d_model, float(base)).to(dtype)


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
    are added. Dropout applies only when ``training``; its mask is regenerated in backward.
    """
    table, positions = place_beside(x, table, positions)  # plain beside a DTensor x: replicated
    return torch.ops.posenc.add_position(
        x, table, positions, offset, batch_first, float(p) if training else 0.0
    )


def timestep_embedding(
    t: Tensor,
    dim: int,
    *,
    max_period: float = 10000.0,
    flip_sin_to_cos: bool = False,
    downscale_freq_shift: float = 1.0,
    scale: float = 1.0,
) -> Tensor:
    """Diffusion timestep embedding with the diffusers ``get_timestep_embedding`` convention.

    ``t``: 1-D tensor of N (possibly fractional) timesteps. Returns (N, dim) float32:
    ``[sin | cos]`` halves with frequencies ``exp(-ln(max_period) * i / (half -
    downscale_freq_shift))``, scaled angles, halves swapped when ``flip_sin_to_cos``,
    and one zero column appended when ``dim`` is odd. Computed in float32 with the same
    operation order as diffusers so the numbers agree. Where diffusers divides 0 by 0
    (``dim // 2 == downscale_freq_shift``, e.g. dim 2 or 3 with the default shift) and
    returns NaN, this raises ValueError instead. Op ``torch.ops.posenc.timestep_embedding``
    (the C++ ``posenc::timestep_embedding`` calls it too).
    """
    fn = "timestep_embedding"
    t = _tensor_arg(fn, "t", t)
    try:
        dim = _int_arg(fn, "dim", dim)  # ints and numpy ints; not 2.5, True or "8"
    except ValueError:
        raise ValueError(f"{fn}: expected dim to be a positive int, got {dim!r}") from None
    return torch.ops.posenc.timestep_embedding(
        t,
        dim,
        _float_arg(fn, "max_period", max_period),
        bool(flip_sin_to_cos),
        _float_arg(fn, "downscale_freq_shift", downscale_freq_shift),
        _float_arg(fn, "scale", scale),
    )


def make_positions(tokens: Tensor, padding_idx: int) -> Tensor:
    """Padding-aware positions, fairseq style: non-padding tokens are numbered
    ``padding_idx + 1, padding_idx + 2, ...`` along dim 1 and padding gets ``padding_idx``.

    ``tokens``: integer (batch, seq). Returns int64 positions of the same shape, ready for
    ``positions=`` (with a table of at least ``padding_idx + seq + 1`` rows). Op
    ``torch.ops.posenc.make_positions`` (the C++ ``posenc::make_positions`` calls it too).
    """
    fn = "make_positions"
    return torch.ops.posenc.make_positions(
        _tensor_arg(fn, "tokens", tokens), _int_arg(fn, "padding_idx", padding_idx)
    )


def sinusoidal_2d_table(
    grid_h: int,
    grid_w: int,
    dim: int,
    *,
    base: float = 10000.0,
    num_prefix_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Optional[Union[torch.device, str, int]] = None,
    base_size: Optional[float] = None,
    interpolation_scale: float = 1.0,
) -> Tensor:
    """The fixed 2-D sin-cos table of MAE (``get_2d_sincos_pos_embed``), same layout.

    Returns (num_prefix_tokens + grid_h * grid_w, dim): zero rows for the prefix (class)
    tokens, then the patches in row-major (h, w) order. As in MAE the first dim/2 columns
    encode the patch's column index w and the last dim/2 its row index h, each as [sin | cos]
    halves of dim/4 frequencies ``1 / base**(i / (dim/4))``, in float64, rounded once to
    ``dtype``. ``dim`` must be a multiple of 4. Built on the host, then moved to ``device``.
    Op ``torch.ops.posenc.sinusoidal_2d_table`` (the C++ ``posenc::sinusoidal_2d_table``
    calls it too: the same bits).

    ``base_size`` and ``interpolation_scale`` give diffusers' rescaled coordinates (its
    ``get_2d_sincos_pos_embed``, used by PixArt and SD3's ``PatchEmbed``): an axis of ``n``
    patches sits at ``arange(n) / (n / base_size) / interpolation_scale``, computed in
    float32 as diffusers does (without ``base_size``: ``arange(n) / interpolation_scale``;
    the defaults keep MAE's integer coordinates). diffusers'
    ``get_2d_sincos_pos_embed(dim, (grid_h, grid_w), cls_token, extra_tokens,
    interpolation_scale, base_size, output_type="pt")`` is
    ``sinusoidal_2d_table(grid_h, grid_w, dim, base_size=base_size,
    interpolation_scale=interpolation_scale, num_prefix_tokens=extra_tokens if cls_token
    else 0, dtype=torch.float64)`` (its ``base_size`` defaults to 16: pass it).
    """
    fn = "sinusoidal_2d_table"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: expected a floating-point dtype, got {dtype!r}")
    return torch.ops.posenc.sinusoidal_2d_table(
        _int_arg(fn, "grid_h", grid_h),
        _int_arg(fn, "grid_w", grid_w),
        _int_arg(fn, "dim", dim),
        _float_arg(fn, "base", base),
        _int_arg(fn, "num_prefix_tokens", num_prefix_tokens),
        dtype,
        None if device is None else torch.device(device),
        None if base_size is None else _float_arg(fn, "base_size", base_size),
        _float_arg(fn, "interpolation_scale", interpolation_scale),
    )


GridLike = Union[int, Sequence[int], Tensor]


def resample_position_table(
    pe: Tensor,
    new_grid: GridLike,
    *,
    old_grid: Optional[GridLike] = None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resize a learned ViT position table (1, prefix + H*W, d) to another patch grid.

    Prefix (class/register) rows are kept unchanged; the H x W patch rows are resampled
    with ``F.interpolate`` (in float32, then cast back), as timm's
    ``resample_abs_pos_embed`` does. ``old_grid`` defaults to the square grid the table
    implies. Grids are (h, w) (any two-element sequence, tensor or array of ints) or one
    int n for (n, n). Returns (1, prefix + new_h * new_w, d). ``mode``: "bicubic",
    "bilinear" or "nearest" (``antialias`` applies to the first two). Op
    ``torch.ops.posenc.resample_position_table`` (the C++ ``posenc::resample_position_table``
    calls it too).

    Differences from timm: timm returns the table unchanged whenever the new grid is square
    with as many cells as the old one, even if the old grid was not square (e.g. 8x2 -> 4x4);
    posenc resamples unless the grids are equal. For equal grids timm returns the table
    itself, posenc a copy (the op's result never aliases ``pe``).
    """
    fn = "resample_position_table"
    if not isinstance(mode, str):
        raise TypeError(f"{fn}: expected mode to be a str, got {type(mode).__name__}")
    return torch.ops.posenc.resample_position_table(
        _tensor_arg(fn, "pe", pe),
        _as_grid("new_grid", new_grid),
        None if old_grid is None else _as_grid("old_grid", old_grid),
        _int_arg(fn, "num_prefix_tokens", num_prefix_tokens),
        mode,
        bool(antialias),
    )


def _as_grid(name: str, grid: GridLike) -> list[int]:
    """[h, w] of ints (an int n means (n, n); any two-element sequence, tensor or array of
    ints works); floats and bools are refused, not truncated. The op checks the values."""
    pair = grid if hasattr(grid, "__len__") and not isinstance(grid, (str, bytes)) else (grid, grid)
    try:
        if len(pair) != 2:
            raise ValueError
        return [_int_arg("resample_position_table", name, v) for v in pair]
    except (TypeError, ValueError):
        raise ValueError(f"resample_position_table: expected {name} to be (h, w) of ints, got {grid!r}") from None
