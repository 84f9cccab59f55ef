"""sinusoidal_2d_table's rescaled coordinates (base_size, interpolation_scale): diffusers'
get_2d_sincos_pos_embed as PixArt and SD3 call it. Each axis of n patches sits at
arange(n, float32) / (n / base_size) / interpolation_scale, in float32 as diffusers computes
it, then MAE's float64 table (first half of the columns: w, second half: h). The defaults
(base_size None, interpolation_scale 1) keep MAE's integer coordinates, bit for bit. The C++
side: tests/cpp/test_learned.cpp (Helpers.Sinusoidal2dTableRescaledCoordinatesAreDiffusers,
Helpers.CppFunctionsCallTheOps)."""

import inspect

import numpy as np
import pytest
import torch

from posenc.functional import sinusoidal_2d_table

from conftest import DEVICES

ops = torch.ops.posenc


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


def diffusers_coordinates(n, base_size, interpolation_scale):
    """One axis as diffusers computes it: a float32 arange divided by Python floats (numpy 2
    keeps float32, as torch does)."""
    coords = np.arange(n, dtype=np.float32)
    if base_size is not None:
        coords = coords / (n / base_size)
    coords = coords / interpolation_scale
    assert coords.dtype == np.float32
    return coords


def diffusers_2d_sincos(embed_dim, grid_size, cls_token=False, extra_tokens=0, interpolation_scale=1.0,
                        base_size=16):
    """diffusers' get_2d_sincos_pos_embed, written out in numpy from its formula: float32
    coordinates, float64 frequencies 1 / 10000**(i / (D/4)) and angles. base_size None (not
    a diffusers value) leaves the coordinates arange(n) / interpolation_scale."""
    if isinstance(grid_size, int):
        grid_size = (grid_size, grid_size)
    grid_h = diffusers_coordinates(grid_size[0], base_size, interpolation_scale)
    grid_w = diffusers_coordinates(grid_size[1], base_size, interpolation_scale)
    grid = np.meshgrid(grid_w, grid_h)  # w first, as in diffusers
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size[1], grid_size[0]])

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    if cls_token and extra_tokens > 0:
        emb = np.concatenate([np.zeros([extra_tokens, embed_dim]), emb], axis=0)
    return torch.from_numpy(emb)


# (grid_h, grid_w, dim, base_size, interpolation_scale): square, non-square, odd, the
# PixArt-alpha 1024 table (64 x 64, base 64, scale 2), SD3's (192 x 192, base 64: i / 3 is
# not exact), a fractional base_size, scale < 1.
CASES = [
    (16, 16, 64, 16, 1.0), (64, 64, 128, 64, 2.0), (32, 32, 96, 32, 1.0), (192, 192, 64, 64, 1.0),
    (12, 20, 32, 16, 1.0), (20, 12, 32, 16, 2.0), (7, 5, 16, 8, 1.5), (9, 9, 16, 2.5, 0.75),
    (1, 3, 8, 16, 1.0), (13, 1, 8, 4, 3.0), (11, 6, 24, None, 0.5), (5, 7, 16, None, 1.0),
]


@pytest.mark.parametrize("h,w,dim,base_size,scale", CASES)
def test_rescaled_table_matches_diffusers_formula(h, w, dim, base_size, scale):
    got = sinusoidal_2d_table(h, w, dim, base_size=base_size, interpolation_scale=scale, dtype=torch.float64)
    want = diffusers_2d_sincos(dim, (h, w), base_size=base_size, interpolation_scale=scale)
    assert got.shape == want.shape == (h * w, dim)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # float32: the float64 table rounded once.
    got32 = sinusoidal_2d_table(h, w, dim, base_size=base_size, interpolation_scale=scale)
    assert got32.dtype == torch.float32 and torch.equal(got32, got.float())


def test_coordinates_are_float32_like_diffusers():
    """SD3's table (base 64 over 192 patches: coordinates i / 3) needs diffusers' float32
    coordinates: computed in float64 they move the angles by up to ~2e-6."""
    got = sinusoidal_2d_table(192, 192, 16, base_size=64, dtype=torch.float64)
    coords64 = np.arange(192, dtype=np.float64) / (192 / 64)
    exact = np.sin(np.tile(coords64, 192))  # column 0: sin(w * omega_0), omega_0 = 1
    assert np.abs(got[:, 0].numpy() - exact).max() > 1e-7
    want = np.sin(np.tile(diffusers_coordinates(192, 64, 1.0).astype(np.float64), 192))
    torch.testing.assert_close(got[:, 0], torch.from_numpy(want), atol=1e-15, rtol=0)


