"""CUDA streams and CUDA graphs: the ops run on the current stream (not the default one),
and they can be captured in a CUDA graph (dropout draws its Philox seed/offset in a
graph-safe way, so every replay draws a fresh mask)."""
import math

import pytest
import torch

import posenc
from conftest import reference_add
from dropout_reference import dropout_scale
from posenc.functional import apply_rope

pytestmark = pytest.mark.cuda

# Keeps the side stream busy (~25 ms) before its inputs are written: an op launched on the
# default stream instead of the current one would then read them before they exist.
SLEEP_CYCLES = 50_000_000


def on_side_stream(fn):
    """fn() on a fresh non-default stream, behind a long sleep kernel on that stream;
    returns its result once the device is idle."""
    s = torch.cuda.Stream()
    assert s != torch.cuda.default_stream()
    s.wait_stream(torch.cuda.current_stream())  # the inputs made on the default stream
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
        torch.cuda._sleep(SLEEP_CYCLES)
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return out


def add_position_step(pe, x_base, g_base, seed, positions=None):
    """Forward and backward of the module in training mode from a fixed seed. x and the
    upstream gradient are computed here, on the current stream, from the base tensors;
    x + pe >= 1 everywhere, so an output is 0 exactly where dropout zeroed it."""
    x = (x_base.abs() + 2.0).requires_grad_(True)
    g = g_base * 2.0 + 0.5
    if isinstance(pe.pe, torch.nn.Parameter):
        pe.pe.grad = None
    torch.manual_seed(seed)
    y = pe(x, positions=positions)
    y.backward(g)
    table_grad = pe.pe.grad.clone() if isinstance(pe.pe, torch.nn.Parameter) else None
    return y.detach(), x.grad, g, table_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positional_encoding_on_a_side_stream_equals_default_stream(dtype):
    p = 0.3
    pe = posenc.PositionalEncoding(64, p, 1024).cuda().train()
    x_base = torch.randn(8, 1000, 64, device="cuda").to(dtype)
    g_base = torch.randn(8, 1000, 64, device="cuda").to(dtype)
    y0, gx0, g0, _ = add_position_step(pe, x_base, g_base, seed=11)
    torch.cuda.synchronize()
    y1, gx1, g1, _ = on_side_stream(lambda: add_position_step(pe, x_base, g_base, seed=11))
    # Same seed, same (seed, offset) pair: the same mask, bit for bit.
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    # And the side-stream results are right: dropout did drop, survivors are exact, the
    # gradient is the upstream gradient through the same mask.
    kept = y1 != 0
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / y1.numel())
    x = x_base.abs() + 2.0
    scale = dropout_scale(p)
    want = (reference_add(x, pe.pe, rounded=False) * scale.cuda()).to(dtype)
    assert torch.equal(y1[kept], want[kept])
    want_grad = torch.where(kept, (g1.float() * scale.cuda()).to(dtype), torch.zeros_like(g1))
    assert torch.equal(gx1, want_grad)


