"""RoPE: gradcheck, opcheck on rope / rope_ / rope_frequencies / rope_position_bounds(/_extremes), in place, what backward saves,
torch.compile(fullgraph=True) and torch.export."""

import pytest
import torch
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from conftest import DEVICES
from posenc.functional import apply_rope

SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
N_SCALING_KEYS = len(torch.ops.posenc.rope_scaling_spec()[1])  # the op's fixed scaling values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "case",
    ["plain", "positions", "offsets", "partial+yarn", "dynamic", "thd", "bhsd", "sbhd", "q only"],
)
def test_gradcheck(device, interleaved, case):
    torch.manual_seed(0)
    opts = dict(interleaved=interleaved)
    B, S, D = 2, 5, 12
    q = torch.randn(B, S, 3, D, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(B, S, 1, D, dtype=torch.float64, device=device, requires_grad=True)
    if case == "positions":
        opts["positions"] = torch.randint(0, 5000, (B, S), device=device)
    elif case == "offsets":
        opts["offset"] = torch.tensor([3, 900], device=device)
    elif case == "partial+yarn":
        opts.update(rotary_dim=6, scaling=SCALING, offset=40)
    elif case == "dynamic":
        # Positions 30 .. 34 beyond original_max_position_embeddings=16: NTK-rescaled base.
        opts.update(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
                    offset=30)
    elif case == "thd":
        q = torch.randn(7, 3, D, dtype=torch.float64, device=device, requires_grad=True)
        k = torch.randn(7, 2, D, dtype=torch.float64, device=device, requires_grad=True)
        opts.update(layout="thd", cu_seqlens=torch.tensor([0, 3, 7], device=device))
    elif case == "bhsd":
        q = torch.randn(B, 3, S, D, dtype=torch.float64, device=device).transpose(2, 3).contiguous().transpose(2, 3)
        q.requires_grad_(True)
        k = torch.randn(B, 1, S, D, dtype=torch.float64, device=device, requires_grad=True)
        opts["layout"] = "bhsd"
    elif case == "sbhd":
        q = torch.randn(S, B, 3, D, dtype=torch.float64, device=device, requires_grad=True)
        k = torch.randn(S, B, 1, D, dtype=torch.float64, device=device, requires_grad=True)
        opts.update(layout="sbhd", positions=torch.randint(0, 5000, (B, S), device=device))
    if case == "q only":
        assert torch.autograd.gradcheck(lambda a: apply_rope(a, **opts), (q,))
    else:
        assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, **opts), (q, k))
        assert torch.autograd.gradgradcheck(lambda a, b: apply_rope(a, b, **opts), (q, k))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_inverse_rotation_and_saves_no_activation(device):
    q = torch.randn(2, 64, 4, 32, device=device, requires_grad=True)
    k = torch.randn(2, 64, 2, 32, device=device, requires_grad=True)
    positions = torch.randint(0, 1000, (2, 64), device=device)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        oq, ok = apply_rope(q, k, positions=positions)
    # Only the index tensor is saved: nothing of q's or k's size.
    assert [tuple(t.shape) for t in saved] == [(2, 64)]
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    (oq * gq).sum().add((ok * gk).sum()).backward()
    # The gradient of an orthogonal map is its inverse: rotating it forward gives gq back.
    back_q, back_k = apply_rope(q.grad, k.grad, positions=positions)
    torch.testing.assert_close(back_q, gq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back_k, gk, atol=1e-5, rtol=1e-5)


