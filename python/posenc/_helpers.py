"""The helper ops' Python front ends (make_positions, sinusoidal_2d_table,
resample_position_table, timestep_embedding) and diffusers' ``Timesteps`` module over
timestep_embedding; exported by :mod:`posenc.functional` and :mod:`posenc.modules`.
(rope_frequencies and grid_positions, helper ops too, are in ``_rope.py``.) No ``from
__future__ import annotations`` here, as in modules.py: TorchScript reads a module's
annotations as types."""

import numbers
from collections.abc import Mapping, Set as AbstractSet
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from posenc._common import _TracedSizeError, _bool_arg, _float_arg, _int_arg, _table_dtype, _tensor_arg


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
    downscale_freq_shift))``, angles ``t * frequency`` multiplied by ``scale`` (diffusers'
    ``scale``; default 1), halves swapped when ``flip_sin_to_cos``, and one zero column
    appended when ``dim`` is odd. Computed in float32 with the same
    operation order as diffusers so the numbers agree. Where diffusers divides 0 by 0
    (``dim // 2 == downscale_freq_shift``, e.g. dim 2 or 3 with the default shift) and
    returns NaN, this raises ValueError instead. Op ``torch.ops.posenc.timestep_embedding``
    (the C++ ``posenc::timestep_embedding`` calls it too).
    """
    fn = "timestep_embedding"
    t = _tensor_arg(fn, "t", t)
    try:
        dim = _int_arg(fn, "dim", dim)  # ints and numpy ints; not 2.5, True or "8"
    except _TracedSizeError:
        raise
    except TypeError:
        raise TypeError(f"{fn}: expected dim to be a positive int, got {dim!r}") from None
    except ValueError:
        raise ValueError(f"{fn}: expected dim to be a positive int, got {dim!r}") from None
    return torch.ops.posenc.timestep_embedding(
        t,
        dim,
        _float_arg(fn, "max_period", max_period),
        _bool_arg(fn, "flip_sin_to_cos", flip_sin_to_cos),
        _float_arg(fn, "downscale_freq_shift", downscale_freq_shift),
        _float_arg(fn, "scale", scale),
    )


def make_positions(tokens: Tensor, padding_idx: int, *, offset: int = 0) -> Tensor:
    """Padding-aware positions, fairseq style: non-padding tokens are numbered
    ``padding_idx + offset + 1, padding_idx + offset + 2, ...`` along dim 1 and padding
    gets ``padding_idx``.

    ``tokens``: integer (batch, seq). ``offset`` (>= 0): the tokens before these in a cache
    (transformers' ``create_position_ids_from_input_ids(..., past_key_values_length)``:
    padding stays at ``padding_idx``, which adding the offset to the result would move).
    Returns int64 positions of the same shape, ready for ``positions=`` (with a table of at
    least ``padding_idx + offset + seq + 1`` rows; a learned one as fairseq's and RoBERTa's:
    ``LearnedPositionalEncoding(..., padding_idx=padding_idx)``, whose padding row gets no
    gradient). Op ``torch.ops.posenc.make_positions``
    (the C++ ``posenc::make_positions`` calls it too).
    """
    fn = "make_positions"
    return torch.ops.posenc.make_positions(
        _tensor_arg(fn, "tokens", tokens), _int_arg(fn, "padding_idx", padding_idx), _int_arg(fn, "offset", offset)
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
    halves of dim/4 frequencies ``1 / base**(i / (dim/4))``, in float64, converted to ``dtype``
    by ``Tensor.to`` (through float32 for float16 and bfloat16, as torch converts). ``dim``
    must be a multiple of 4. The two axis tables (grid_w and grid_h rows) are computed on the
    host in float64, moved to ``device``, and laid out over the grid there.
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
    dtype = _table_dtype(fn, dtype)
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
    "bilinear" or "nearest" (``antialias`` applies to the first two; transformers' ViT /
    DeiT ``interpolate_pos_encoding`` is ``antialias=False``). Op
    ``torch.ops.posenc.resample_position_table`` (the C++ ``posenc::resample_position_table``
    calls it too).

    Difference from timm (1.0.31, checked): for equal grids timm returns the table itself,
    posenc a copy (the op's result never aliases ``pe``); the values are the same.
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
        _bool_arg(fn, "antialias", antialias),
    )


def _as_grid(name: str, grid: GridLike) -> list[int]:
    """[h, w] of ints (an int n means (n, n); any two-element sequence, tensor or array of
    ints works); floats and bools are refused (TypeError), not truncated; another length is a
    ValueError. The op checks the values."""
    message = f"resample_position_table: expected {name} to be (h, w) of ints, got {grid!r}"
    if isinstance(grid, (AbstractSet, Mapping)):  # unordered: which is h?
        raise TypeError(message)
    pair = grid if hasattr(grid, "__len__") and not isinstance(grid, (str, bytes)) else (grid, grid)
    try:
        size = len(pair)
    except TypeError:  # a 0-d tensor
        raise TypeError(message) from None
    if size != 2:
        raise ValueError(message)
    try:
        return [_int_arg("resample_position_table", name, v) for v in pair]
    except _TracedSizeError:
        raise
    except TypeError:
        raise TypeError(message) from None
    except ValueError:  # past int64
        raise ValueError(message) from None


def _python_number(value: Any) -> Any:
    """A numpy number (np.int64, np.float32, ...) as the Python number of its value; anything
    else as it is."""
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)) and hasattr(value, "item"):
        return value.item()
    return value


def _real_setting(value: Any) -> Any:
    """A numpy or Python number as a Python one, an int (not a bool) as a float; any other value
    as it is, for the op's check and message."""
    value = _python_number(value)
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


class Timesteps(nn.Module):
    """diffusers' ``Timesteps`` module: ``forward(timesteps)`` is
    ``functional.timestep_embedding(timesteps, num_channels, max_period=max_period,
    flip_sin_to_cos=flip_sin_to_cos, downscale_freq_shift=downscale_freq_shift, scale=scale)``,
    (N, num_channels) float32 for a 1-D tensor of N timesteps, the same numbers as
    diffusers' ``get_timestep_embedding``.

    The constructor is diffusers' (``num_channels, flip_sin_to_cos, downscale_freq_shift,
    scale=1``), plus ``max_period`` (diffusers always uses 10000); the attributes of the same
    names are read at each call. No parameters or buffers: an empty ``state_dict``, as in
    diffusers, so checkpoints load unchanged. The settings are checked when the module is
    built (by the op, with its messages). C++: ``posenc::Timesteps``.
    """

    def __init__(
        self,
        num_channels: int,
        flip_sin_to_cos: bool,
        downscale_freq_shift: float,
        scale: float = 1,
        max_period: float = 10000,
    ) -> None:
        super().__init__()
        for name, value in (("num_channels", num_channels), ("downscale_freq_shift", downscale_freq_shift),
                            ("scale", scale), ("max_period", max_period)):
            if isinstance(value, Tensor):  # a setting, kept as an attribute: a number, as in diffusers
                raise TypeError(f"Timesteps: expected {name} to be a number, got a Tensor")
        # numpy numbers as Python ones (torch.jit.script holds only those as attributes); the
        # values as given otherwise (the op checks them below, with its messages).
        self.num_channels = _python_number(num_channels)
        self.flip_sin_to_cos = _bool_arg("Timesteps", "flip_sin_to_cos", flip_sin_to_cos)
        # The three real settings as floats (an int as a float: torch.jit.script types an
        # attribute by its value, and an int one refused a float set later, which eager takes).
        self.downscale_freq_shift = _real_setting(downscale_freq_shift)
        self.scale = _real_setting(scale)
        self.max_period = _real_setting(max_period)
        self(torch.empty(0))  # the op checks the settings on no timesteps

    def forward(self, timesteps: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            # torch.jit.script compiles this branch alone: the op timestep_embedding calls, with
            # the settings the constructor checked (the function's keywords are not TorchScript).
            return torch.ops.posenc.timestep_embedding(timesteps, self.num_channels, float(self.max_period),
                                                       self.flip_sin_to_cos, float(self.downscale_freq_shift),
                                                       float(self.scale))
        return timestep_embedding(
            timesteps,
            self.num_channels,
            max_period=self.max_period,
            flip_sin_to_cos=self.flip_sin_to_cos,
            downscale_freq_shift=self.downscale_freq_shift,
            scale=self.scale,
        )

    def extra_repr(self) -> str:
        return (
            f"num_channels={self.num_channels}, flip_sin_to_cos={self.flip_sin_to_cos}, "
            f"downscale_freq_shift={self.downscale_freq_shift}, scale={self.scale}, max_period={self.max_period}"
        )

