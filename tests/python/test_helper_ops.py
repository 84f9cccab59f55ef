"""The helpers (make_positions, sinusoidal_2d_table, resample_position_table,
timestep_embedding) and the add-position modules' range check are ops, defined once in C++:
the Python functions only normalise types and call torch.ops.posenc.*, and the C++
functions call the same ops (tests/cpp/test_learned.cpp, Helpers.CppFunctionsCallTheOps),
so both languages give the same bits. The ops check the values, with the messages the
Python functions raised before."""

import math
import random
import re

import numpy as np
import pytest
import torch

import posenc
from posenc.functional import make_positions, resample_position_table, sinusoidal_2d_table, timestep_embedding

from conftest import DEVICES

ops = torch.ops.posenc


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


@pytest.mark.parametrize("h,w,dim,prefix,base,dtype", [
    (1, 1, 4, 0, 10000.0, torch.float32), (3, 5, 8, 0, 10000.0, torch.float64),
    (4, 4, 16, 1, 100.0, torch.float32), (14, 14, 768, 1, 10000.0, torch.float64),
    (7, 3, 192, 4, 2.5, torch.bfloat16), (16, 16, 1024, 1, 1e6, torch.float16),
])
def test_sinusoidal_2d_table_python_is_the_op(h, w, dim, prefix, base, dtype):
    got = sinusoidal_2d_table(h, w, dim, base=base, num_prefix_tokens=prefix, dtype=dtype)
    assert bits_equal(got, ops.sinusoidal_2d_table(h, w, dim, base, prefix, dtype))
    # numpy ints and the default dtype (float32) take the same path.
    got32 = sinusoidal_2d_table(np.int64(h), np.int32(w), dim, base=np.float64(base), num_prefix_tokens=prefix)
    assert bits_equal(got32, ops.sinusoidal_2d_table(h, w, dim, base, prefix))
    assert got32.dtype == torch.float32


def mae_frequencies(dim, base):
    """MAE's 1-D frequencies for a (dim)-wide half, in numpy float64."""
    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    return 1.0 / base**omega