class PosencOpLog(TorchDispatchMode):
    """Records every posenc op that reaches the dispatcher below autograd, with its q, k
    and inverse arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func).startswith("posenc."):
            schema_args = func._schema.arguments
            bound = dict(zip([a.name for a in schema_args], args))
            bound.update(kwargs)
            self.calls.append((str(func), bound))
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_q_and_k_rotated_in_one_call_forward_and_one_backward(device, layout):
    """Fused: apply_rope(q, k) is one posenc::rope call, and its backward one more
    (the inverse rotation of both gradients), never one call per tensor."""
    if layout == "thd":
        q = torch.randn(9, 4, 16, device=device, requires_grad=True)
        k = torch.randn(9, 2, 16, device=device, requires_grad=True)
        opts = dict(layout="thd", cu_seqlens=torch.tensor([0, 4, 9], device=device))
    else:
        q = torch.randn(2, 9, 4, 16, device=device, requires_grad=True)
        k = torch.randn(2, 9, 2, 16, device=device, requires_grad=True)
        opts = dict(positions=torch.randint(0, 1000, (2, 9), device=device))
    log = PosencOpLog()
    with log:
        oq, ok = apply_rope(q, k, **opts)
    forward = [name for name, _ in log.calls]
    assert forward == ["posenc.rope.default"], forward
    fwd_args = log.calls[0][1]
    assert fwd_args["q"].shape == q.shape and fwd_args["k"] is not None and fwd_args["k"].shape == k.shape
    assert not fwd_args.get("inverse", False)
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    log.calls.clear()
    with log:
        ((oq * gq).sum() + (ok * gk).sum()).backward()
    backward = [name for name, _ in log.calls]
    assert backward == ["posenc.rope.default"], backward
    bwd_args = log.calls[0][1]
    assert bwd_args["inverse"] is True
    assert bwd_args["q"].shape == q.shape and bwd_args["k"] is not None and bwd_args["k"].shape == k.shape
    # The one backward call gave both gradients, and they are the inverse rotations.
    assert q.grad is not None and k.grad is not None
    back_q, back_k = apply_rope(q.grad, k.grad, **opts)
    torch.testing.assert_close(back_q, gq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back_k, gk, atol=1e-5, rtol=1e-5)


def bounds_reads(fn):
    """How many times fn reads the call's position bounds (each read is one aten::aminmax pair,
    and on CUDA a device sync)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::aminmax")


