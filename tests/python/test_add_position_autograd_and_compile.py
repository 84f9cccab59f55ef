"""Gradients (gradcheck), opcheck on every op, torch.compile(fullgraph=True), torch.export."""
import pytest
import torch
from torch.library import opcheck

import posenc
from posenc.functional import add_position
from conftest import DEVICES


def seeded(fn, seed=2024):
    """Re-seed before every call so gradcheck's repeated evaluations see one mask."""
    def wrapped(*args):
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
        return fn(*args)
    return wrapped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", [None, "1d", "2d_repeated"])
def test_gradcheck_x_and_table(device, p, batch_first, positions):
    x = torch.randn(3, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    table = torch.randn(1, 12, 6, dtype=torch.float64, device=device, requires_grad=True)
    B, S = (3, 5) if batch_first else (5, 3)
    pos = None
    if positions == "1d":
        pos = torch.tensor([4, 0, 11, 2, 7][:S], device=device)
    elif positions == "2d_repeated":
        pos = torch.randint(0, 3, (B, S), device=device)  # many repeats
    fn = seeded(lambda a, t: add_position(a, t, positions=pos, offset=0 if pos is not None else 3,
                                          batch_first=batch_first, p=p))
    assert torch.autograd.gradcheck(fn, (x, table))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("positions", [None, "1d", "2d_repeated"])
@pytest.mark.parametrize("table_grad", [True, False])
def test_gradgradcheck_x_and_table(device, p, batch_first, positions, table_grad):
    """Second derivatives (create_graph=True): the gradients are linear in the incoming
    gradient, with the same mask, so their derivative is exact and must not be dropped."""
    x = torch.randn(3, 5, 6, dtype=torch.float64, device=device, requires_grad=True)
    table = torch.randn(12, 6, dtype=torch.float64, device=device, requires_grad=table_grad)
    B, S = (3, 5) if batch_first else (5, 3)
    pos = None
    if positions == "1d":
        pos = torch.tensor([4, 0, 11, 2, 7][:S], device=device)
    elif positions == "2d_repeated":
        pos = torch.randint(0, 3, (B, S), device=device)
    fn = seeded(lambda a, t: add_position(a, t, positions=pos, offset=0 if pos is not None else 3,
                                          batch_first=batch_first, p=p))
    assert torch.autograd.gradgradcheck(fn, (x, table))


@pytest.mark.parametrize("device", DEVICES)
def test_second_derivative_through_the_module_matches_the_formula(device):
    """d/dg of <grad_x, v> + <grad_table, w> is (v + w[rows]) * mask * scale."""
    torch.manual_seed(0)
    lpe = posenc.LearnedPositionalEncoding(8, 0.5, max_len=16).double().to(device).train()
    x = torch.randn(2, 5, 8, dtype=torch.float64, device=device, requires_grad=True)
    g = (torch.rand(2, 5, 8, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    y = lpe(x, offset=4)
    gx, gt = torch.autograd.grad(y, (x, lpe.pe), g, create_graph=True)
    v = torch.randn_like(gx)
    w = torch.randn_like(gt)
    (dg,) = torch.autograd.grad((gx * v).sum() + (gt * w).sum(), g)
    factor = gx.detach() / g.detach()  # mask * scale: 0 or 2
    assert set(factor.unique().tolist()) <= {0.0, 2.0} and (factor == 0).any() and (factor == 2).any()
    want = (v + w[0, 4:9]) * factor
    torch.testing.assert_close(dg, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_table_gradient_matches_index_add_reference(device):
    x = torch.randn(4, 9, 5, device=device, requires_grad=True)
    table = torch.randn(10, 5, device=device, requires_grad=True)
    pos = torch.randint(0, 10, (4, 9), device=device)
    g = torch.randn(4, 9, 5, device=device)
    add_position(x, table, positions=pos).backward(g)
    want = torch.zeros(10, 5, device=device).index_add_(0, pos.reshape(-1), g.reshape(-1, 5))
    torch.testing.assert_close(table.grad, want)
    assert torch.equal(x.grad, g)


def opcheck_inputs(device):
    x = torch.randn(2, 7, 8, device=device, requires_grad=True)
    table = torch.randn(1, 16, 8, device=device)
    yield (x, table, None, 3, True, 0.0)
    yield (x.transpose(0, 1).detach(), table, torch.randint(0, 16, (7, 2), device=device).t(), 0, False, 0.0)
    yield (x.detach().double(), table.squeeze(0), torch.randint(0, 16, (7,), device=device), 0, True, 0.0)
    # With dropout: the ops carry the nondeterministic_seeded tag, so opcheck checks the
    # schema, fake tensors and autograd registration without comparing masks.
    yield (x, table, None, 1, True, 0.5)
    yield (x.detach().to(torch.bfloat16), table, torch.randint(0, 16, (2, 7), device=device), 0, True, 0.2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_add_position(device):
    for args in opcheck_inputs(device):
        opcheck(torch.ops.posenc.add_position.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_add_position_forward(device):
    for args in opcheck_inputs(device):
        opcheck(torch.ops.posenc.add_position_forward.default, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_add_position_backward_and_sinusoidal_table(device):
    grad = torch.randn(3, 5, 8, device=device)
    rng = torch.tensor([12345, 8], dtype=torch.int64, device=device)
    opcheck(torch.ops.posenc.add_position_backward.default, (grad, rng, 0.3))
    opcheck(torch.ops.posenc.sinusoidal_table.default, (torch.randint(0, 100, (4, 3), device=device), 10))
    opcheck(torch.ops.posenc.sinusoidal_table.default, (torch.rand(5, device=device), 7, 500.0))
    for dtype in ("float64", "bfloat16", "float16"):  # float32: the default, above
        opcheck(torch.ops.posenc.sinusoidal_table.default, (torch.arange(40, device=device), 10, 500.0, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_eval_equals_eager(device):
    torch._dynamo.reset()
    pe = posenc.PositionalEncoding(32, 0.1, 128).to(device).eval()
    compiled = torch.compile(pe, fullgraph=True, dynamic=True)
    for S, off in [(10, 0), (17, 5), (3, 100)]:
        x = torch.randn(2, S, 32, device=device)
        assert torch.equal(compiled(x, off), pe(x, off))
    pos = torch.randint(0, 128, (2, 9), device=device)
    x = torch.randn(2, 9, 32, device=device)
    assert torch.equal(compiled(x, 0, pos), pe(x, 0, pos))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_training_equals_eager_forward_and_backward(device):
    torch._dynamo.reset()
    pe = posenc.PositionalEncoding(32, 0.25, 128).to(device).train()

    def step(m, x):
        y = m(x) * 2.0
        y.sum().backward()
        return y

    compiled = torch.compile(pe, fullgraph=True)
    x1 = torch.randn(3, 20, 32, device=device, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    torch.manual_seed(7)
    y1 = step(pe, x1)
    torch.manual_seed(7)
    y2 = step(compiled, x2)
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    # Compiled calls still draw a fresh mask each time.
    a, b = compiled(x1.detach()), compiled(x1.detach())
    assert not torch.equal(a != 0, b != 0)


def test_export_eval_module():
    pe = posenc.PositionalEncoding(16, 0.1, 64).eval()
    x = torch.randn(2, 10, 16)
    seq = torch.export.Dim("seq", max=64)
    ep = torch.export.export(pe, (x,), dynamic_shapes=({1: seq},))
    assert any("posenc.add_position" in str(n.target) for n in ep.graph.nodes)
    for S in (10, 33):
        y = torch.randn(2, S, 16)
        assert torch.equal(ep.module()(y), pe(y))
