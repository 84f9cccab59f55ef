
import math

import pytest
import torch

import posenc
from posenc.functional import sinusoidal_table, timestep_embedding
from conftest import DEVICES, DTYPES, ClassicPositionalEncoding, reference_table
from timestep_reference import diffusers_float32, diffusers_float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 2, 3, 8, 31, 64, 513])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (0,), (4, 1, 3)])
def test_matches_float64_reference_integer_positions(device, d, shape):
    pos = torch.randint(0, 9000, shape, device=device)
    got = sinusoidal_table(pos, d, dtype=torch.float64)
    assert got.shape == (*shape, d) and got.dtype == torch.float64 and got.device.type == device
    torch.testing.assert_close(got, reference_table(pos, d), atol=1e-11, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_float_positions_and_rounding_once(device, dtype):
    pos = torch.rand(7, 3, dtype=torch.float64, device=device) * 1000 - 200
    got = sinusoidal_table(pos, 10, base=777.0, dtype=dtype)
    want = reference_table(pos, 10, base=777.0)
    assert got.dtype == dtype
    # Rounded once from an accurate value: within half an ulp of the dtype (plus slack).
    eps = torch.finfo(dtype).eps
    assert (got.double() - want).abs().max().item() <= eps * 0.5 + 1e-11


# Tables of float32 and narrower are the float64 table rounded once (through float32, as
# ATen's cast rounds), bit for bit. The CPU kernel makes them from a product recurrence along
# integer progressions of positions, checks each value against its error bound and asks libm
# where a value lies within it of a rounding boundary (~3 values in 10^4 of the modules'
# tables, more at huge positions): not one bit may move. Other positions take libm per entry.
TABLE_CASES = {
    "arange_16384_d512": (lambda: torch.arange(16384), 512),  # a module's table; runs of 1024 rows
    "step7_odd_d": (lambda: torch.arange(3, 3000, 7), 33),  # a last sine column, pairs past whole octets
    "descending": (lambda: torch.arange(100000, 90000, -3), 64),
    "negative_to_positive": (lambda: torch.arange(-500, 700), 7),
    "huge_offset": (lambda: torch.arange(2**30, 2**30 + 300), 16),  # most values near a boundary
    # 8 MiB or more (16 MiB in float32): streamed 16 pairs at a time (AVX-512), many values
    # patched by libm after the sweep streamed their lines
    "huge_offset_streamed": (lambda: torch.arange(2**30, 2**30 + 8192), 512),
    "past_2_40": (lambda: torch.arange(2**40 - 5, 2**40 + 600), 24),  # libm per entry
    "half_integers": (lambda: torch.arange(1000, dtype=torch.float64) + 0.5, 10),
    "permuted": (lambda: torch.randperm(3000, generator=torch.Generator().manual_seed(3)), 40),
    "two_rows": (lambda: torch.arange(2), 5),
    "one_row": (lambda: torch.tensor([7]), 3),
    "matrix": (lambda: torch.arange(700, dtype=torch.int32).view(25, 28), 48),
    "float32_positions": (lambda: torch.arange(5000, dtype=torch.float32), 20),
    # other bases: frequencies down to base**-1 (tiny values near 0 in the last columns)
    "base_500": (lambda: torch.arange(-2000, 6000, 5), 30, 500.0),
    "base_1e9_odd_d": (lambda: torch.arange(20000, 0, -2), 15, 1e9),
}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.parametrize("dtype", list(BITS), ids=str)
@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_narrow_tables_are_the_float64_table_rounded_bit_for_bit(case, dtype):
    make, d, *base = TABLE_CASES[case]
    base = base[0] if base else 10000.0
    pos = make()
    exact = sinusoidal_table(pos, d, base=base, dtype=torch.float64)
    # The float64 table itself against the formula (independent of posenc): the angles of both
    # differ by their roundings, a few ulps of the largest |position| times the frequency.
    pmax = pos.double().abs().max().item()
    torch.testing.assert_close(exact, reference_table(pos, d, base=base), atol=pmax * 2.0**-50 + 1e-13, rtol=0)
    want = exact.to(dtype)
    for threads in (1, 2):  # other runs per task: other anchors, the same bits
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = sinusoidal_table(pos, d, base=base, dtype=dtype)
        finally:
            torch.set_num_threads(before)
        assert got.dtype == dtype and got.shape == (*pos.shape, d)
        diff = (got.view(BITS[dtype]) != want.view(BITS[dtype])).sum().item()
        assert diff == 0, f"{diff} values differ at {threads} threads"


def test_buffer_error_bound_and_classic_distance():
    """The buffer is within 2**-25 of exact at max_len 5000; the classic float32 one is not."""
    pe = posenc.PositionalEncoding(512, 0.1, max_len=5000).pe
    exact = reference_table(torch.arange(5000), 512).unsqueeze(0)
    ours = (pe.double() - exact).abs().max().item()
    classic = (ClassicPositionalEncoding(512, 0.1).pe.double() - exact).abs().max().item()
    assert ours <= 2.0**-25 + 1e-12
    assert 1e-4 < classic < 1e-3  # the classic construction's float32 angle error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [1, 6, 7])
def test_gradient_wrt_float_positions(device, d):
    pos = (torch.rand(4, 3, dtype=torch.float64, device=device) * 50).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q: sinusoidal_table(q, d, base=100.0, dtype=torch.float64), (pos,))
    g = torch.randn(4, 3, d, dtype=torch.float64, device=device)
    (grad,) = torch.autograd.grad(sinusoidal_table(pos, d, base=100.0, dtype=torch.float64), pos, g)
    ref_pos = pos.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(reference_table(ref_pos, d, base=100.0), ref_pos, g)
    torch.testing.assert_close(grad, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("in_dim", [0, 1, -1])
def test_vmap_is_one_call_without_the_fallback(in_dim):
    """vmap over positions: the op's own rule (one call on every sample's positions, the
    batch dim where it was), the per-sample tables, without vmap's per-sample fallback (and
    its "batching rule not implemented" warning, a C++ one: the fallback is switched off
    here, so taking it raises); jacrev under vmap too."""
    from torch._C._functorch import _is_vmap_fallback_enabled, _set_vmap_fallback_enabled

    pos = torch.rand(3, 5, dtype=torch.float64) * 100
    table = lambda p: sinusoidal_table(p, 6, dtype=torch.float64)  # noqa: E731
    enabled = _is_vmap_fallback_enabled()
    _set_vmap_fallback_enabled(False)
    try:
        got = torch.func.vmap(table, in_dims=in_dim)(pos)
        jac = torch.func.vmap(torch.func.jacrev(table))(pos[0])
    finally:
        _set_vmap_fallback_enabled(enabled)
    want = torch.stack([table(p) for p in pos.unbind(in_dim)])
    assert torch.equal(got, want)
    torch.testing.assert_close(jac, torch.stack([torch.autograd.functional.jacobian(table, p) for p in pos[0]]))
    assert torch.func.vmap(table)(torch.empty(0, 4)).shape == (0, 4, 6)


def test_odd_d_model_ends_with_sine():
    pos = torch.arange(50)
    got = sinusoidal_table(pos, 7, dtype=torch.float64)
    torch.testing.assert_close(got[:, 6], torch.sin(pos.double() * 10000.0 ** (-6 / 7)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_bad_d_model(bad):
    with pytest.raises(ValueError, match=rf"sinusoidal_table: expected d_model > 0, got {bad}$"):
        sinusoidal_table(torch.arange(3), bad)


@pytest.mark.parametrize("bad", [0.0, -2.0, float("inf"), 1.0, 0.5])
def test_rejects_bad_base(bad):
    # Named by the function, the value as Python writes it (1.0, not 1).
    with pytest.raises(ValueError, match=rf"sinusoidal_table: expected base to be a finite number > 1, got {bad!r}$"):
        sinusoidal_table(torch.arange(3), 4, base=bad)


def test_rejects_bad_dtype_and_positions():
    with pytest.raises(TypeError, match="dtype"):
        sinusoidal_table(torch.arange(3), 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="positions"):
        sinusoidal_table(torch.ones(3, dtype=torch.bool), 4)
    # The op takes the dtype by name (an exported graph carries a str where torch 2.11's
    # AOTInductor misread a ScalarType).
    with pytest.raises(TypeError, match=r"expected dtype to be 'float64', 'float32', 'bfloat16' or 'float16', got 'int8'"):
        torch.ops.posenc.sinusoidal_table(torch.arange(3), 4, 10000.0, "int8")
    with pytest.raises(TypeError, match=r"got 'torch.float32'"):
        torch.ops.posenc.sinusoidal_table(torch.arange(3, device="meta"), 4, 10000.0, "torch.float32")


def test_the_op_and_its_front_ends_default_to_float32():
    # The op's schema said float64 while the function, the C++ API and the 2-D table's op
    # say float32: a call of the op without a dtype gave another table than the function's.
    positions = torch.arange(5)
    assert torch.ops.posenc.sinusoidal_table(positions, 8).dtype == torch.float32
    assert torch.equal(torch.ops.posenc.sinusoidal_table(positions, 8), sinusoidal_table(positions, 8))
    assert posenc.functional.sinusoidal_2d_table(3, 4, 8).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [4, 9, 320])
@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("shift,scale,period", [(1.0, 1.0, 10000.0), (0.0, 1000.0, 500.0)])
def test_timestep_embedding_matches_diffusers(device, dim, flip, shift, scale, period):
    t = torch.rand(13, device=device) * 1000
    got = timestep_embedding(t, dim, max_period=period, flip_sin_to_cos=flip,
                             downscale_freq_shift=shift, scale=scale)
    want = diffusers_float32(t, dim, flip, shift, scale, period)
    assert got.shape == (13, dim) and got.dtype == torch.float32 and got.device == t.device
    # Same float32 operations in the same order on the same device: bit for bit.
    assert torch.equal(got, want)
    if dim % 2 == 1:
        assert torch.equal(got[:, -1].cpu(), torch.zeros(13))
    # And close to the exact value (float32 angles are the only error source).
    half = dim // 2
    exact, ang = diffusers_float64(t, dim, flip, shift, scale, period)
    # float32 angles: error grows with the angle, a few ulps of its largest value.
    atol = 4 * ang.abs().max().item() * 2.0**-24 + 1e-6
    torch.testing.assert_close(got[:, : 2 * half].cpu().double(), exact[:, : 2 * half], atol=atol, rtol=0)


def test_timestep_embedding_rejects_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        timestep_embedding(torch.rand(2, 2), 8)
    with pytest.raises(ValueError, match="dim"):
        timestep_embedding(torch.rand(2), 0)
    # NaN/inf/non-positive settings gave NaN embeddings silently.
    for kwargs, msg in (
        (dict(max_period=float("nan")), "expected max_period to be a finite number > 0, got nan"),
        (dict(max_period=0.0), "expected max_period to be a finite number > 0, got 0.0"),
        (dict(downscale_freq_shift=float("inf")), "expected downscale_freq_shift to be a finite number, got inf"),
        (dict(scale=float("nan")), "expected scale to be a finite number, got nan"),
        # Finite settings past float32 (found by fuzzing: NaN columns).
        (dict(scale=1e308), r"expected scale to be a finite number in float32 \(the embedding's dtype\), got 1e\+308"),
        (dict(max_period=1e-308), r"max_period 1e-308 with dim 8 and downscale_freq_shift 1.0 gives frequencies up to "
                                  r"exp\(709.*\) \(inf in float32\); expected at most exp\(88\)"),
    ):
        with pytest.raises(ValueError, match=msg):
            timestep_embedding(torch.rand(2), 8, **kwargs)
    # A setting inside the bound gives finite embeddings (only float32 infinities are refused:
    # a frequency near exp(88) times a large t still overflows, as in diffusers).
    assert timestep_embedding(torch.rand(2), 8, max_period=math.exp(-88.0 * 3 / 4)).isfinite().all()



@pytest.mark.parametrize("bad, error", [(2.5, TypeError), (True, TypeError), (False, TypeError), ("8", TypeError),
                                        (-2, ValueError)])
def test_timestep_embedding_rejects_non_integer_dim(bad, error):
    with pytest.raises(error, match=rf"expected dim to be a positive int, got {bad!r}"):
        timestep_embedding(torch.rand(3) * 100, bad)


@pytest.mark.parametrize("dim", [2, 3])
def test_timestep_embedding_zero_denominator_raises(dim):
    """dim // 2 == downscale_freq_shift divides 0 by 0 in diffusers, which returns NaN
    columns; posenc raises ValueError instead (documented difference)."""
    t = torch.rand(4) * 100 + 1
    assert torch.isnan(diffusers_float32(t, dim)).any()  # what diffusers would return
    with pytest.raises(ValueError, match=r"half of dim \(1\) minus downscale_freq_shift \(1.0\) must not be zero"):
        timestep_embedding(t, dim)
    # Another shift makes the same dim well defined, and equal to diffusers.
    got = timestep_embedding(t, dim, downscale_freq_shift=0.0)
    assert torch.equal(got, diffusers_float32(t, dim, downscale_freq_shift=0.0))
    assert not torch.isnan(got).any()
