"""Functional forms of the posenc encodings."""

from __future__ import annotations

from posenc._add_position import add_position
from posenc._helpers import make_positions, resample_position_table, sinusoidal_2d_table, timestep_embedding
from posenc._helpers import GridLike  # noqa: F401  (resample_position_table's grid type)
from posenc._rope import RopeConfig, apply_rope, grid_positions, rope_frequencies
from posenc._rope_append_kv import rope_append_kv
from posenc._rope_cos_sin import apply_rope_cos_sin, rope_cos_sin
from posenc._rope_shift_kv import rope_shift_kv
from posenc._sinusoidal_table import sinusoidal_table
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
    "rope_shift_kv",
    "sinusoidal_2d_table",
    "sinusoidal_table",
    "timestep_embedding",
]