@pytest.mark.parametrize("dim,base", [(16, 10000.0), (768, 10000.0), (1024, 100.0), (384, 1e6)])
def test_sinusoidal_2d_table_frequencies_are_mae_formula(dim, base):
    """The frequencies are MAE's: a 1 x 2 grid holds sin(omega) at w = 1, which gives omega
    back to an ulp or two. Of the two float64 forms the op could use, 1 / base**(i / (dim/4))
    (MAE's, chosen) agrees with MAE's numpy frequencies bit for bit far more often than
    base**(-i / (dim/4)), which differs in the last bit for about a third of them."""
    table = sinusoidal_2d_table(1, 2, dim, base=base, dtype=torch.float64)
    quarter = dim // 4
    omega_from_table = torch.asin(table[1, :quarter])  # omega <= 1 < pi/2: asin inverts sin
    want = mae_frequencies(dim // 2, base)
    torch.testing.assert_close(omega_from_table, torch.from_numpy(want), atol=0, rtol=1e-15)
    exponent = torch.arange(quarter, dtype=torch.float64) / (dim / 4.0)
    chosen = (1.0 / base**exponent).numpy() == want
    other = torch.pow(base, -exponent).numpy() == want
    assert chosen.sum() >= other.sum() and (quarter <= 4 or chosen.mean() > other.mean() + 0.1)


def per_cell_2d_table(h, w, dim, base, prefix, dtype, base_size, interpolation_scale):
    """Every cell evaluated on its own, in plain PyTorch from the formula: the coordinates of
    get_2d_sincos_pos_embed (diffusers' float32 rescaling when asked), the angle of each cell
    and frequency in float64, [sin w | cos w | sin h | cos h], zero prefix rows, rounded once."""
    def coords(n):
        if base_size is None and interpolation_scale == 1.0:
            return torch.arange(n, dtype=torch.float64)
        c = torch.arange(n, dtype=torch.float32)
        if base_size is not None:
            c = c / (n / base_size)
        if interpolation_scale != 1.0:
            c = c / interpolation_scale
        return c.double()

    omega = 1.0 / torch.pow(base, torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    hh, ww = torch.meshgrid(coords(h), coords(w), indexing="ij")
    aw, ah = ww.reshape(-1, 1) * omega, hh.reshape(-1, 1) * omega
    cells = torch.cat((aw.sin(), aw.cos(), ah.sin(), ah.cos()), dim=1)
    return torch.cat((torch.zeros(prefix, dim, dtype=torch.float64), cells)).to(dtype)


@pytest.mark.parametrize("h,w,dim,prefix,base,base_size,scale", [
    (64, 64, 512, 0, 10000.0, None, 1.0), (37, 53, 772, 1, 10000.0, None, 1.0),
    (1, 9, 12, 3, 100.0, 16, 1.0), (7, 1, 1024, 0, 1e6, None, 2.0), (32, 48, 1152, 1, 10000.0, 32, 1.5),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_sinusoidal_2d_table_bits_are_the_per_cell_formula(h, w, dim, prefix, base, base_size, scale, dtype):
    """The op evaluates sin/cos once per distinct coordinate (grid_h + grid_w rows) and lays
    the two axis tables out over the grid: its bits are those of evaluating every cell (an
    entry depends on its angle alone), at any thread count."""
    want = per_cell_2d_table(h, w, dim, base, prefix, dtype, base_size, scale)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            got = sinusoidal_2d_table(h, w, dim, base=base, num_prefix_tokens=prefix, dtype=dtype,
                                      base_size=base_size, interpolation_scale=scale)
            assert bits_equal(got, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_sinusoidal_2d_table_on_a_device(device):
    got = sinusoidal_2d_table(3, 4, 16, num_prefix_tokens=1, device=device)
    assert got.device.type == device and got.shape == (13, 16) and got.dtype == torch.float32
    if device != "meta":
        # Built on the host: the same bits on every device.
        assert torch.equal(got.cpu(), sinusoidal_2d_table(3, 4, 16, num_prefix_tokens=1))


@pytest.mark.parametrize("device", DEVICES)
def test_make_positions_python_is_the_op(device):
    torch.manual_seed(0)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        tokens = torch.randint(0, 3, (4, 9), device=device).to(dtype)
        for padding_idx in (0, 1, 2, -5, 2**62):
            for offset in (0, 4):
                assert bits_equal(make_positions(tokens, padding_idx, offset=offset),
                                  ops.make_positions(tokens, padding_idx, offset))
    assert make_positions(tokens, np.int64(1)).dtype == torch.int64
    meta = make_positions(torch.empty(2, 5, dtype=torch.long, device="meta"), 1)
    assert meta.shape == (2, 5) and meta.device.type == "meta"


@pytest.mark.parametrize("old,new,prefix,mode,antialias,dtype", [
    ((8, 8), (12, 12), 1, "bicubic", True, torch.float32), ((12, 12), (5, 7), 2, "bilinear", False, torch.bfloat16),
    ((7, 5), (3, 9), 0, "nearest", True, torch.float64), ((4, 4), (4, 4), 1, "bicubic", True, torch.float32),
])
def test_resample_position_table_python_is_the_op(old, new, prefix, mode, antialias, dtype):
    torch.manual_seed(1)
    pe = torch.randn(1, prefix + old[0] * old[1], 16).to(dtype)
    got = resample_position_table(pe, new, old_grid=old, num_prefix_tokens=prefix, mode=mode, antialias=antialias)
    assert bits_equal(got, ops.resample_position_table(pe, list(new), list(old), prefix, mode, antialias))
    # The grid forms a caller may pass: tuple, list, tensor, numpy array, numpy ints.
    for grid in (list(new), torch.tensor(new), np.array(new), tuple(np.int32(v) for v in new)):
        assert bits_equal(resample_position_table(pe, grid, old_grid=old, num_prefix_tokens=prefix, mode=mode,
                                                  antialias=antialias), got)
    # Equal grids: a copy, equal to pe (the op's result never aliases its input).
    same = resample_position_table(pe, old, old_grid=old, num_prefix_tokens=prefix)
    assert torch.equal(same, pe) and same.data_ptr() != pe.data_ptr()


def test_resample_position_table_int_grid_and_gradient():
    torch.manual_seed(2)
    pe = torch.randn(1, 1 + 36, 8, requires_grad=True)
    out = resample_position_table(pe, 4)  # an int n is (n, n); old grid (6, 6) from the table
    assert out.shape == (1, 17, 8)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, pe, g)
    ref_pe = pe.detach().clone().requires_grad_(True)
    image = ref_pe[:, 1:].reshape(1, 6, 6, 8).permute(0, 3, 1, 2)
    ref = torch.nn.functional.interpolate(image, size=(4, 4), mode="bicubic", antialias=True)
    ref = torch.cat([ref_pe[:, :1], ref.permute(0, 2, 3, 1).reshape(1, 16, 8)], dim=1)
    (want,) = torch.autograd.grad(ref, ref_pe, g)
    assert torch.equal(grad, want)
    meta = resample_position_table(torch.empty(1, 17, 8, device="meta"), (6, 3))
    assert meta.shape == (1, 19, 8) and meta.device.type == "meta"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [1, 4, 9, 320])
def test_timestep_embedding_python_is_the_op(device, dim):
    t = torch.rand(11, device=device) * 1000
    for flip, shift, scale, period in ((False, 1.0, 1.0, 10000.0), (True, 0.0, 1000.0, 500.0)):
        got = timestep_embedding(t, dim, max_period=period, flip_sin_to_cos=flip, downscale_freq_shift=shift,
                                 scale=scale)
        assert bits_equal(got, ops.timestep_embedding(t, dim, period, flip, shift, scale))
    got = timestep_embedding(t, dim, downscale_freq_shift=0)
    assert bits_equal(got, ops.timestep_embedding(t, dim, 10000.0, False, 0.0))
    # Integer timesteps (diffusers' usual int64 t) are converted to float32 first.
    ti = torch.arange(7, device=device) * 100
    got = timestep_embedding(ti, dim, downscale_freq_shift=0)
    assert bits_equal(got, ops.timestep_embedding(ti, dim, downscale_freq_shift=0.0))


def test_timestep_embedding_gradient_meta_and_compile():
    t = torch.rand(5, requires_grad=True) * 100
    t.retain_grad()
    emb = timestep_embedding(t, 8, downscale_freq_shift=0)
    emb.sum().backward()
    half = torch.exp(-math.log(10000.0) * torch.arange(4, dtype=torch.float32) / 4)
    want = (half * (torch.cos(t.detach()[:, None] * half) - torch.sin(t.detach()[:, None] * half))).sum(1)
    torch.testing.assert_close(t.grad, want, atol=1e-4, rtol=1e-4)
    meta = timestep_embedding(torch.empty(3, device="meta"), 9)
    assert meta.shape == (3, 9) and meta.device.type == "meta"

    def f(t, tokens, pe):
        return (timestep_embedding(t, 16, flip_sin_to_cos=True, downscale_freq_shift=0), make_positions(tokens, 1),
                resample_position_table(pe, (3, 3)), sinusoidal_2d_table(2, 2, 8, num_prefix_tokens=1))

    args = (torch.rand(4) * 100, torch.randint(0, 3, (2, 5)), torch.randn(1, 17, 8))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), f(*args)):
        assert bits_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_helper_ops(device):
    """Schema (no aliasing: equal grids return a copy), autograd registration, fake tensors
    and AOT dispatch with dynamic shapes, for each helper op."""
    cases = [
        (ops.make_positions.default, (torch.randint(0, 3, (2, 5), device=device), 1)),
        (ops.make_positions.default, (torch.randint(0, 3, (2, 5), device=device), 1, 6)),
        (ops.sinusoidal_2d_table.default, (3, 4, 16, 100.0, 1, torch.float64, torch.device(device))),
        (ops.resample_position_table.default, (torch.randn(1, 17, 8, device=device, requires_grad=True), [3, 5])),
        (ops.resample_position_table.default, (torch.randn(1, 17, 8, device=device, requires_grad=True), [4, 4])),
        (ops.resample_position_table.default,
         (torch.randn(1, 18, 8, dtype=torch.float64, device=device, requires_grad=True), [6, 6], [4, 4], 2, "nearest")),
        (ops.timestep_embedding.default,
         (torch.rand(5, device=device, requires_grad=True), 9, 10000.0, True, 0.0, 2.0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# Value checks live in the ops: the raw op raises what the Python function raises.
@pytest.mark.parametrize("python_call, op_call, error, message", [
    (lambda: make_positions(torch.rand(2, 3), 1), lambda: ops.make_positions(torch.rand(2, 3), 1), TypeError,
     r"make_positions: expected integer tokens of shape \(batch, seq\), got torch.float32 tokens of shape \(2, 3\)"),
    (lambda: make_positions(torch.ones(3, dtype=torch.long), 1), lambda: ops.make_positions(torch.ones(3, dtype=torch.long), 1),
     ValueError, r"make_positions: expected integer tokens of shape \(batch, seq\), got torch.int64 tokens of shape \(3,\)"),
    (lambda: make_positions(torch.ones(2, 3, dtype=torch.long), 2**63 - 1),
     lambda: ops.make_positions(torch.ones(2, 3, dtype=torch.long), 2**63 - 1), ValueError,
     r"padding_idx within \+-2\*\*62, got 9223372036854775807"),
    (lambda: sinusoidal_2d_table(0, 4, 8), lambda: ops.sinusoidal_2d_table(0, 4, 8), ValueError,
     "sinusoidal_2d_table: expected grid_h to be a positive integer, got 0"),
    (lambda: sinusoidal_2d_table(4, 4, 10), lambda: ops.sinusoidal_2d_table(4, 4, 10), ValueError,
     "expected dim to be a multiple of 4, got 10"),
    (lambda: sinusoidal_2d_table(2, 2, 8, base=1), lambda: ops.sinusoidal_2d_table(2, 2, 8, 1.0), ValueError,
     "expected base to be a finite number > 1, got 1.0"),
    (lambda: sinusoidal_2d_table(2, 2, 8, dtype=torch.int64),
     lambda: ops.sinusoidal_2d_table(2, 2, 8, dtype=torch.int64),
     TypeError, "sinusoidal_2d_table: expected dtype to be float16, bfloat16, float32 or float64, got torch.int64"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), (0, 3)),
     lambda: ops.resample_position_table(torch.randn(1, 17, 8), [0, 3]), ValueError,
     r"expected new_grid to be positive, got \(0, 3\)"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), (6, 6), old_grid=(4, 5)),
     lambda: ops.resample_position_table(torch.randn(1, 17, 8), [6, 6], [4, 5]), ValueError,
     r"old_grid \(4, 5\) has 20 cells but the table has 16 patch rows after 1 prefix tokens"),
    (lambda: resample_position_table(torch.randn(1, 17, 8), 6, mode="bogus"),
     lambda: ops.resample_position_table(torch.randn(1, 17, 8), [6, 6], mode="bogus"), ValueError,
     "expected mode bicubic, bilinear or nearest, got 'bogus'"),
    (lambda: resample_position_table(torch.randn(17, 8), 6),
     lambda: ops.resample_position_table(torch.randn(17, 8), [6, 6]),
     ValueError, r"expected pe of shape \(1, tokens, dim\), got \(17, 8\)"),
    (lambda: resample_position_table(torch.randn(1, 19, 8), 6),
     lambda: ops.resample_position_table(torch.randn(1, 19, 8), [6, 6]),
     ValueError, r"18 patch rows \(after 1 prefix tokens\) are not a square grid"),
    (lambda: timestep_embedding(torch.rand(2, 2), 8), lambda: ops.timestep_embedding(torch.rand(2, 2), 8), ValueError,
     r"timestep_embedding: expected t to be a 1-D tensor of timesteps, got \(2, 2\)"),
    (lambda: timestep_embedding(torch.rand(2), -2), lambda: ops.timestep_embedding(torch.rand(2), -2), ValueError,
     "expected dim to be a positive int, got -2"),
    (lambda: timestep_embedding(torch.rand(2), 8, max_period=0.0),
     lambda: ops.timestep_embedding(torch.rand(2), 8, 0.0),
     ValueError, "expected max_period to be a finite number > 0, got 0.0"),
    (lambda: timestep_embedding(torch.rand(2), 3), lambda: ops.timestep_embedding(torch.rand(2), 3), ValueError,
     r"half of dim \(1\) minus downscale_freq_shift \(1.0\) must not be zero"),
    (lambda: timestep_embedding(torch.rand(2, dtype=torch.complex64), 8),
     lambda: ops.timestep_embedding(torch.rand(2, dtype=torch.complex64), 8), TypeError,
     "expected real timesteps, got torch.complex64"),
])
def test_value_checks_live_in_the_ops(python_call, op_call, error, message):
    with pytest.raises(error, match=message) as from_python:
        python_call()
    with pytest.raises(error, match=message) as from_op:
        op_call()
    assert str(from_python.value) == str(from_op.value)