def test_learned_positional_encoding_on_a_side_stream_equals_default_stream():
    p = 0.2
    pe = posenc.LearnedPositionalEncoding(48, p, 256).cuda().train()
    pe.check_positions = False  # no host sync: the side stream stays asynchronous
    with torch.no_grad():
        pe.pe.uniform_(-1.0, 1.0)  # values of the order of x, not 0.02
    x_base = torch.randn(6, 200, 48, device="cuda")
    g_base = torch.randn(6, 200, 48, device="cuda")
    positions = torch.randint(0, 256, (6, 200), device="cuda")  # repeats: rows summed
    y0, gx0, _, gt0 = add_position_step(pe, x_base, g_base, seed=5, positions=positions)
    torch.cuda.synchronize()
    y1, gx1, _, gt1 = on_side_stream(lambda: add_position_step(pe, x_base, g_base, seed=5, positions=positions))
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert torch.equal(gt0, gt1)  # the table gradient is deterministic (no atomics)
    kept = y1 != 0
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / y1.numel())
    # Table gradient: the masked gradient summed into the rows used, in float64.
    want = torch.zeros(256, 48, dtype=torch.float64, device="cuda")
    want.index_add_(0, positions.reshape(-1), gx1.double().reshape(-1, 48))
    torch.testing.assert_close(gt1[0].double(), want, atol=1e-5, rtol=1e-6)
    # x's rows: (x + pe[positions]) * scale for survivors.
    x = x_base.abs() + 2.0
    scale = dropout_scale(p, device="cuda")
    ref = reference_add(x, pe.pe.detach(), positions, rounded=False) * scale
    assert torch.equal(y1[kept], ref[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_on_a_side_stream_equals_default_stream(dtype, interleaved):
    q_base = torch.randn(2, 512, 8, 64, device="cuda").to(dtype)
    k_base = torch.randn(2, 512, 2, 64, device="cuda").to(dtype)
    gq_base = torch.randn(2, 512, 8, 64, device="cuda").to(dtype)
    gk_base = torch.randn(2, 512, 2, 64, device="cuda").to(dtype)
    positions = torch.randint(0, 10**6, (2, 512), device="cuda")

    def step():
        q = (q_base * 2.0 - 0.5).requires_grad_(True)
        k = (k_base * 2.0 - 0.5).requires_grad_(True)
        oq, ok = apply_rope(q, k, positions=positions, interleaved=interleaved, rotary_dim=48)
        torch.autograd.backward((oq, ok), (gq_base * 3.0, gk_base * 3.0))
        return oq.detach(), ok.detach(), q.grad, k.grad

    eager = step()
    torch.cuda.synchronize()
    side = on_side_stream(step)
    for a, b in zip(eager, side):
        assert torch.equal(a, b)
    # The rotation happened (the rotated part changed, the pass-through part did not).
    q = q_base * 2.0 - 0.5
    assert not torch.equal(side[0][..., :48], q[..., :48])
    assert torch.equal(side[0][..., 48:], q[..., 48:])


def capture(fn, warmup=3):
    """A CUDA graph of fn(), with the warm-up iterations on a side stream as the PyTorch
    documentation shows. Returns (graph, the static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    return graph, static_out


def test_cuda_graph_positional_encoding_training_draws_a_fresh_mask_per_replay():
    p = 0.5
    pe = posenc.PositionalEncoding(64, p, 512).cuda().train()
    static_x = torch.randn(8, 256, 64, device="cuda")
    gen = torch.cuda.default_generators[static_x.device.index]
    torch.manual_seed(0)
    graph, static_y = capture(lambda: pe(static_x))
    replays = []
    for _ in range(2):
        offset = gen.get_offset()  # the Philox offset this replay will use
        graph.replay()
        replays.append((offset, static_y.clone()))
    torch.cuda.synchronize()
    (o1, y1), (o2, y2) = replays
    assert o2 > o1
    m1, m2 = y1 != 0, y2 != 0
    assert not torch.equal(m1, m2)
    agree = (m1 == m2).double().mean().item()
    assert abs(agree - 0.5) < 0.01  # uncorrelated masks for p = 1/2
    scale = dropout_scale(p, device="cuda")
    want = reference_add(static_x, pe.pe, rounded=False) * scale
    for y in (y1, y2):
        kept = y != 0
        frac = 1 - kept.double().mean().item()
        assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / y.numel())
        assert torch.equal(y[kept], want[kept])
    # Eager with the generator state each replay had gives the same numbers.
    for offset, y in replays:
        gen.set_offset(offset)
        assert torch.equal(pe(static_x), y)


def test_cuda_graph_add_position_forward_rng_output_matches_the_mask():
    """The kernel writes the (seed, offset) it drew to its rng output, inside the graph too:
    each replay's mask is the one backward (on the CPU as well) regenerates from it."""
    p = 0.25
    table = torch.randn(300, 40, device="cuda")
    static_x = torch.randn(5, 300, 40, device="cuda")
    graph, (static_out, static_rng) = capture(
        lambda: torch.ops.posenc.add_position_forward(static_x, table, None, 0, True, p)
    )
    seen = []
    for _ in range(3):
        graph.replay()
        out, rng = static_out.clone(), static_rng.clone()
        torch.cuda.synchronize()
        seen.append(tuple(rng.tolist()))
        kept = out != 0
        frac = 1 - kept.double().mean().item()
        assert abs(frac - p) <= 4 * math.sqrt(p * (1 - p) / out.numel())
        # The CPU kernels regenerate the same mask bits from the pair.
        factor = torch.ops.posenc.add_position_backward(torch.ones(5, 300, 40), rng.cpu(), p)
        assert torch.equal(factor != 0, kept.cpu())
        g = torch.randn(5, 300, 40, device="cuda")
        scale = dropout_scale(p, device="cuda")
        assert torch.equal(torch.ops.posenc.add_position_backward(g, rng, p),
                           torch.where(kept, g * scale, torch.zeros_like(g)))
    assert len({s for s, _ in seen}) == 1  # one seed
    assert len({o for _, o in seen}) == 3  # a fresh offset per replay


def test_cuda_graph_positional_encoding_eval_equals_eager():
    pe = posenc.PositionalEncoding(64, 0.5, 512).cuda().eval()
    static_x = torch.randn(4, 100, 64, device="cuda")
    static_pos = torch.randint(0, 512, (4, 100), device="cuda")
    pe.check_positions = False  # the host range check would sync, which capture forbids
    graph, static_y = capture(lambda: pe(static_x, positions=static_pos))
    for _ in range(2):  # new inputs in the static buffers each time
        static_x.copy_(torch.randn_like(static_x))
        static_pos.copy_(torch.randint(0, 512, (4, 100), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = pe(static_x, positions=static_pos)
        assert torch.equal(static_y, eager)
        assert torch.equal(static_y, reference_add(static_x, pe.pe, static_pos))


@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_graph_apply_rope_equals_eager(interleaved):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    static_q = torch.randn(2, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    static_k = torch.randn(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    static_pos = torch.randint(0, 10**5, (2, 64), device="cuda")
    static_off = torch.randint(0, 1000, (2,), device="cuda")

    def fn():
        a = apply_rope(static_q, static_k, positions=static_pos, interleaved=interleaved, scaling=scaling)
        b = apply_rope(static_q, offset=static_off, interleaved=interleaved)
        return (*a, b)

    graph, static_out = capture(fn)
    for _ in range(2):
        static_q.copy_(torch.randn_like(static_q))
        static_k.copy_(torch.randn_like(static_k))
        static_pos.copy_(torch.randint(0, 10**5, (2, 64), device="cuda"))
        static_off.copy_(torch.randint(0, 1000, (2,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(static_out, fn()):
            assert torch.equal(got, want)
        assert not torch.equal(static_out[0], static_q)


def test_cuda_graph_default_calls_of_every_op():
    """Each op's default call captures (issue 26, item 4): no host read of a value, in
    particular apply_rope(layout="thd"), whose cu_seqlens the Python front end used to check
    on the host by default. Replays on new inputs equal eager calls."""
    F = posenc.functional
    q = torch.randn(9, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 9], device="cuda", dtype=torch.int32)
    x = torch.randn(2, 5, 32, device="cuda")
    table = torch.randn(16, 32, device="cuda")
    pos = torch.randint(0, 16, (2, 5), device="cuda")
    q4 = torch.randn(2, 5, 4, 64, device="cuda")
    cos, sin = F.rope_cos_sin(torch.arange(5, device="cuda"), 64)

    def fn():
        return (F.apply_rope(q, cu_seqlens=cu, layout="thd"),
                F.apply_rope(q4, positions=pos, offset=3),
                F.add_position(x, table, positions=pos, p=0.0),
                F.apply_rope_cos_sin(q4, None, cos, sin, layout="bshd")[0])

    graph, static_out = capture(fn)
    for _ in range(2):
        for t in (q, x, q4):
            t.copy_(torch.randn_like(t))
        pos.copy_(torch.randint(0, 16, (2, 5), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(static_out, fn()):
            assert torch.equal(got, want)
        assert torch.equal(static_out[2], reference_add(x, table, pos))


def test_cuda_graph_sinusoidal_table_replays_its_host_frequencies():
    """sinusoidal_table copies its host-computed frequencies from pinned memory; a block the
    caching host allocator handed out during capture is never reused, so every replay reads
    the same frequencies, also after other pinned allocations (the positions are read anew)."""
    from posenc.functional import sinusoidal_table

    positions = torch.arange(7, device="cuda")
    graph, out = capture(lambda: sinusoidal_table(positions, 16))
    positions.copy_(torch.arange(7, device="cuda") * 3)
    for _ in range(4):  # pinned blocks of the frequencies' size, filled with something else
        torch.full((16,), 7.0, dtype=torch.float64).pin_memory().to("cuda", non_blocking=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), sinusoidal_table(positions.cpu(), 16))
