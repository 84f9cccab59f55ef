"""add_position on random combinations of its options at once: sizes (odd, 1), layout
(batch_first or sequence-first), x dtype and table dtype, positions (none + offset, (S,),
(B, S) with repeats), dropout on or off, arbitrary strides of x (random storage order, a
strided last dimension, a storage offset) and of the table. Forward against the float64
reference; backward (x and table gradients) against the reference sums, with the dropout
mask read off the op's own output. The focused tests vary one option at a time; this sweep
looks for the combinations they do not name."""

import random

import pytest
import torch

from conftest import DEVICES, reference_add, strided_random as strided
from dropout_reference import dropout_scale
from posenc.functional import add_position

F64 = torch.float64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(48))
def test_random_configuration(device, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, S, d = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 7, 33]), rng.choice([1, 3, 8, 17, 64, 130])
    max_len = S + rng.randint(0, 40)
    dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16])
    table_dtype = rng.choice([dtype, torch.float32])
    batch_first = rng.random() < 0.5
    p = rng.choice([0.0, 0.3, 0.7])
    x_shape = (B, S, d) if batch_first else (S, B, d)
    # x + table >= 0.05 everywhere, so a zero output can only be a dropped element.
    x = strided(rng, x_shape, dtype, device, 0.3, 2.0)
    table = strided(rng, rng.choice([(max_len, d), (1, max_len, d)]), table_dtype, device, -0.25, 0.25)
    kind = rng.choice(["offset", "seq", "batch_seq"])
    positions, offset = None, 0
    if kind == "offset":
        offset = rng.randint(0, max_len - S)
    else:
        shape = (S,) if kind == "seq" else (B, S)
        positions = torch.randint(0, max_len, shape).to(device)
        if positions.numel() > 1:
            positions.view(-1)[-1] = positions.view(-1)[0]  # a repeated row

    xg = x.detach().requires_grad_()
    tg = table.detach().requires_grad_()
    out = add_position(xg, tg, positions=positions, offset=offset, batch_first=batch_first, p=p)
    assert out.dtype == dtype and out.shape == x.shape

    summed = reference_add(x.cpu(), table.cpu(), None if positions is None else positions.cpu(),
                           offset, batch_first, rounded=False)
    if p == 0.0:
        factor = torch.ones(x.shape, dtype=summed.dtype)
        torch.testing.assert_close(out.detach().cpu(), summed.to(dtype), atol=0, rtol=0)
    else:
        # Dropped entries are exact zeros; kept ones are (x + t) * 1/(1-p), rounded once.
        kept = out.detach().cpu() != 0
        scale = dropout_scale(p, summed.dtype)
        torch.testing.assert_close(out.detach().cpu()[kept], (summed * scale).to(dtype)[kept], atol=0, rtol=0)
        frac = 1 - kept.double().mean().item()
        assert out.numel() < 200 or abs(frac - p) < 0.1
        factor = kept.to(summed.dtype) * scale

    # Backward: grad_x = g * mask * scale, grad_table[r] = sum of those over the rows reading r.
    g = strided(rng, x_shape, dtype, device)
    out.backward(g)
    gx = g.cpu().to(factor.dtype) * factor  # in the op's accumulation dtype, rounded once
    torch.testing.assert_close(xg.grad.cpu(), gx.to(dtype), atol=0, rtol=0)
    gx = gx.to(F64)
    bs = gx if batch_first else gx.transpose(0, 1)
    if positions is None:
        rows = torch.arange(offset, offset + S).expand(B, S)
    else:
        rows = positions.cpu().expand(B, S)
    want = torch.zeros(max_len, d, dtype=F64).index_add_(0, rows.reshape(-1), bs.reshape(-1, d))
    got = tg.grad.cpu().to(F64).reshape(max_len, d)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[table_dtype]
    torch.testing.assert_close(got, want.to(table_dtype).to(F64), atol=tol * (1 + B), rtol=tol)
    assert tg.grad.shape == table.shape and tg.grad.dtype == table_dtype
