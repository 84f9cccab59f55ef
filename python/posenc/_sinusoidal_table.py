"""The fixed sinusoidal encoding table: the Python front end of
``torch.ops.posenc.sinusoidal_table`` (the C++ ``posenc::sinusoidal_table`` calls it too)."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc._common import _float_arg, _int_arg, _table_dtype


def sinusoidal_table(
    positions: Tensor, d_model: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The fixed sinusoidal encoding of Vaswani et al. (2017) at ``positions``.

    ``positions`` may be integer or floating point, of any shape; the result has shape
    ``positions.shape + (d_model,)`` with interleaved columns
    ``PE[..., 2i] = sin(pos * base**(-2i/d_model))`` and ``PE[..., 2i+1] = cos(...)``.
    An odd ``d_model`` ends with a sine column. Values are computed in float64 and converted
    to ``dtype`` as ``Tensor.to`` converts them (through float32 for float16 and bfloat16).
    """
    if not isinstance(positions, Tensor):
        raise TypeError(f"sinusoidal_table: expected positions to be a Tensor, got {type(positions).__name__}")
    fn = "sinusoidal_table"
    dtype = _table_dtype(fn, dtype)
    # The op takes the dtype by name (torch 2.11's AOTInductor misread ScalarType arguments).
    return torch.ops.posenc.sinusoidal_table(positions, _int_arg(fn, "d_model", d_model), _float_arg(fn, "base", base),
                                             str(dtype).removeprefix("torch."))


def _batch_rule(info, in_dims, positions, *args, **kwargs):
    """vmap rule of posenc::sinusoidal_table: a table per position of any shape, so a vmapped
    positions is one call on all of them, its batch dim where it was (the table's columns
    come last). Without it vmap ran the op once per sample, with PyTorch's warning asking to
    report the missing rule."""
    return torch.ops.posenc.sinusoidal_table(positions, *args, **kwargs), in_dims[0]


torch.library.register_vmap("posenc::sinusoidal_table", _batch_rule)