def test_python_only_normalises_types():
    """What the op cannot represent is refused in Python, naming the argument: a value past
    int64 is a ValueError, an argument of another type (a float for an int, a str or None for
    a number, a non-tensor where a tensor goes) a TypeError."""
    with pytest.raises(ValueError, match="padding_idx to fit in int64"):
        make_positions(torch.ones(2, 3, dtype=torch.long), 2**70)
    for call, message in (
        (lambda: sinusoidal_2d_table(2.0, 2, 8), "grid_h to be an int, got 2.0"),
        (lambda: sinusoidal_2d_table(2, 2, 8, base="big"), "base to be a real number, got 'big'"),
        (lambda: timestep_embedding(torch.rand(2), 8, scale=None), "scale to be a real number, got None"),
        (lambda: resample_position_table(torch.randn(1, 17, 8), (4.0, 4)), r"new_grid to be \(h, w\) of ints"),
    ):
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(TypeError, match="make_positions: expected tokens to be a Tensor, got list"):
        make_positions([[1, 2]], 0)
    with pytest.raises(TypeError, match="timestep_embedding: expected t to be a Tensor, got list"):
        timestep_embedding([1.0], 8)
    with pytest.raises(TypeError, match="resample_position_table: expected pe to be a Tensor"):
        resample_position_table(np.zeros((1, 17, 8)), 4)


