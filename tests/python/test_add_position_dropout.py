"""The fused dropout: statistics, exact scaling, RNG behaviour and the unsaved mask."""
import math

import pytest
import torch

import posenc
from conftest import DEVICES, reference_add
from dropout_reference import dropout_scale


def train_module(p, d=64, max_len=512, device="cpu"):
    return posenc.PositionalEncoding(d, p, max_len).to(device).train()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_zeroed_fraction_and_exact_survivors(device, p, dtype):
    pe = train_module(p, device=device)
    x = torch.randn(8, 500, 64, device=device).to(dtype)
    y = pe(x)
    kept = y != 0
    n = y.numel()
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / n)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    summed = reference_add(x, pe.pe, rounded=False)
    scale = dropout_scale(p, acc)
    want = (summed * scale).to(dtype)
    assert torch.equal(y[kept], want[kept])


@pytest.mark.parametrize("p", [0.15, 0.45, 1e-6, 0.1, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_survivors_and_gradients_are_nn_dropouts_bits(p, dtype):
    """float32 and float64 survivors are nn.Dropout's bits: (x + pe) times the noise it
    builds, ones divided by 1 - p in x's dtype (its CPU path: bernoulli_(1 - p).div_(1 - p)),
    and so is the gradient. The scale was 1 / (1 - p) in float64 rounded to float32, one ulp
    off for p = 0.15, 0.45 or 1e-6 (one p in five; found by an audit)."""
    torch.manual_seed(0)
    pe = train_module(p).to(dtype)
    x = (torch.rand(4, 300, 64) + 2.0).to(dtype).requires_grad_()  # x + pe is never 0
    y = pe(x)
    kept = y.detach() != 0
    noise = torch.ones((), dtype=dtype).div_(1 - p)  # nn.Dropout's factor, as ATen computes it
    summed = x.detach() + pe.pe[0, :300]
    assert torch.equal(y.detach()[kept], (summed * noise)[kept])
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, torch.where(kept, g * noise, torch.zeros((), dtype=dtype)))


@pytest.mark.parametrize("device", DEVICES)
def test_p_one_gives_zeros_and_p_zero_is_identity_plus_table(device):
    x = torch.randn(3, 40, 64, device=device)
    assert torch.equal(train_module(1.0, device=device)(x), torch.zeros_like(x))
    pe0 = train_module(0.0, device=device)
    assert torch.equal(pe0(x), reference_add(x, pe0.pe))


@pytest.mark.parametrize("device", DEVICES)
def test_eval_and_p_zero_consume_no_random_numbers(device):
    gen_state = (lambda: torch.cuda.get_rng_state()) if device == "cuda" else torch.get_rng_state
    x = torch.randn(2, 30, 64, device=device)
    for pe in (train_module(0.0, device=device), train_module(0.5, device=device).eval()):
        before = gen_state()
        pe(x)
        assert torch.equal(before, gen_state())
    before = gen_state()
    train_module(0.5, device=device)(x)
    assert not torch.equal(before, gen_state())


@pytest.mark.parametrize("device", DEVICES)
def test_manual_seed_reproduces_and_calls_draw_fresh_masks(device):
    pe = train_module(0.5, device=device)
    x = torch.randn(4, 100, 64, device=device)
    torch.manual_seed(1234)
    a, b = pe(x), pe(x)
    torch.manual_seed(1234)
    a2, b2 = pe(x), pe(x)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a != 0, b != 0)
    # The masks of two calls are uncorrelated: agreement near 1/2 for p = 1/2.
    agree = ((a != 0) == (b != 0)).double().mean().item()
    assert abs(agree - 0.5) < 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_backward_regenerates_the_forward_mask(device, batch_first):
    pe = posenc.PositionalEncoding(24, 0.3, 64, batch_first=batch_first).to(device).train()
    x = torch.randn(5, 33, 24, device=device, requires_grad=True)
    y = pe(x, positions=torch.randint(0, 64, (33 if batch_first else 5,), device=device))
    g = torch.randn_like(y)
    y.backward(g)
    kept = y.detach() != 0
    scale = torch.tensor(1 / 0.7, dtype=torch.float32)
    assert torch.equal(x.grad, torch.where(kept, g * scale, torch.zeros_like(g)))


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_graph_saves_no_tensor_of_x_size(device):
    """CUDA saves the (seed, offset) pair and regenerates the mask; the CPU saves the mask
    as bits (1 per element, 1/32 of float32 x) because reading them is cheaper there than
    Philox. Neither saves x, the output or a byte-per-element mask."""
    pe = train_module(0.2, d=64, device=device)
    x = torch.randn(4, 128, 64, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = pe(x, positions=torch.arange(128, device=device))
    assert saved, "the op must save its dropout state"
    assert all(t.numel() != x.numel() for t in saved)
    if device == "cuda":
        assert max(t.numel() for t in saved) <= 128  # rng (2) and positions (128)
    else:
        masks = [t for t in saved if t.dtype == torch.uint8]
        assert [tuple(t.shape) for t in masks] == [(4, 128, 8)]
        assert sum(t.numel() * t.element_size() for t in saved if t.dtype != torch.int64) == x.nbytes // 32
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_mask_is_written_only_for_a_cpu_backward(device):
    """save_mask, as the autograd kernel passes it to add_position_forward: only on the CPU,
    with dropout, and when a graph is recorded (a backward will read the mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.posenc.add_position_forward.default:
                calls.append(args[6] if len(args) > 6 else kwargs.get("save_mask", False))
            return func(*args, **(kwargs or {}))

    table = torch.randn(16, 8, device=device)
    x = torch.randn(2, 16, 8, device=device)
    xg = x.clone().requires_grad_(True)
    with Record():
        add = posenc.functional.add_position
        add(x, table, p=0.3)                      # nothing requires grad
        add(xg, table, p=0.0)                     # no dropout
        with torch.no_grad():
            add(xg, table, p=0.3)                 # no graph
        add(xg, table, p=0.3)                     # CPU training: the mask is saved
        add(x, table.clone().requires_grad_(True), p=0.3)
    assert calls == [False, False, False, device == "cpu", device == "cpu"]


def test_mask_resolution_is_two_to_the_minus_16():
    """p is quantised to multiples of 2**-16: p = 2**-16 drops, p = 2**-18 cannot."""
    x = torch.ones(64, 1024, 64)
    table = torch.zeros(1024, 64)
    torch.manual_seed(0)
    y = posenc.functional.add_position(x, table, p=2.0**-16)
    dropped = (y == 0).sum().item()
    n = x.numel()
    assert abs(dropped - n * 2.0**-16) <= 4 * math.sqrt(n * 2.0**-16)
    y = posenc.functional.add_position(x, table, p=2.0**-18)
    assert (y == 0).sum().item() == 0


@pytest.mark.cuda
def test_cpu_and_cuda_draw_the_same_mask_from_the_same_state():
    grad = torch.randn(3, 37, 40)
    rng = torch.tensor([0x1234_5678_9ABC, 777], dtype=torch.int64)
    cpu = torch.ops.posenc.add_position_backward(grad, rng, 0.4)
    gpu = torch.ops.posenc.add_position_backward(grad.cuda(), rng.cuda(), 0.4)
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("cls", [posenc.PositionalEncoding, posenc.LearnedPositionalEncoding])
def test_reentrant_checkpoint_with_a_forward_only_global_hook_warns(cls):
    """Reentrant activation checkpointing with a global module hook around its forward only
    (FlopCounterMode): the forward runs nn.Dropout (a hook must see the child's call), the
    recomputation, without the hook, the fused op: two masks, a wrong gradient, which a
    warning now names (silent before; found by an audit). Without the hook the gradient's
    mask is the forward's and nothing is said; the non-reentrant form raises a
    CheckpointError instead (docs/guide/sinusoidal.md)."""
    import warnings

    from torch.utils.checkpoint import CheckpointError, checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    m = cls(16, 0.4, max_len=20)
    x = torch.randn(2, 6, 16, requires_grad=True)
    with pytest.warns(UserWarning, match=r"use_reentrant=True\)'s forward or recomputation"):
        with FlopCounterMode(display=False):
            checkpoint(m, x, use_reentrant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = checkpoint(m, x, use_reentrant=True)
        y.backward(torch.ones_like(y))
    assert torch.equal(y != 0, x.grad != 0)  # the gradient's mask is the forward's
    x.grad = None
    with pytest.raises(CheckpointError):
        with FlopCounterMode(display=False):
            y = checkpoint(m, x, use_reentrant=False)
        y.backward(torch.ones_like(y))
