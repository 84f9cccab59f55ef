"""Functional forms of the posenc encodings."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from posenc._dtensor import place_beside
from posenc._helpers import make_positions, resample_position_table, sinusoidal_2d_table, timestep_embedding
from posenc._helpers import GridLike  # noqa: F401  (resample_position_table's grid type)
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