def test_op_messages_write_floats_as_python_repr():
    """The ops write a float the way repr() does, so a message reads the same from Python."""
    rng = random.Random(0)
    values = [0.0, -0.0, 1.0, 1e-4, 1e-5, 1e15, 1e16, 1.5e-7, 123.456, -2.5, 5e-324, 1.7976931348623157e308,
              12345678901234567.0, 0.1 + 0.2, 1 / 3]
    values += [rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30) for _ in range(200)]
    for v in values:
        bad = -abs(v)  # max_period <= 0 is refused, naming the value
        with pytest.raises(ValueError) as info:
            ops.timestep_embedding(torch.zeros(1), 8, bad)
        assert str(info.value).endswith(f"got {bad!r}"), (v, str(info.value))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_position_bounds_one_read_back(dtype):
    pos = torch.tensor([[3, 0, 7], [2, 9, 1]]).to(dtype)
    assert ops.position_bounds(pos) == (0, 9)
    assert ops.position_bounds(pos, 10) == (0, 9)
    assert ops.position_bounds(torch.empty(0, dtype=dtype), 0) == (0, -1)
    with pytest.raises(IndexError, match=re.escape("posenc: expected positions in [0, max_len=9), found 9 "
                                                   "(positions range from 0 to 9)")):
        ops.position_bounds(pos, 9)
    if dtype != torch.uint8:
        with pytest.raises(IndexError, match=r"max_len=10\), found -4 \(positions range from -4 to 9\)"):
            ops.position_bounds(torch.cat([pos.flatten(), torch.tensor([-4], dtype=dtype)]), 10)
    with pytest.raises(TypeError, match="position_bounds: expected integer positions, got torch.float32"):
        ops.position_bounds(pos.float(), 10)