@pytest.mark.parametrize("op", ["apply_rope", "qk_norm_rope"])
def test_length_scaled_types_read_the_longest_position_once_per_training_step(op):
    """"dynamic" without seq_len reads the longest position from the index tensors (a sync on
    CUDA): the forward reads it, and its backward and tangent use what it read."""
    from posenc.functional import qk_norm_rope
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    q = torch.randn(2, 6, 3, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 1, 16, dtype=torch.float64, requires_grad=True)
    w = torch.rand(16, dtype=torch.float64) + 0.5
    pos = torch.tensor([[0, 3, 9, 20, 40, 70], [1, 2, 3, 4, 5, 6]])
    scaling = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=16)

    def call(a, b, **kw):
        if op == "apply_rope":
            return apply_rope(a, b, positions=pos, scaling=scaling, **kw)
        return qk_norm_rope(a, b, w, w, positions=pos, scaling=scaling, **kw)

    with torch.no_grad():
        once = bounds_reads(lambda: call(q, k))
    assert once == 2  # the positions' extremes and the positions' own, in one read
    grads = torch.randn(2, 6, 3, 16, dtype=torch.float64), torch.randn(2, 6, 1, 16, dtype=torch.float64)

    def step():
        oq, ok = call(q, k)
        return torch.autograd.grad((oq, ok), (q, k), grads)

    assert bounds_reads(step) == once
    # The same gradients as with the longest position given.
    expected = torch.autograd.grad(call(q, k, seq_len=71), (q, k), grads)
    for got, want in zip(step(), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Forward mode: the tangent's call too.
    tq = torch.randn_like(q)
    with fwAD.dual_level():
        def jvp():
            out = call(fwAD.make_dual(q.detach(), tq), k.detach())
            return fwAD.unpack_dual(out[0]).tangent

        assert bounds_reads(jvp) == once
        tangent = jvp()
        want = fwAD.unpack_dual(call(fwAD.make_dual(q.detach(), tq), k.detach(), seq_len=71)[0]).tangent
    torch.testing.assert_close(tangent, want, rtol=0, atol=0)


def opcheck_cases(device):
    q = torch.randn(2, 5, 3, 8, device=device)
    k = torch.randn(2, 5, 1, 8, device=device)
    t = torch.randn(9, 2, 8, device=device)
    yarn = [0b1001, 4.0, 0.0, 0.0, 16.0] + [0.0] * (N_SCALING_KEYS - 4)  # keys 0 and 3 given
    return [
        (q, k),
        (q, None, torch.randint(0, 99, (2, 5), device=device), torch.tensor([1, 2], device=device), 3),
        (q.transpose(1, 2), k.transpose(1, 2), None, None, 0, None, 500.0, "yarn", yarn, 0, 6, True, "bhsd"),
        (t, t[:, :1].clone(), None, None, 2, torch.tensor([0, 4, 9], device=device), 10000.0, "default", [], 0, -1, False, "thd"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rope(device):
    for args in opcheck_cases(device):
        opcheck(torch.ops.posenc.rope.default, args)
        grad_args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        opcheck(torch.ops.posenc.rope.default, grad_args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rope_inplace(device):
    for args in opcheck_cases(device):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        opcheck(torch.ops.posenc.rope_.default, args)


def test_opcheck_rope_frequencies():
    # No tensor inputs: a host-side helper (module construction), never traced; fake tensors
    # have no device to come from, so the schema check is the one that applies.
    opcheck(torch.ops.posenc.rope_frequencies.default, (16, 10000.0), test_utils=("test_schema",))
    inv, factor = torch.ops.posenc.rope_frequencies(16, 10000.0, "linear", [1.0, 2.0] + [0.0] * (N_SCALING_KEYS - 1))
    assert inv.shape == (8,) and factor == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rope_position_bounds(device):
    # Returns Python ints read from the index tensors: a host-side check (the modules skip it
    # under torch.compile), so fake tensors cannot run it; the schema and autograd
    # registration checks apply.
    q = torch.randn(2, 3, 1, 4, device=device, requires_grad=True)
    args = (q, None, torch.tensor([[0, 1, 2], [5, 6, 7]], device=device), torch.tensor([3, 1], device=device), 2)
    opcheck(torch.ops.posenc.rope_position_bounds.default, args,
            test_utils=("test_schema", "test_autograd_registration"))
    assert torch.ops.posenc.rope_position_bounds(*args) == (5, 10)


def extremes_cases(device):
    """RoPE calls with index tensors (and some without): (q, keyword arguments)."""
    g = torch.Generator().manual_seed(5)
    q4, q3 = torch.randn(2, 3, 1, 4, device=device), torch.randn(7, 1, 4, device=device)
    cu = torch.tensor([0, 3, 3, 7], device=device)
    return [
        (q4, dict(positions=torch.tensor([[0, 1, 2], [5, 6, 7]], device=device), offsets=torch.tensor([3, 1],
                                                                                                      device=device),
                  offset=2)),
        (q4, dict(positions=torch.randint(-9, 60, (3,), generator=g).to(device), offset=4)),
        (q4, dict(offsets=torch.tensor([0, 40], device=device))),
        (q4, dict(offset=7)),
        (q4[:0], dict(positions=torch.zeros(0, 3, dtype=torch.long, device=device))),
        (q3, dict(cu_seqlens=cu, layout="thd")),
        (q3, dict(cu_seqlens=cu, offsets=torch.tensor([5, 100, 2], device=device), layout="thd")),
        (q3, dict(cu_seqlens=torch.tensor([0, 0, 7], device=device), layout="thd")),
        (q3[:0], dict(cu_seqlens=torch.tensor([0, 0], device=device), layout="thd")),
        (q4, dict(positions=torch.randint(0, 30, (2, 2, 3), generator=g).to(device), sections=[1, 1],
                  sections_mode="mrope")),
        (q3, dict(positions=torch.randint(0, 30, (2, 7), generator=g).to(device), cu_seqlens=cu,
                  offsets=torch.tensor([1, 2, 3], device=device), sections=[1, 1], layout="thd")),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_rope_position_extremes_are_the_bounds_left_on_the_device(device):
    """rope_position_extremes: rope_position_bounds' (smallest, largest) position as an
    int64 (2,) tensor on q's device, without a read-back (a compiled or exported
    RotaryPositionalEncoding asserts on it); no token: high below low. opcheck runs its
    Meta kernel (fake tensors) against the real one."""
    for q, kwargs in extremes_cases(device):
        got = torch.ops.posenc.rope_position_extremes(q, **kwargs)
        lo, hi = torch.ops.posenc.rope_position_bounds(q, **kwargs)
        assert got.dtype == torch.int64 and got.shape == (2,) and got.device == q.device
        if hi >= lo:
            assert got.tolist() == [lo, hi], kwargs
        else:
            assert got[1] < got[0], kwargs
        opcheck(torch.ops.posenc.rope_position_extremes.default, (q,), kwargs)


def test_rope_position_extremes_under_vmap():
    """Its vmap rule: the extremes over every vmapped sample, unbatched (the module's assert
    has no batching rule). A compiled vmap(grad) of the module with positions ran before the
    device check existed, and broke with a batched verdict: it runs, and refuses a sample's
    bad position."""
    q = torch.randn(1, 5, 2, 8)
    pos = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(1))
    ext = torch.vmap(lambda p: torch.ops.posenc.rope_position_extremes(q, positions=p, offset=3))(pos)
    assert ext.tolist() == [[pos.min().item() + 3, pos.max().item() + 3]] * 4
    empty = torch.vmap(lambda p: torch.ops.posenc.rope_position_extremes(q, positions=p))(pos[:0])
    assert empty.shape == (0, 2)
    rope = posenc.RotaryPositionalEncoding(8, max_len=50)
    qs = torch.randn(3, 1, 5, 2, 8, dtype=torch.float64)
    w = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    torch._dynamo.reset()
    per_sample = torch.compile(torch.func.vmap(torch.func.grad(lambda x, p: (rope(x, positions=p) * w).sum())),
                               backend="aot_eager", fullgraph=True)
    got = per_sample(qs, pos[:3])
    want = torch.stack([torch.func.grad(lambda x, p: (rope(x, positions=p) * w).sum())(x, p) for x, p in zip(qs, pos[:3])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    bad = pos[:3].clone()
    bad[1, 2] = 50
    with pytest.raises(RuntimeError, match=r"expected positions in \[0, max_len=50\)"):
        per_sample(qs, bad)


def test_rope_position_extremes_of_index_tensors_the_op_refuses():
    """rope_position_bounds refuses (ValueError, on the host) operands beyond 2**53 and bad
    cu_seqlens; the device form reads nothing back, so it answers (int64 min, int64 max),
    which no [0, max_len) admits (the CUDA kernels do not check index values: a compiled
    module on CUDA would otherwise rotate a call eager refuses)."""
    q4, q3 = torch.randn(1, 1, 1, 4), torch.randn(6, 1, 4)
    invalid = [torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max]
    in_range = r"expected positions within \[-2\*\*53, 2\*\*53\] \(integers exact in the float64 angle\), got "
    cu = r"expected cu_seqlens to start at 0, never decrease and end at the number of tokens 6, got "
    calls = [
        (q4, dict(positions=torch.tensor([-2**63]), offsets=torch.tensor([-2**63 + 3])),  # the sum wraps to 3
         in_range + "-9223372036854775808"),
        (q4, dict(positions=torch.tensor([2**53 + 1])), in_range + "9007199254740993"),
        (q3, dict(cu_seqlens=torch.tensor([0, 4, 2, 6]), layout="thd"),  # decreasing
         cu + "first value 0, last value 6, shortest step -2"),
        (q3, dict(cu_seqlens=torch.tensor([0, 2, 7]), layout="thd"),  # 7 of 6 tokens
         cu + "first value 0, last value 7, shortest step 2"),
        (q3, dict(cu_seqlens=torch.tensor([1, 2, 6]), layout="thd"), cu + "first value 1, last value 6, shortest step 1"),
    ]
    for q, kwargs, message in calls:
        with pytest.raises(ValueError, match=message):
            torch.ops.posenc.rope_position_bounds(q, **kwargs)
        assert torch.ops.posenc.rope_position_extremes(q, **kwargs).tolist() == invalid, kwargs
    ok = torch.ops.posenc.rope_position_extremes(q4, positions=torch.tensor([2**53]))
    assert ok.tolist() == [2**53, 2**53]  # the domain's edge is valid


@pytest.mark.parametrize("case", ["positions", "offsets", "thd", "mrope"])
def test_compiled_module_refuses_positions_beyond_max_len(case):
    """A compiled RotaryPositionalEncoding skipped its [0, max_len) check for position
    tensors (it cannot read them without a graph break): positions beyond max_len were
    rotated as if allowed, where the eager module raises IndexError. Now the bounds stay on
    the device and torch._assert_async refuses the call, with no graph break; in range, the
    compiled module computes what the eager one does."""
    torch._dynamo.reset()
    max_len = 32
    mrope = case == "mrope"
    rope = posenc.RotaryPositionalEncoding(8, max_len=max_len, sections=[1, 1, 2] if mrope else None,
                                           sections_mode="mrope" if mrope else "axial",
                                           layout="thd" if case == "thd" else "bshd")
    g = torch.Generator().manual_seed(3)
    if case == "thd":
        q = torch.randn(9, 2, 8, generator=g)
        cu = torch.tensor([0, 4, 9])

        def call(m, bad):
            return m(q, offset=torch.tensor([2, 40 if bad else 23]), cu_seqlens=cu)
    elif case == "offsets":
        q = torch.randn(2, 4, 2, 8, generator=g)

        def call(m, bad):
            return m(q, offset=torch.tensor([28 + bad, 3]))  # 29 + 3 tokens: position 32
    else:
        q = torch.randn(2, 5, 2, 8, generator=g)
        pos = torch.randint(0, max_len, (3, 2, 5) if mrope else (2, 5), generator=g)

        def call(m, bad):
            p = pos.clone()
            if bad:
                p.view(-1)[7] = max_len
            return m(q, positions=p)

    with pytest.raises(IndexError, match=f"max_len={max_len}"):
        call(rope, True)
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # the compiled tests' backend: test_qk_norm_rope_transformers
    compiled = torch.compile(rope, backend=counter, fullgraph=True)
    assert torch.equal(call(compiled, False), call(rope, False))
    with pytest.raises(RuntimeError, match=rf"expected positions in \[0, max_len={max_len}\)"):
        call(compiled, True)
    targets = [n.target for gm in counter.graphs for n in gm.graph.nodes]
    assert torch.ops.posenc.rope_position_extremes in targets and torch._assert_async in targets, targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace(device, interleaved):
    q = torch.randn(2, 6, 4, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 6, 2, 16, device=device, dtype=torch.bfloat16)
    pos = torch.randint(0, 10**6, (6,), device=device)
    expect_q, expect_k = apply_rope(q, k, positions=pos, interleaved=interleaved, rotary_dim=10)
    q_ptr, version = q.data_ptr(), q._version
    rq, rk = apply_rope(q, k, positions=pos, interleaved=interleaved, rotary_dim=10, inplace=True)
    assert rq is q and rk is k and q.data_ptr() == q_ptr
    assert q._version > version
    assert torch.equal(q, expect_q) and torch.equal(k, expect_k)
    # A fused qkv buffer rotated in place through its slices.
    qkv = torch.randn(2, 6, 3, 4, 16, device=device)
    q2, k2 = qkv[:, :, 0], qkv[:, :, 1]
    v_before = qkv[:, :, 2].clone()
    expect_q, expect_k = apply_rope(q2, k2, interleaved=interleaved)
    apply_rope(q2, k2, interleaved=interleaved, inplace=True)
    assert torch.equal(qkv[:, :, 0], expect_q) and torch.equal(qkv[:, :, 1], expect_k)
    assert torch.equal(qkv[:, :, 2], v_before)
    # Strided views of two separate allocations (neither dense: torch's overlap test
    # cannot decide them, their storages can).
    q3 = torch.randn(2, 6, 4, 32, device=device)[..., ::2]
    k3 = torch.randn(2, 6, 2, 20, device=device)[..., 2:18]
    expect_q, expect_k = apply_rope(q3, k3, interleaved=interleaved)
    apply_rope(q3, k3, interleaved=interleaved, inplace=True)
    assert torch.equal(q3, expect_q) and torch.equal(k3, expect_k)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_refuses_autograd_and_overlap(device):
    q = torch.randn(1, 3, 2, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="inplace=True"):
        apply_rope(q, inplace=True)
    with torch.no_grad():
        apply_rope(q, inplace=True)  # inference: fine
    expanded = torch.randn(1, 3, 1, 8, device=device).expand(1, 3, 4, 8)
    with pytest.raises(RuntimeError, match="internal overlap"):
        apply_rope(expanded, inplace=True)
    x = torch.randn(1, 3, 2, 8, device=device)
    with pytest.raises(RuntimeError, match="separate memory"):
        apply_rope(x, x[:, :, :1], inplace=True)
    with pytest.raises(RuntimeError, match="separate memory"):
        apply_rope(x, x, inplace=True)
    if device == "cpu":
        # Two storages over one buffer (numpy, DLPack, from_blob): not separate.
        a = torch.randn(1, 4, 1, 16).numpy()
        q, k = torch.from_numpy(a)[..., 0:8], torch.from_numpy(a)[..., 4:12]
        with pytest.raises(RuntimeError, match="two storages over overlapping memory"):
            apply_rope(q, k, inplace=True)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_equals_eager_forward_and_backward(device):
    torch.manual_seed(1)
    rope = posenc.RotaryPositionalEncoding(32, max_len=512, scaling={"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}).to(device)

    def step(fn, q, k, offset):
        q = q.detach().requires_grad_(True)
        k = k.detach().requires_grad_(True)
        oq, ok = fn(q, k, offset=offset)
        (oq.square().sum() + (ok * 3).sum()).backward()
        return oq, ok, q.grad, k.grad

    compiled = torch.compile(rope, fullgraph=True)
    for S, offset in ((16, 0), (16, 7), (40, 100)):
        q = torch.randn(2, S, 4, 32, device=device)
        k = torch.randn(2, S, 2, 32, device=device)
        for a, b in zip(step(compiled, q, k, offset), step(rope, q, k, offset)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

    fn = torch.compile(lambda q, k, pos: apply_rope(q, k, positions=pos, interleaved=True, layout="bhsd"), fullgraph=True)
    q = torch.randn(2, 4, 9, 16, device=device)
    k = torch.randn(2, 1, 9, 16, device=device)
    pos = torch.randint(0, 10**5, (2, 9), device=device)
    for a, b in zip(fn(q, k, pos), apply_rope(q, k, positions=pos, interleaved=True, layout="bhsd")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_inplace(device):
    def f(q, k):
        apply_rope(q, k, offset=5, inplace=True)
        return q * 2, k

    q = torch.randn(1, 4, 2, 8, device=device)
    k = torch.randn(1, 4, 1, 8, device=device)
    expect = f(q.clone(), k.clone())
    got = torch.compile(f, fullgraph=True)(q.clone(), k.clone())
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


def test_export():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = posenc.RotaryPositionalEncoding(16, max_len=128)

        def forward(self, q, k):
            q, k = self.rope(q, k)
            return q @ k.transpose(-1, -2)

    model = Attention()
    q = torch.randn(2, 10, 3, 16)
    k = torch.randn(2, 10, 3, 16)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=128)
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq})
    ep = torch.export.export(model, (q, k), dynamic_shapes=shapes)
    assert any("posenc.rope" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(q, k), model(q, k))
    q2, k2 = torch.randn(3, 50, 3, 16), torch.randn(3, 50, 3, 16)  # other batch and seq sizes
    torch.testing.assert_close(ep.module()(q2, k2), model(q2, k2))


def test_a_decoding_loop_compiles_twice_not_per_offset():
    """docs/guide/func.md and sinusoidal.md: a decoding loop "recompiles once, at its second
    offset, then not per step". Reviews found a graph per value where torch.compile's
    dynamic int was specialised: the front ends' int checks (operator.index), the RoPE ops'
    seq_len (an int in their schema, now a SymInt, as make_positions' offset), rope_shift_kv's
    checks of from_seq_len / to_seq_len; and a graph of its own for offset 0 (the front end's
    test for leaving a default argument out). Each int argument of a decoding step over 10
    values, 0 among them after others: the first graph, then one dynamic graph, and the
    compiled results equal eager's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    F = posenc.functional
    pe = posenc.PositionalEncoding(8, 0.0, 64)
    rope = posenc.RotaryPositionalEncoding(16)
    x, q = torch.randn(1, 1, 8), torch.randn(1, 1, 2, 16)
    w = torch.rand(16) + 0.5
    cache = torch.randn(1, 32, 2, 16)
    dynamic = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4)
    tokens = torch.tensor([[1, 5, 0, 7]])
    steps = {
        "PositionalEncoding": lambda off: pe(x, offset=off),
        "add_position": lambda off: F.add_position(x, pe.pe[0], offset=off),
        "apply_rope": lambda off: apply_rope(q, offset=off),
        "RotaryPositionalEncoding": lambda off: rope(q, offset=off),
        "qk_norm_rope": lambda off: F.qk_norm_rope(q, q, w, w, offset=off),
        "apply_rope seq_len": lambda off: apply_rope(q, offset=off, seq_len=off + 1, scaling=dynamic),
        "qk_norm_rope seq_len": lambda off: F.qk_norm_rope(q, q, w, w, offset=off, seq_len=off + 1, scaling=dynamic),
        "rope_append_kv seq_len": lambda off: F.rope_append_kv(
            q, q, q, torch.zeros(1, 32, 2, 16), torch.zeros(1, 32, 2, 16), offset=off, seq_len=off + 1,
            scaling=dynamic),
        "rope_shift_kv": lambda off: F.rope_shift_kv(
            cache.clone(), torch.tensor([1]), torch.tensor([0]), rows=torch.tensor([1]), scaling=dynamic,
            from_seq_len=off + 20, to_seq_len=off + 19),
        "make_positions": lambda off: F.make_positions(tokens, 0, offset=off),
    }
    for name, step in steps.items():
        graphs.clear()
        compiled = torch.compile(step, backend=backend)
        for off in (3, 5, 0, 7, 0, 9, 11, 2, 4, 6):
            torch.testing.assert_close(compiled(off), step(off), rtol=0, atol=0)
        assert len(graphs) == 2, f"{name}: {len(graphs)} graphs for 10 values"


def test_a_0_dim_offset_compiles_fullgraph():
    # A decode step's offset as a 0-dim CPU tensor (every sequence's), compiled: no graph break,
    # the eager numbers, a new value without a new graph.
    q = torch.randn(2, 5, 3, 8)
    k = torch.randn(2, 5, 1, 8)
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()  # this function's graphs
    f = torch.compile(lambda q, k, o: apply_rope(q, k, offset=o), fullgraph=True, backend=counter)
    for value in (3, 4, 9):
        got, want = f(q, k, torch.tensor(value)), apply_rope(q, k, offset=value)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_add_position_tensor_offset_compiles_once():
    """A one-element tensor offset (add_position's documented "an int or a one-element
    integer tensor"): the op's SymInt read its value (a graph per value), and aot_eager /
    inductor failed ("Expected a value of type 'int' ... found 'FunctionalTensor'"). Under
    torch.compile it is now positions offset .. offset + seq - 1: one graph, eager's bits."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    pe = posenc.PositionalEncoding(8, 0.0, 64)
    x = torch.randn(2, 3, 8)
    for name, fn in {"module": lambda o: pe(x, offset=o),
                     "function": lambda o: posenc.functional.add_position(x, pe.pe[0], offset=o)}.items():
        graphs.clear()
        counted = torch.compile(fn, backend=backend)
        eager_backend = torch.compile(fn, backend="aot_eager", fullgraph=True)
        for off in (4, 9, 0, 20):
            o = torch.tensor(off)
            torch.testing.assert_close(counted(o), fn(off), rtol=0, atol=0)
            torch.testing.assert_close(eager_backend(o), fn(off), rtol=0, atol=0)
        assert len(graphs) == 1, f"{name}: {len(graphs)} graphs"