@pytest.mark.parametrize("cls_token,extra_tokens", [(True, 1), (True, 4), (False, 3), (True, 0)])
def test_cls_token_and_extra_tokens(cls_token, extra_tokens):
    """diffusers prepends extra_tokens zero rows only when cls_token: num_prefix_tokens is
    extra_tokens if cls_token else 0."""
    want = diffusers_2d_sincos(32, (6, 10), cls_token=cls_token, extra_tokens=extra_tokens, base_size=8,
                               interpolation_scale=2.0)
    got = sinusoidal_2d_table(6, 10, 32, base_size=8, interpolation_scale=2.0,
                              num_prefix_tokens=extra_tokens if cls_token else 0, dtype=torch.float64)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_int_grid_size_and_layout():
    """diffusers' int grid_size n is (n, n); rows are (h, w) row-major, w in the first half."""
    want = diffusers_2d_sincos(16, 8, base_size=4, interpolation_scale=1.0)
    got = sinusoidal_2d_table(8, 8, 16, base_size=4, dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    table = sinusoidal_2d_table(3, 5, 8, base_size=10, interpolation_scale=2.0, dtype=torch.float64)
    h_coords = diffusers_coordinates(3, 10, 2.0)
    w_coords = diffusers_coordinates(5, 10, 2.0)
    row = 2 * 5 + 4  # h = 2, w = 4
    assert table[row, 0].item() == pytest.approx(np.sin(float(w_coords[4])), abs=1e-15)  # omega_0 = 1
    assert table[row, 4].item() == pytest.approx(np.sin(float(h_coords[2])), abs=1e-15)


@pytest.mark.parametrize("h,w,dim", [(1, 1, 4), (3, 5, 8), (14, 14, 768), (7, 3, 192)])
def test_defaults_are_mae_bit_for_bit(h, w, dim):
    """Without the new options (or with their defaults) the table is MAE's integer-coordinate
    one, unchanged; base_size equal to the grid and scale 1 give the same integer coordinates."""
    old = ops.sinusoidal_2d_table(h, w, dim, 10000.0, 1, torch.float64, None)
    assert bits_equal(sinusoidal_2d_table(h, w, dim, num_prefix_tokens=1, dtype=torch.float64), old)
    assert bits_equal(sinusoidal_2d_table(h, w, dim, num_prefix_tokens=1, dtype=torch.float64, base_size=None,
                                          interpolation_scale=1.0), old)
    if h == w:
        assert bits_equal(sinusoidal_2d_table(h, w, dim, num_prefix_tokens=1, dtype=torch.float64, base_size=h), old)
    h_int = torch.arange(h, dtype=torch.float64).repeat_interleave(w)
    w_int = torch.arange(w, dtype=torch.float64).repeat(h)
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    want = torch.cat([torch.sin(w_int[:, None] * omega), torch.cos(w_int[:, None] * omega),
                      torch.sin(h_int[:, None] * omega), torch.cos(h_int[:, None] * omega)], 1)
    assert torch.equal(old[1:], want)


@pytest.mark.parametrize("h,w,dim,base_size,scale,prefix,dtype", [
    (4, 4, 16, 16, 1.0, 0, torch.float32), (7, 5, 32, 3.0, 2.0, 1, torch.float64),
    (64, 64, 64, 64, 2.0, 0, torch.bfloat16), (9, 6, 16, None, 0.75, 2, torch.float16),
])
def test_python_is_the_op(h, w, dim, base_size, scale, prefix, dtype):
    got = sinusoidal_2d_table(h, w, dim, num_prefix_tokens=prefix, dtype=dtype, base_size=base_size,
                              interpolation_scale=scale)
    assert bits_equal(got, ops.sinusoidal_2d_table(h, w, dim, 10000.0, prefix, dtype, None, base_size, scale))
    assert bits_equal(got, ops.sinusoidal_2d_table(h, w, dim, num_prefix_tokens=prefix, dtype=dtype,
                                                   base_size=base_size, interpolation_scale=scale))
    # numpy and tensor numbers are normalised to floats.
    for bs, sc in ((None if base_size is None else np.int64(base_size) if float(base_size).is_integer()
                    else np.float64(base_size), np.float32(scale)),
                   (None if base_size is None else torch.tensor(float(base_size)), torch.tensor(scale))):
        assert bits_equal(sinusoidal_2d_table(h, w, dim, num_prefix_tokens=prefix, dtype=dtype, base_size=bs,
                                              interpolation_scale=sc), got)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_rescaled_table_on_a_device(device):
    got = sinusoidal_2d_table(6, 9, 32, num_prefix_tokens=1, base_size=5, interpolation_scale=1.5, device=device)
    assert got.device.type == device and got.shape == (55, 32) and got.dtype == torch.float32
    if device != "meta":
        # Built on the host: the same bits on every device.
        assert torch.equal(got.cpu(), sinusoidal_2d_table(6, 9, 32, num_prefix_tokens=1, base_size=5,
                                                          interpolation_scale=1.5))


def test_opcheck_and_compile():
    torch.library.opcheck(ops.sinusoidal_2d_table.default, (3, 4, 16, 100.0, 1, torch.float64, None, 2.0, 1.5))
    torch.library.opcheck(ops.sinusoidal_2d_table.default, (3, 4, 16), {"interpolation_scale": 0.5})

    def f():
        return sinusoidal_2d_table(12, 8, 16, base_size=16, interpolation_scale=2.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert bits_equal(compiled(), f())


@pytest.mark.parametrize("kwargs, message", [
    ({"base_size": 0}, "expected base_size to be None or a finite number > 0, got 0.0"),
    ({"base_size": -16}, "expected base_size to be None or a finite number > 0, got -16.0"),
    ({"base_size": float("nan")}, "expected base_size to be None or a finite number > 0, got nan"),
    ({"base_size": float("inf")}, "expected base_size to be None or a finite number > 0, got inf"),
    ({"interpolation_scale": 0.0}, "expected interpolation_scale to be a finite number > 0, got 0.0"),
    ({"interpolation_scale": -2}, "expected interpolation_scale to be a finite number > 0, got -2.0"),
    ({"interpolation_scale": float("inf")}, "expected interpolation_scale to be a finite number > 0, got inf"),
    ({"interpolation_scale": float("nan")}, "expected interpolation_scale to be a finite number > 0, got nan"),
    # Divisors that float32 rounds to 0 or whose quotients overflow: inf / NaN coordinates.
    ({"base_size": 1e300}, r"expected finite float32 coordinates arange\(grid_h\) / \(grid_h / base_size\) / "
                           r"interpolation_scale, got grid_h=4, base_size=1e\+300, interpolation_scale=1.0"),
    ({"interpolation_scale": 1e-300}, r"got grid_h=4, base_size=None, interpolation_scale=1e-300"),
    ({"interpolation_scale": 1e-40}, r"got grid_h=4, base_size=None, interpolation_scale=1e-40"),
])
def test_bad_values_are_refused_by_the_op(kwargs, message):
    with pytest.raises(ValueError, match=message) as from_python:
        sinusoidal_2d_table(4, 6, 8, **kwargs)
    full = {"base_size": None, "interpolation_scale": 1.0, **{k: float(v) for k, v in kwargs.items()}}
    with pytest.raises(ValueError, match=message) as from_op:
        ops.sinusoidal_2d_table(4, 6, 8, base_size=full["base_size"], interpolation_scale=full["interpolation_scale"])
    assert str(from_python.value) == str(from_op.value)
    assert str(from_python.value).startswith("sinusoidal_2d_table: expected ")


def test_bad_types_are_refused_in_python():
    for kwargs, message in (
        ({"base_size": "16"}, "sinusoidal_2d_table: expected base_size to be a real number, got '16'"),
        ({"base_size": True}, "expected base_size to be a real number, got True"),
        ({"interpolation_scale": None}, "expected interpolation_scale to be a real number, got None"),
        ({"interpolation_scale": torch.ones(2)}, "expected interpolation_scale to be a real number"),
    ):
        with pytest.raises(TypeError, match=message):
            sinusoidal_2d_table(4, 4, 8, **kwargs)


def test_matches_real_diffusers():
    """The peer itself, when installed (not a dependency)."""
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    fn = embeddings.get_2d_sincos_pos_embed
    pt = "output_type" in inspect.signature(fn).parameters
    for h, w, dim, base_size, scale in CASES:
        if base_size is None:
            continue
        kwargs = {"output_type": "pt"} if pt else {}
        want = fn(dim, (h, w), base_size=base_size, interpolation_scale=scale, **kwargs)
        want = want if isinstance(want, torch.Tensor) else torch.from_numpy(want)
        got = sinusoidal_2d_table(h, w, dim, base_size=base_size, interpolation_scale=scale, dtype=torch.float64)
        torch.testing.assert_close(got, want.double(), atol=1e-12, rtol=0)
    want = fn(16, 4, cls_token=True, extra_tokens=2, base_size=4, **({"output_type": "pt"} if pt else {}))
    want = want if isinstance(want, torch.Tensor) else torch.from_numpy(want)
    got = sinusoidal_2d_table(4, 4, 16, base_size=4, num_prefix_tokens=2, dtype=torch.float64)
    torch.testing.assert_close(got, want.double(), atol=1e-12, rtol=0)