@pytest.mark.parametrize("module_cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_module_range_check_uses_the_bounds_op(module_cls, monkeypatch):
    """The modules check CUDA int64 positions through position_bounds, with its message;
    CPU positions are left to the kernel (same message start: one message)."""
    m = module_cls(8, 0.0, 16)
    x = torch.randn(2, 5, 8)
    message = "posenc: expected positions in [0, max_len=16), found 16 at flat index 2"
    with pytest.raises(IndexError, match=re.escape(message)):
        m(x, positions=torch.tensor([0, 1, 16, 3, 4]))
    calls = []
    monkeypatch.setattr(torch.ops.posenc, "position_bounds",
                        lambda *a: calls.append(a) or (0, 0), raising=False)
    m(x, positions=torch.tensor([0, 1, 2, 3, 4]))
    assert calls == []  # CPU positions: no bounds read-back


@pytest.mark.cuda
@pytest.mark.parametrize("module_cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_module_range_check_of_cuda_positions_uses_the_bounds_op(module_cls):
    """CUDA positions: the module reads their bounds through position_bounds (one sync), so
    the message gives the range instead of the flat index."""
    m = module_cls(8, 0.0, 16).cuda()
    x = torch.randn(2, 5, 8, device="cuda")
    with pytest.raises(IndexError, match=re.escape("posenc: expected positions in [0, max_len=16), found 16 "
                                                   "(positions range from 0 to 16)")):
        m(x, positions=torch.tensor([0, 1, 16, 3, 4], device="cuda"))
    with pytest.raises(IndexError, match=re.escape("found -1 (positions range from -1 to 4)")):
        m(x, positions=torch.tensor([[0, 1, 2, 3, 4], [0, -1, 2, 3, 4]], device="cuda"))
    with pytest.raises(TypeError, match=r"positions to have dtype torch.int64"):
        m(x, positions=torch.arange(5.0, device="cuda"))


def test_make_positions_refuses_positions_past_int64():
    # padding_idx + offset + seq must stay an int64 (2**62 + 2**62 wrapped to negative positions).
    tokens = torch.tensor([[1, 5, 6]])
    with pytest.raises(ValueError, match=r"the last position, padding_idx \+ offset \+ seq, to fit in int64"):
        make_positions(tokens, 2**62, offset=2**62)
    last = 2**63 - 1
    assert make_positions(tokens, 2**62, offset=last - 2**62 - 3).max().item() == last  # the largest that fits
    with pytest.raises(ValueError, match="to fit in int64"):
        make_positions(tokens, 2**62, offset=last - 2**62 - 2)


def test_make_positions_compiled_with_a_dynamic_offset_checks_as_eager():
    """make_positions' offset is a SymInt (a graph per value before): its checks under
    torch.compile accept what eager accepts (a symbolic offset got the conservative bound
    padding_idx + offset <= 2**62: padding_idx 2**62 was refused from the dynamic graph on,
    a review) and refuse with the value (they said 'got s6')."""
    tokens = torch.tensor([[1, 5, 0, 7]])

    def step(offset):
        return posenc.functional.make_positions(tokens, 2**62, offset=offset)

    compiled = torch.compile(step, backend="eager")
    for offset in (3, 5, 7):
        torch.testing.assert_close(compiled(offset), step(offset), rtol=0, atol=0)
    with pytest.raises(Exception, match=r"expected offset in \[0, 2\*\*62\], got -1"):
        compiled(-1)
