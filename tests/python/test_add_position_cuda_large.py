"""CUDA tensors of more than 2^31 elements: the add_position kernels switch to 64-bit
indices there (numel + one grid's reach past int32), a path no smaller test reaches. About
20 GB of GPU memory, a few seconds on an H200; skipped without a GPU that large."""
import pytest
import torch

import posenc

BIG = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory >= 40 * 2**30


@pytest.mark.cuda
@pytest.mark.skipif(not BIG, reason="needs a CUDA GPU with 40 GB or more")
def test_add_position_beyond_int32_elements():
    B, S, d = 1025, 2048, 1024  # 2^31 + 2^21 elements of bfloat16: 4.3 GB per tensor
    assert B * S * d > 2**31
    torch.manual_seed(0)
    x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16)
    pe = posenc.PositionalEncoding(d, 0.25, max_len=S).cuda()
    table = pe.pe[0]  # float32 (S, d)

    def reference(rows, scale=1.0):
        return ((x[rows].float() + table) * scale).to(torch.bfloat16)

    with torch.no_grad():
        y = pe.eval()(x)
    # The first and the last batch rows (the last lies wholly beyond element 2^31): the sum
    # in float32, rounded once.
    for rows in (0, B - 1):
        assert torch.equal(y[rows], reference(rows))
    del y

    torch.manual_seed(1)
    xg = x.requires_grad_()
    y = pe.train()(xg)
    (gx,) = torch.autograd.grad(y, xg, torch.ones_like(y))
    scale = 1.0 / 0.75
    for rows in (0, B - 1):
        kept = gx[rows] != 0
        frac = 1.0 - kept.float().mean().item()
        sigma = (0.25 * 0.75 / kept.numel()) ** 0.5
        assert abs(frac - 0.25) < 4 * sigma, (rows, frac)
        # Survivors are scaled in float32 and rounded once; the dropped ones are zero; the
        # backward regenerated the forward's mask (gx is scale exactly where y was kept).
        want = reference(rows, scale)
        assert torch.equal(y[rows][kept], want[kept])
        assert (y[rows][~kept] == 0).all()
        assert (gx[rows][kept].float() == torch.tensor(scale).to(torch.bfloat16).float()).all()
    # Masks of the two ends are not one pattern repeated (an index that wrapped would repeat).
    assert not torch.equal(gx[0] != 0, gx[B - 1] != 0)
