"""The CPU backward kernels' dropout mask, bit for bit, against Philox4x32-10 written out in
NumPy (dropout_reference.py, from posenc/math/philox.h).

The float32 backward of the AVX2 build, on CPUs without AVX-512, applies the mask straight
from the Philox registers in groups of 64 elements (8 blocks) and leaves row heads that do
not start a block, and the tails, to the general path (bits, then factors, then the
multiply); CPUs with AVX-512 draw the bits 16 blocks at a time and take the general path
for everything. The shapes below give whole groups, heads and tails, at every place in a
row and a 1024-element chunk, and the other dtypes run the general path only.
"""
import pytest
import torch

from dropout_reference import expected_masked, keep_mask

# (shape, seed, offset): rows of 512 (whole groups), of 40 and 37 (rows that start inside a
# block and groups cut by the 1024-element chunks), one long row with a tail of 5.
CASES = [
    ((2, 64, 512), 0x1234_5678_9ABC_DEF0, 0),
    ((3, 37, 40), -0x0F0E_0D0C_0B0A_0908, 8),
    ((4, 29, 37), 77, 4 * 0x1_0000_0003),
    ((1, 3, 4101), 2**63 - 1, 12),
]


@pytest.mark.parametrize("shape,seed,offset", CASES)
@pytest.mark.parametrize("p", [0.1, 0.5, 2.0**-17, 1.0 - 2.0**-18])
def test_x_gradient_is_the_philox_mask(shape, seed, offset, p):
    grad = torch.randn(shape)
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    got = torch.ops.posenc.add_position_backward(grad, rng, p)
    want = expected_masked(grad, keep_mask(seed, offset, shape, p), p)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_x_gradient_is_the_philox_mask_in_other_dtypes(dtype):
    shape, seed, offset = CASES[0]
    grad = torch.randn(shape).to(dtype)
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    got = torch.ops.posenc.add_position_backward(grad, rng, 0.3)
    assert torch.equal(got, expected_masked(grad, keep_mask(seed, offset, shape, 0.3), 0.3))


def test_nan_and_negative_gradients_keep_their_product_with_zero():
    """Dropped elements are grad * 0 as before (NaN stays NaN, -1 gives -0), not a bare 0."""
    grad = torch.randn(2, 16, 512)
    grad[0, 0, :256] = float("nan")
    rng = torch.tensor([99, 0], dtype=torch.int64)
    got = torch.ops.posenc.add_position_backward(grad, rng, 0.5)
    want = expected_masked(grad, keep_mask(99, 0, grad.shape, 0.5), 0.5)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("shape,seed,offset", CASES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", ["none", "seq", "batch_seq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_table_backward_is_the_philox_mask(shape, seed, offset, batch_first, positions, dtype):
    grad = torch.randn(shape, dtype=dtype)
    B, S = (shape[0], shape[1]) if batch_first else (shape[1], shape[0])
    table_len = S + 3
    pos = {"none": None, "seq": torch.randint(0, table_len, (S,)),
           "batch_seq": torch.randint(0, table_len, (B, S))}[positions]
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    p = 0.2
    gx, gt = torch.ops.posenc.add_position_backward_with_table(
        grad, rng, pos, 2 if pos is None else 0, batch_first, p, table_len, True)
    masked = expected_masked(grad, keep_mask(seed, offset, shape, p), p)
    assert torch.equal(gx, masked)
    # The table gradient: the masked rows summed per position (the kernel's order differs
    # from torch's, so compared in float64 with a tolerance).
    bs = masked.double() if batch_first else masked.double().transpose(0, 1)
    rows = (torch.arange(S) + 2).expand(B, S) if pos is None else pos.expand(B, S)
    want = torch.zeros(table_len, shape[2], dtype=torch.float64).index_add_(
        0, rows.reshape(-1), bs.reshape(B * S, -1))
    assert gt.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]  # sums of up to 128 rows in dtype
    torch.testing.assert_close(gt.double(), want, rtol=tol, atol=tol)
    _, gt_only = torch.ops.posenc.add_position_backward_with_table(
        grad, rng, pos, 2 if pos is None else 0, batch_first, p, table_len, False)
    assert torch.equal(gt_only, gt)
