"""Functional forms of the posenc encodings."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["add_position", "sinusoidal_table", "timestep_embedding"]


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
    operation order as diffusers so the numbers agree.
    """
    if not isinstance(t, Tensor) or t.dim() != 1:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"timestep_embedding: expected t to be a 1-D tensor of timesteps, got {shape}")
    if dim <= 0:
        raise ValueError(f"timestep_embedding: expected dim > 0, got {dim}")
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
