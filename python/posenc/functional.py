"""Functional forms of the posenc encodings."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch import Tensor

from posenc._rope import apply_rope, grid_positions, rope_frequencies

__all__ = [
    "add_position",
    "apply_rope",
    "grid_positions",
    "make_positions",
    "resample_position_table",
    "rope_frequencies",
    "sinusoidal_2d_table",
    "sinusoidal_table",
    "timestep_embedding",
]


def _int_arg(fn: str, name: str, value) -> int:
    """value as an int (Python or numpy integer, not bool), or ValueError naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{fn}: expected {name} to be an int, got {value!r}")


def _finite_arg(fn: str, name: str, value, *, above: Optional[float] = None) -> float:
    """value (a real number: Python, numpy or a one-element tensor; not bool or str) as a
    finite float, above `above` when given, or ValueError naming it."""
    number = None
    if not isinstance(value, (bool, str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    if number is not None and math.isfinite(number) and (above is None or number > above):
        return number
    what = "a finite number" + (f" > {above:g}" if above is not None else "")
    raise ValueError(f"{fn}: expected {name} to be {what}, got {value!r}")


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
    return torch.ops.posenc.sinusoidal_table(positions, d_model, float(base), dtype)


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
    returns NaN, this raises ValueError instead.
    """
    if not isinstance(t, Tensor) or t.dim() != 1:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"timestep_embedding: expected t to be a 1-D tensor of timesteps, got {shape}")
    original_dim = dim
    try:
        dim = _int_arg("timestep_embedding", "dim", dim)  # ints and numpy ints, not bool
    except ValueError:
        dim = None
    if dim is None or dim <= 0:
        raise ValueError(f"timestep_embedding: expected dim to be a positive int, got {original_dim!r}")
    max_period = _finite_arg("timestep_embedding", "max_period", max_period, above=0.0)
    downscale_freq_shift = _finite_arg("timestep_embedding", "downscale_freq_shift", downscale_freq_shift)
    scale = _finite_arg("timestep_embedding", "scale", scale)
    half = dim // 2
    if half > 0 and half - downscale_freq_shift == 0:
        raise ValueError(
            f"timestep_embedding: half of dim ({half}) minus downscale_freq_shift "
            f"({downscale_freq_shift}) must not be zero"
        )
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    exponent = exponent / (half - downscale_freq_shift) if half > 0 else exponent
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    if dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


def make_positions(tokens: Tensor, padding_idx: int) -> Tensor:
    """Padding-aware positions, fairseq style: non-padding tokens are numbered
    ``padding_idx + 1, padding_idx + 2, ...`` along dim 1 and padding gets ``padding_idx``.

    ``tokens``: integer (batch, seq). Returns int64 positions of the same shape, ready for
    ``positions=`` (with a table of at least ``padding_idx + seq + 1`` rows).
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"make_positions: expected integer tokens of shape (batch, seq), got {shape}")
    padding_idx = _int_arg("make_positions", "padding_idx", padding_idx)
    if not -(2**62) <= padding_idx <= 2**62:  # padding_idx + seq must stay an int64
        raise ValueError(f"make_positions: expected padding_idx within +-2**62, got {padding_idx}")
    mask = tokens.ne(padding_idx).to(torch.int64)
    return torch.cumsum(mask, dim=1) * mask + padding_idx


def _sincos_halves(coords: Tensor, dim: int, base: float) -> Tensor:
    """[sin | cos] halves of dim/2 frequencies base^(-i/(dim/2)), in float64 (MAE's 1-D form)."""
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / base**omega
    angles = coords.reshape(-1, 1).to(torch.float64) * omega
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sinusoidal_2d_table(
    grid_h: int, grid_w: int, dim: int, *, base: float = 10000.0, num_prefix_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The fixed 2-D sin-cos table of MAE (``get_2d_sincos_pos_embed``), same layout.

    Returns (num_prefix_tokens + grid_h * grid_w, dim): zero rows for the prefix (class)
    tokens, then the patches in row-major (h, w) order. As in MAE the first dim/2 columns
    encode the patch's column index w and the last dim/2 its row index h, each as [sin | cos]
    halves of dim/4 frequencies. ``dim`` must be a multiple of 4.
    """
    for name, value in (("grid_h", grid_h), ("grid_w", grid_w), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"sinusoidal_2d_table: expected {name} to be a positive integer, got {value!r}")
    if dim % 4 != 0:
        raise ValueError(f"sinusoidal_2d_table: expected dim to be a multiple of 4, got {dim}")
    if isinstance(num_prefix_tokens, bool) or not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
        raise ValueError(f"sinusoidal_2d_table: expected num_prefix_tokens >= 0, got {num_prefix_tokens!r}")
    # base <= 1 gives frequencies that do not decrease (base 1: identical columns), as in
    # sinusoidal_table and RoPE.
    base = _finite_arg("sinusoidal_2d_table", "base", base, above=1.0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"sinusoidal_2d_table: expected a floating-point dtype, got {dtype!r}")
    rows = torch.arange(grid_h, dtype=torch.float64).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, dtype=torch.float64).repeat(grid_h)
    table = torch.cat([_sincos_halves(cols, dim // 2, base), _sincos_halves(rows, dim // 2, base)], dim=1)
    table = torch.cat([torch.zeros(num_prefix_tokens, dim, dtype=torch.float64), table], dim=0)
    return table.to(dtype)


def resample_position_table(
    pe: Tensor,
    new_grid,
    *,
    old_grid=None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resize a learned ViT position table (1, prefix + H*W, d) to another patch grid.

    Prefix (class/register) rows are kept unchanged; the H x W patch rows are resampled
    with ``F.interpolate`` (in float32, then cast back), as timm's
    ``resample_abs_pos_embed`` does. ``old_grid`` defaults to the square grid the table
    implies. Returns (1, prefix + new_h * new_w, d). ``mode``: "bicubic", "bilinear" or
    "nearest" (``antialias`` applies to the first two).

    One deliberate difference from timm: timm returns the table unchanged whenever the new
    grid is square with as many cells as the old one, even if the old grid was not square
    (e.g. 8x2 -> 4x4); posenc returns it unchanged only when the grids are equal, and
    resamples otherwise.
    """
    if mode not in ("bicubic", "bilinear", "nearest"):
        raise ValueError(f"resample_position_table: expected mode bicubic, bilinear or nearest, got {mode!r}")
    if not isinstance(pe, Tensor) or pe.dim() != 3 or pe.shape[0] != 1:
        shape = tuple(pe.shape) if isinstance(pe, Tensor) else type(pe).__name__
        raise ValueError(f"resample_position_table: expected pe of shape (1, tokens, dim), got {shape}")
    new_grid = _as_grid("new_grid", new_grid)
    num_prefix_tokens = _int_arg("resample_position_table", "num_prefix_tokens", num_prefix_tokens)
    if num_prefix_tokens < 0 or num_prefix_tokens > pe.shape[1]:
        raise ValueError(
            f"resample_position_table: expected 0 <= num_prefix_tokens <= {pe.shape[1]}, got {num_prefix_tokens}"
        )
    patches = pe.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(patches)
        if side * side != patches:
            raise ValueError(
                f"resample_position_table: {patches} patch rows (after {num_prefix_tokens} prefix "
                f"tokens) are not a square grid; pass old_grid=(h, w)"
            )
        old_grid = (side, side)
    old_grid = _as_grid("old_grid", old_grid)
    if old_grid[0] * old_grid[1] != patches:
        raise ValueError(
            f"resample_position_table: old_grid {old_grid} has {old_grid[0] * old_grid[1]} cells but "
            f"the table has {patches} patch rows after {num_prefix_tokens} prefix tokens"
        )
    if old_grid == new_grid:
        return pe
    prefix, grid = pe[:, :num_prefix_tokens], pe[:, num_prefix_tokens:]
    dim = pe.shape[-1]
    image = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    kwargs = {"antialias": antialias} if mode in ("bilinear", "bicubic") else {}
    image = torch.nn.functional.interpolate(image, size=new_grid, mode=mode, **kwargs)
    grid = image.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pe.dtype)
    return torch.cat([prefix, grid], dim=1)


def _as_grid(name: str, grid):
    """(h, w) of ints (an int n means (n, n); any two-element sequence, tensor or array of
    ints works); floats and bools are refused, not truncated."""
    pair = grid if hasattr(grid, "__len__") and not isinstance(grid, (str, bytes)) else (grid, grid)
    try:
        if len(pair) != 2:
            raise ValueError
        h, w = (_int_arg("resample_position_table", name, v) for v in pair)
    except (TypeError, ValueError):
        raise ValueError(f"resample_position_table: expected {name} to be (h, w) of ints, got {grid!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"resample_position_table: expected {name} to be positive, got {(h, w)}")
    return (h, w)
