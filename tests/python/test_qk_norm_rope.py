"""qk_norm_rope (issue 24): RMSNorm of q and k then RoPE, fused. Against a float64 reference
written from each model's formula in plain PyTorch (Qwen3's and Gemma 3's per-head norm,
OLMo 2's norm over the whole projection), every RoPE feature, gradients (gradcheck, and the
fused backward against autograd through the reference), opcheck, torch.compile, bad inputs."""

import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from conftest import DEVICES
from multi_axis_reference import generic_multi_axis_rope
from posenc.functional import qk_norm_rope, rope_append_kv
from rope_reference import from_bshd, reference_inv_freq, reference_rope, thd_positions, to_bshd

F64 = torch.float64
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3),
       torch.bfloat16: (3e-2, 2e-2)}
# (norm, weight_offset, eps): Qwen3 / Qwen3-MoE, Gemma 3 ((1 + w), eps 1e-6), OLMo 2.
MODELS = {"qwen3": ("head", 0.0, 1e-6), "gemma3": ("head", 1.0, 1e-6), "olmo2": ("hidden", 0.0, 1e-5)}


def reference_norm(x, w, eps, offset, norm, layout):
    """x (user layout) -> float64 x * rsqrt(mean(x^2) + eps) * (w + offset), same layout."""
    xb = to_bshd(x.to(F64), layout)
    if norm == "head":
        ms, wv = xb.pow(2).mean(-1, keepdim=True), w.to(F64)
    else:
        ms, wv = xb.pow(2).mean((-2, -1), keepdim=True), w.to(F64).view(xb.shape[-2], xb.shape[-1])
    return from_bshd(xb * torch.rsqrt(ms + eps) * (wv + offset), layout)


def reference(q, k, wq, wk, *, eps, offset, norm, layout="bshd", pos=None, rotary_dim=None, interleaved=False,
              base=10000.0, scaling=None, seq_len=0):
    d = q.shape[-1]
    rot = d if rotary_dim is None else rotary_dim
    inv_freq, attn = reference_inv_freq(rot, base, scaling, seq_len)
    if pos is None:
        b, s = to_bshd(q, layout).shape[:2]
        pos = torch.arange(s).expand(b, s)
    out = []
    for x, w in ((q, wq), (k, wk)):
        y = reference_norm(x, w, eps, offset, norm, layout)
        out.append(reference_rope(y, layout, pos.cpu(), inv_freq.cpu(), rot, interleaved, attn).to(x.device))
    return out


def make(B, S, Hq, Hk, D, dtype, device, norm, layout="bshd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {"bshd": lambda h: (B, S, h, D), "bhsd": lambda h: (B, h, S, D), "sbhd": lambda h: (S, B, h, D),
             "thd": lambda h: (S, h, D)}[layout]
    q = (torch.randn(shape(Hq), generator=g, dtype=F64) * 2 + 0.3).to(device, dtype)
    k = (torch.randn(shape(Hk), generator=g, dtype=F64) * 2 - 0.2).to(device, dtype)
    lq, lk = (D, D) if norm == "head" else (Hq * D, Hk * D)
    wq = (torch.rand(lq, generator=g, dtype=F64) + 0.5).to(device, dtype)
    wk = (torch.rand(lk, generator=g, dtype=F64) + 0.5).to(device, dtype)
    return q, k, wq, wk


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.to(F64), expected.to(F64), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_models_match_reference(device, dtype, model):
    norm, offset, eps = MODELS[model]
    # GQA (6 q heads, 2 kv heads), odd sequence length.
    q, k, wq, wk = make(2, 7, 6, 2, 16, dtype, device, norm)
    oq, ok = qk_norm_rope(q, k, wq, wk, eps=eps, weight_offset=offset, norm=norm)
    rq, rk = reference(q, k, wq, wk, eps=eps, offset=offset, norm=norm)
    assert oq.dtype == dtype and ok.dtype == dtype and oq.shape == q.shape and ok.shape == k.shape
    close(oq, rq, dtype)
    close(ok, rk, dtype)


CASES = ["partial", "interleaved", "yarn", "positions", "offsets", "thd", "bhsd-strided", "sbhd",
         "odd-head-dim", "mrope", "float32-weights"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["head", "hidden"])
@pytest.mark.parametrize("case", CASES)
def test_rope_features(device, norm, case):
    dtype = torch.bfloat16 if case == "float32-weights" else torch.float32
    B, S, Hq, Hk, D = 2, 9, 3, 1, 24
    layout = {"thd": "thd", "bhsd-strided": "bhsd", "sbhd": "sbhd"}.get(case, "bshd")
    if case == "odd-head-dim":
        D = 18  # 9 pairs: no whole vector of pairs
    q, k, wq, wk = make(B, S, Hq, Hk, D, dtype, device, norm, layout=layout)
    opts, ref = {}, {}
    pos = None
    if case == "partial":
        opts["rotary_dim"] = ref["rotary_dim"] = 10
    elif case == "interleaved":
        opts["interleaved"] = ref["interleaved"] = True
    elif case == "yarn":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
        opts.update(scaling=scaling, rotary_dim=16, offset=5)
        ref.update(scaling=scaling, rotary_dim=16)
        pos = torch.arange(5, 5 + S).expand(B, S)
    elif case == "positions":
        pos = torch.randint(0, 100000, (B, S))
        opts["positions"] = pos.to(device)
    elif case == "offsets":
        offs = torch.tensor([3, 1000])
        opts["offset"] = offs.to(device)
        pos = torch.arange(S)[None] + offs[:, None]
    elif case == "thd":
        cu = torch.tensor([0, 4, 9])
        offs = torch.tensor([7, 0])
        opts.update(layout="thd", cu_seqlens=cu.to(device), offset=offs.to(device))
        pos = thd_positions(cu, offs)
    elif case == "bhsd-strided":
        # Non-contiguous: every other head of a wider tensor, and a transposed last dim.
        q = torch.cat([q, q], 1)[:, ::2]
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)
        opts["layout"] = "bhsd"
        assert not q.is_contiguous() and not k.is_contiguous()
    elif case == "sbhd":
        opts["layout"] = "sbhd"
    elif case == "mrope":
        sections = [4, 4, 4]
        p3 = torch.randint(0, 50, (3, B, S))
        opts.update(sections=sections, sections_mode="mrope", positions=p3.to(device))
    elif case == "float32-weights":
        wq, wk = wq.float(), wk.float()
    oq, ok = qk_norm_rope(q, k, wq, wk, norm=norm, **opts)
    if case == "mrope":
        # M-RoPE of the normalised inputs, from the independent float64 model of multi-axis
        # RoPE (multi_axis_reference), not from posenc's own apply_rope.
        nq = reference_norm(q, wq, 1e-6, 0.0, norm, layout).to(dtype)
        nk = reference_norm(k, wk, 1e-6, 0.0, norm, layout).to(dtype)
        rq = generic_multi_axis_rope(nq, p3, sections, "mrope", 10000.0, False)
        rk = generic_multi_axis_rope(nk, p3, sections, "mrope", 10000.0, False)
    else:
        if layout != "bshd" and pos is None:
            pos = torch.arange(S).expand(B, S)
        rq, rk = reference(q, k, wq, wk, eps=1e-6, offset=0.0, norm=norm, layout=layout, pos=pos, **ref)
    close(oq, rq, dtype)
    close(ok, rk, dtype)


def test_packed_token_outside_sequences_is_refused():
    q, k, wq, wk = make(1, 6, 2, 1, 8, torch.float32, "cpu", "head", layout="thd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        qk_norm_rope(q, k, wq, wk, layout="thd", cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["head", "hidden"])
@pytest.mark.parametrize("case", ["plain", "partial+offset", "interleaved+positions", "thd", "bhsd"])
def test_gradcheck(device, norm, case):
    torch.manual_seed(0)
    B, S, Hq, Hk, D = 2, 3, 3, 1, 8
    layout = {"thd": "thd", "bhsd": "bhsd"}.get(case, "bshd")
    q, k, wq, wk = make(B, S, Hq, Hk, D, F64, device, norm, layout=layout)
    opts = dict(norm=norm, eps=1e-3)
    if case == "partial+offset":
        opts.update(rotary_dim=4, weight_offset=1.0, offset=11)
    elif case == "interleaved+positions":
        opts.update(interleaved=True, positions=torch.randint(0, 1000, (B, S), device=device))
    elif case == "thd":
        opts.update(layout="thd", cu_seqlens=torch.tensor([0, 1, 3], device=device))
    elif case == "bhsd":
        opts["layout"] = "bhsd"
    inputs = [t.requires_grad_(True) for t in (q, k, wq, wk)]
    assert torch.autograd.gradcheck(lambda *a: qk_norm_rope(*a, **opts), inputs)
    if case in ("plain", "partial+offset"):
        assert torch.autograd.gradgradcheck(lambda *a: qk_norm_rope(*a, **opts), inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_fused_backward_matches_reference_gradients(device, dtype, model):
    norm, offset, eps = MODELS[model]
    q, k, wq, wk = make(2, 37, 4, 2, 64, dtype, device, norm, seed=3)
    gq = torch.randn(q.shape, dtype=F64).to(device, dtype)
    gk = torch.randn(k.shape, dtype=F64).to(device, dtype)
    ins = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    oq, ok = qk_norm_rope(*ins, eps=eps, weight_offset=offset, norm=norm, rotary_dim=48)
    torch.autograd.backward((oq, ok), (gq, gk))
    ref = [t.detach().to(F64).requires_grad_(True) for t in (q, k, wq, wk)]
    rq, rk = reference(*ref, eps=eps, offset=offset, norm=norm, rotary_dim=48)
    torch.autograd.backward((rq, rk), (gq.to(F64), gk.to(F64)))
    for got, want in zip(ins, ref):
        assert got.grad.dtype == got.dtype
        atol, rtol = TOL[dtype]
        # Weight gradients sum over tokens and heads: scale the tolerance by their size.
        scale = want.grad.abs().max().item() if got.dim() == 1 else 1.0
        torch.testing.assert_close(got.grad.to(F64), want.grad, atol=atol * max(scale, 1.0) * 4, rtol=rtol * 4)


def test_weight_gradient_is_deterministic_across_thread_counts():
    q, k, wq, wk = make(1, 300, 4, 2, 32, torch.float32, "cpu", "head", seed=5)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ins = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
            oq, ok = qk_norm_rope(*ins)
            (oq.sum() + 2 * ok.sum()).backward()
            grads.append([t.grad for t in ins])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("used", ["q", "k"])
def test_an_unused_output_gives_its_inputs_no_gradient(used):
    """k and k_weight reach out_k alone (q and q_weight out_q): when only out_q takes part in
    the loss, k's and k_weight's gradients are None, as apply_rope's k and as an unused
    parameter's in torch (they were zeros, which an optimizer with momentum or weight decay
    steps on: a review); the used side's gradients are unchanged."""
    q, k, wq, wk = make(1, 4, 2, 1, 8, F64, "cpu", "head")
    ins = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    both = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    oq, ok = qk_norm_rope(*ins)
    (oq if used == "q" else ok).sum().backward()
    bq, bk = qk_norm_rope(*both)
    ((bq if used == "q" else bk).sum() + 0 * (bk if used == "q" else bq).sum()).backward()
    used_side, unused_side = ((0, 2), (1, 3)) if used == "q" else ((1, 3), (0, 2))
    for i in used_side:
        torch.testing.assert_close(ins[i].grad, both[i].grad, rtol=0, atol=0)
    assert all(ins[i].grad is None for i in unused_side)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["no_tokens", "head_dim_0", "hidden_no_heads"])
def test_empty(device, case):
    # Tokens but nothing to normalise (head_dim 0, or norm "hidden" with 0 heads): empty
    # outputs and gradients, as the CPU gives (the CUDA backward launched its weight-gradient
    # reduction with 0 blocks there: "invalid configuration argument").
    B, S, Hq, Hk, D, norm = {"no_tokens": (2, 0, 3, 1, 8, "head"), "head_dim_0": (2, 5, 3, 1, 0, "head"),
                             "hidden_no_heads": (2, 5, 0, 0, 8, "hidden")}[case]
    q, k, wq, wk = make(B, S, Hq, Hk, D, torch.float32, device, norm)
    ins = [t.requires_grad_(True) for t in (q, k, wq, wk)]
    oq, ok = qk_norm_rope(*ins, norm=norm)
    assert oq.shape == q.shape and ok.shape == k.shape
    (oq.sum() + ok.sum()).backward()
    assert torch.equal(ins[2].grad, torch.zeros_like(wq))
    # The backward op itself (autograd may skip it for outputs without elements).
    grads = torch.ops.posenc.qk_norm_rope_backward(q.detach(), k.detach(), torch.ones_like(q), torch.ones_like(k),
                                                   wq.detach(), wk.detach(), 1e-6, 0.0, norm)
    assert [g.shape for g in grads] == [q.shape, k.shape, wq.shape, wk.shape]
    assert [g.device.type for g in grads] == [device] * 4


def _op_args(device, norm="head", dtype=torch.float32, requires_grad=False):
    q, k, wq, wk = make(2, 5, 3, 1, 8, dtype, device, norm)
    return [t.requires_grad_(requires_grad) for t in (q, k, wq, wk)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["head", "hidden"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, norm, requires_grad):
    args = _op_args(device, norm, requires_grad=requires_grad)
    opcheck(torch.ops.posenc.qk_norm_rope.default, tuple(args),
            dict(eps=1e-5, weight_offset=1.0, norm=norm, offset=3, rotary_dim=6))
    opcheck(torch.ops.posenc.qk_norm_rope.default, tuple(args),
            dict(norm=norm, positions=torch.randint(0, 99, (2, 5), device=device), interleaved=True))
    q, k, wq, wk = _op_args(device, norm)
    grads = (torch.randn_like(q), torch.randn_like(k))
    opcheck(torch.ops.posenc.qk_norm_rope_backward.default, (q, k, *grads, wq, wk, 1e-6, 0.5, norm),
            dict(offset=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["head", "hidden"])
def test_compile_fullgraph(device, norm):
    torch._dynamo.reset()
    q, k, wq, wk = make(2, 6, 4, 2, 16, torch.float32, device, norm)

    def f(q, k, wq, wk, pos):
        oq, ok = qk_norm_rope(q, k, wq, wk, norm=norm, weight_offset=1.0, positions=pos, rotary_dim=8)
        return (oq * 2).sum() + ok.square().sum()

    pos = torch.randint(0, 50, (2, 6), device=device)
    # aot_eager: dynamo and AOTAutograd trace the op and its backward on fake tensors (the
    # Meta kernels) without inductor's C++ compile (tens of seconds on this CI's cores).
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    ins_c = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    ins_e = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    out_c, out_e = compiled(*ins_c, pos), f(*ins_e, pos)
    torch.testing.assert_close(out_c, out_e)
    out_c.backward()
    out_e.backward()
    for a, b in zip(ins_c, ins_e):
        torch.testing.assert_close(a.grad, b.grad)


def test_inplace():
    q, k, wq, wk = make(2, 5, 3, 1, 8, torch.float32, "cpu", "head")
    want = qk_norm_rope(q, k, wq, wk, offset=4)
    q2, k2 = q.clone(), k.clone()
    got = qk_norm_rope(q2, k2, wq, wk, offset=4, inplace=True)
    assert got[0] is q2 and got[1] is k2
    torch.testing.assert_close(q2, want[0], atol=0, rtol=0)
    torch.testing.assert_close(k2, want[1], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="inplace=True"):
        qk_norm_rope(q2, k2, wq.requires_grad_(True), wk, inplace=True)


INPLACE_CASES = [  # norm, layout, rotary_dim, interleaved, dtype
    ("head", "bshd", None, False, torch.float32), ("hidden", "bhsd", 6, True, torch.float64),
    ("head", "sbhd", 4, False, torch.bfloat16), ("hidden", "bshd", None, True, torch.float16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm,layout,rotary_dim,interleaved,dtype", INPLACE_CASES)
def test_inplace_op_writes_q_and_k_themselves(device, norm, layout, rotary_dim, interleaved, dtype):
    """qk_norm_rope_ (inplace=True): the out-of-place op's bits, written into q and k (here
    strided slices of one fused qkv buffer, as attention layers produce them), with the
    version counters bumped and nothing else of the buffer touched."""
    B, S, Hq, Hk, D = 2, 5, 4, 2, 8
    q0, k0, wq, wk = make(B, S, Hq, Hk, D, dtype, device, norm, layout, seed=5)
    # One buffer holding q | k | v per token (v untouched), q and k as views of it.
    qkv = torch.randn(*to_bshd(q0, layout).shape[:2], Hq + 2 * Hk, D, dtype=F64).to(device, dtype)
    q_view = from_bshd(qkv[:, :, :Hq], layout)
    k_view = from_bshd(qkv[:, :, Hq:Hq + Hk], layout)
    q_view.copy_(q0)
    k_view.copy_(k0)
    v_before = qkv[:, :, Hq + Hk:].clone()
    assert not q_view.is_contiguous()
    kw = dict(norm=norm, offset=7, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout,
              weight_offset=0.5 if norm == "head" else 0.0)
    want = qk_norm_rope(q0, k0, wq, wk, **kw)
    versions = (q_view._version, k_view._version)
    got = qk_norm_rope(q_view, k_view, wq, wk, inplace=True, **kw)
    assert got[0] is q_view and got[1] is k_view
    assert q_view._version > versions[0] and k_view._version > versions[1]
    assert torch.equal(q_view, want[0]) and torch.equal(k_view, want[1])
    assert torch.equal(qkv[:, :, Hq + Hk:], v_before)
    pos = torch.arange(7, 7 + S).expand(B, S)
    ref_q, ref_k = reference(q0, k0, wq, wk, eps=1e-6, offset=kw["weight_offset"], norm=norm, layout=layout,
                             pos=pos, rotary_dim=rotary_dim, interleaved=interleaved)
    close(q_view, ref_q, dtype)
    close(k_view, ref_k, dtype)


def test_inplace_op_refuses_shared_memory_and_autograd():
    q, k, wq, wk = make(2, 5, 3, 1, 8, torch.float32, "cpu", "head")
    op = torch.ops.posenc.qk_norm_rope_
    with pytest.raises(RuntimeError, match="q without internal overlap"):
        op(q[:, :1].expand(2, 5, 3, 8), k, wq, wk)
    with pytest.raises(RuntimeError, match="q and k in separate memory"):
        op(q, q[:, :, :1], wq, wk)
    with pytest.raises(RuntimeError, match=r"q and q_weight in separate memory \(q is written, q_weight is read\)"):
        op(q, k, q[0, 0, 0], wk)
    with pytest.raises(RuntimeError, match="k and k_weight in separate memory"):
        op(q, k, wq, k[1, 1, 0])
    with pytest.raises(RuntimeError, match="inplace=True overwrites q and k"):
        op(q.clone().requires_grad_(True), k, wq, wk)
    with torch.no_grad():  # allowed without a graph
        op(q.clone().requires_grad_(True), k.clone(), wq, wk)
    with pytest.raises(ValueError, match=r"q_weight of shape \(8,\)"):
        op(q, k, wq[:7], wk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["head", "hidden"])
def test_opcheck_inplace(device, norm):
    q, k, wq, wk = _op_args(device, norm)
    opcheck(torch.ops.posenc.qk_norm_rope_.default, (q, k, wq, wk),
            dict(eps=1e-5, weight_offset=1.0, norm=norm, offset=3, rotary_dim=6))
    opcheck(torch.ops.posenc.qk_norm_rope_.default, (q, k, wq, wk),
            dict(norm=norm, positions=torch.randint(0, 99, (2, 5), device=device), interleaved=True))


def test_compile_fullgraph_inplace():
    """torch.compile functionalizes the mutating op (Tensor(a!) in its schema): the compiled
    function leaves q and k as eager does."""
    torch._dynamo.reset()
    q, k, wq, wk = make(2, 6, 4, 2, 16, torch.float32, "cpu", "hidden")

    def f(q, k, wq, wk):
        qk_norm_rope(q, k, wq, wk, norm="hidden", offset=2, inplace=True)
        return q.sum() + k.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    qc, kc, qe, ke = q.clone(), k.clone(), q.clone(), k.clone()
    with torch.no_grad():
        out_c, out_e = compiled(qc, kc, wq, wk), f(qe, ke, wq, wk)
    assert torch.equal(qc, qe) and torch.equal(kc, ke)
    torch.testing.assert_close(out_c, out_e)
    assert not torch.equal(qc, q)


def test_bad_inputs():
    q, k, wq, wk = make(2, 5, 3, 1, 8, torch.float32, "cpu", "head")
    with pytest.raises(ValueError, match=r"q_weight of shape \(8,\).*got shape \[7\]"):
        qk_norm_rope(q, k, wq[:7], wk)
    with pytest.raises(ValueError, match=r"k_weight of shape \(8,\)"):
        qk_norm_rope(q, k, wq, wk.view(2, 4))
    with pytest.raises(ValueError, match=r"q_weight of shape \(24,\).*heads \* head_dim of q.*'hidden'"):
        qk_norm_rope(q, k, wq, wk, norm="hidden")
    with pytest.raises(TypeError, match="qk_norm_rope: expected q_weight to have q's dtype torch.float32, got torch.float64"):
        qk_norm_rope(q, k, wq.double(), wk)
    with pytest.raises(TypeError, match="k_weight to have q's dtype"):
        qk_norm_rope(q, k, wq, wk.to(torch.int64))
    with pytest.raises(TypeError, match="q_weight to have q's dtype torch.bfloat16 \\(or torch.float32\\), got torch.float16"):
        qk_norm_rope(q.bfloat16(), k.bfloat16(), wq.half(), wk.bfloat16())
    for eps in (0.0, -1e-6):
        with pytest.raises(ValueError, match=f"eps > 0.*got {eps}"):
            qk_norm_rope(q, k, wq, wk, eps=eps)
    with pytest.raises(ValueError, match="eps > 0"):
        torch.ops.posenc.qk_norm_rope(q, k, wq, wk, eps=float("nan"))
    with pytest.raises(ValueError, match="weight_offset to be finite"):
        torch.ops.posenc.qk_norm_rope(q, k, wq, wk, weight_offset=float("inf"))
    # Finite in float64 but not in float32, where the norm of float32 q is computed (NaN outputs,
    # and NaN rows written by rope_append_kv's QK-norm; found by fuzzing); float64 q takes it.
    with pytest.raises(ValueError, match=r"weight_offset to be finite in float32 \(the norm of torch.float32 q and k "
                                         r"is computed in float32\), got 1e\+39"):
        qk_norm_rope(q, k, wq, wk, weight_offset=1e39)
    with pytest.raises(ValueError, match=r"weight_offset to be finite in float32"):
        rope_append_kv(q, k, k, torch.zeros(2, 16, *k.shape[2:]), torch.zeros(2, 16, *k.shape[2:]),
                       q_weight=wq, k_weight=wk, weight_offset=1e39)
    assert qk_norm_rope(q.double(), k.double(), wq.double(), wk.double(), weight_offset=1e39)[0].isfinite().all()
    with pytest.raises(ValueError, match="unknown norm 'rms'"):
        qk_norm_rope(q, k, wq, wk, norm="rms")
    with pytest.raises(TypeError, match="qk_norm_rope: expected norm to be a str, 'head' or 'hidden'; got 1"):
        qk_norm_rope(q, k, wq, wk, norm=1)
    with pytest.raises(ValueError, match="unknown norm 'rms'"):
        torch.ops.posenc.qk_norm_rope(q, k, wq, wk, norm="rms")
    with pytest.raises(TypeError, match="expected q_weight to be a Tensor"):
        qk_norm_rope(q, k, None, wk)
    # RoPE's own checks, with the function's name.
    with pytest.raises(ValueError, match="rotary_dim <= head_dim"):
        qk_norm_rope(q, k, wq, wk, rotary_dim=10)
    with pytest.raises(ValueError, match="qk_norm_rope: unknown layout"):
        qk_norm_rope(q, k, wq, wk, layout="bsdh")
    with pytest.raises(TypeError, match="expected k to have q's dtype"):
        qk_norm_rope(q, k.double(), wq, wk)
    q2 = torch.randn(2, 5, 3, 8)
    with pytest.raises(RuntimeError, match="grad_q of q's shape"):
        torch.ops.posenc.qk_norm_rope_backward(q2, k, q2[:1], k, wq, wk, 1e-6, 0.0, "head")


def test_meta_and_fake_shapes():
    q, k, wq, wk = (t.to("meta") for t in make(2, 5, 3, 1, 8, torch.float32, "cpu", "hidden"))
    oq, ok = torch.ops.posenc.qk_norm_rope(q, k, wq, wk, norm="hidden")
    assert oq.shape == q.shape and ok.shape == k.shape and oq.device.type == "meta"
    with pytest.raises(ValueError, match="k_weight of shape"):
        torch.ops.posenc.qk_norm_rope(q, k, wq, wq, norm="hidden")


def test_export():
    q, k, wq, wk = make(2, 6, 4, 2, 16, torch.float32, "cpu", "head")

    class M(torch.nn.Module):
        def forward(self, q, k, wq, wk):
            return qk_norm_rope(q, k, wq, wk, weight_offset=1.0, offset=3)

    ep = torch.export.export(M(), (q, k, wq, wk))
    for got, want in zip(ep.module()(q, k, wq, wk), M()(q, k, wq, wk)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_module_owns_hf_named_weights_and_matches_functional():
    m = posenc.QKNormRotary(16, eps=1e-5, weight_offset=1.0, rotary_dim=8, base=500.0)
    assert set(m.state_dict()) == {"q_norm.weight", "k_norm.weight"}
    assert torch.equal(m.q_norm.weight, torch.zeros(16))  # Gemma's (1 + w) starts at w = 0
    with torch.no_grad():
        m.q_norm.weight.uniform_(-0.5, 0.5)
        m.k_norm.weight.uniform_(-0.5, 0.5)
    q, k, _, _ = make(2, 5, 4, 2, 16, torch.float32, "cpu", "head")
    got = m(q, k, offset=7)
    want = qk_norm_rope(q, k, m.q_norm.weight, m.k_norm.weight, eps=1e-5, weight_offset=1.0, rotary_dim=8,
                        base=500.0, offset=7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    (got[0].sum() + got[1].sum()).backward()
    assert m.q_norm.weight.grad is not None and m.k_norm.weight.grad is not None
    hidden = posenc.QKNormRotary(16, norm="hidden", num_heads=4, num_kv_heads=2)
    assert hidden.q_norm.weight.shape == (64,) and hidden.k_norm.weight.shape == (32,)
    with pytest.raises(ValueError, match="num_heads"):
        posenc.QKNormRotary(16, norm="hidden")


def test_aten_fallback_matches_kernel():
    """The ATen composite (reached through the dispatcher: aten_fallback_mode) gives the
    kernel's outputs and gradients; the composite calls are counted, so it did run."""
    from aten_fallback_mode import ThroughTheFallback

    def run():
        ins = [t.requires_grad_(True) for t in make(2, 5, 4, 2, 16, torch.float32, "cpu", "hidden", seed=9)]
        out = qk_norm_rope(*ins, norm="hidden", weight_offset=0.5, rotary_dim=12, offset=3)
        (out[0].square().sum() + out[1].sum()).backward()
        q, k = (t.detach().clone() for t in ins[:2])
        with torch.no_grad():
            qk_norm_rope(q, k, *ins[2:], norm="hidden", weight_offset=0.5, rotary_dim=12, offset=3, inplace=True)
        return [*out, *[t.grad for t in ins], q, k]

    results = [run()]
    with ThroughTheFallback() as mode:
        results.append(run())
    for op in ("qk_norm_rope", "qk_norm_rope_backward", "qk_norm_rope_"):
        assert mode.calls.get(f"posenc::{op}", 0) > 0, mode.calls
    for kernel, fallback in zip(*results):
        torch.testing.assert_close(fallback, kernel, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,norm,rotary_dim,interleaved,layout", [
    (torch.float32, "head", None, False, "bshd"),
    (torch.bfloat16, "head", None, False, "bshd"),
    (torch.float16, "head", None, False, "bhsd"),
    (torch.float32, "hidden", None, False, "bshd"),
    (torch.float32, "head", 64, False, "bshd"),  # partial rotary: plain stores
    (torch.bfloat16, "head", None, True, "bshd"),
])
def test_large_call_streams_with_the_bits_of_small_calls(dtype, norm, rotary_dim, interleaved, layout):
    """A call that writes 12 MiB (kStreamBytes is 8 MiB: cpu/kernel.cpp, rope_rows.h) stores
    the forward's q and k and the backward's dx with streaming stores where a row allows them:
    the same bits as eight calls small enough for plain stores, forward and backward (the
    weight gradients, summed in another order, close), and the float64 reference's values."""
    S = 2048 if dtype == torch.float32 else 4096
    Hq, Hk, D = 8, 4, 128
    q, k, wq, wk = make(1, S, Hq, Hk, D, dtype, "cpu", norm, layout=layout, seed=17)
    kw = dict(norm=norm, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout)
    ins = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    out_q, out_k = qk_norm_rope(*ins, **kw, offset=9)
    pos = (9 + torch.arange(S)).expand(1, S)
    ref_q, ref_k = reference(q, k, wq, wk, eps=1e-6, offset=0.0, norm=norm, layout=layout, pos=pos,
                             rotary_dim=rotary_dim, interleaved=interleaved)
    close(out_q.detach(), ref_q, dtype)
    close(out_k.detach(), ref_k, dtype)
    g = torch.Generator().manual_seed(18)
    gq = torch.randn(out_q.shape, generator=g).to(dtype)
    gk = torch.randn(out_k.shape, generator=g).to(dtype)
    dq, dk, dwq, dwk = torch.autograd.grad((out_q, out_k), ins, (gq, gk))
    seq_dim = {"bshd": 1, "bhsd": 2}[layout]
    chunk = S // 8
    parts = {name: [] for name in ("q", "k", "dq", "dk")}
    sum_wq, sum_wk = torch.zeros_like(wq, dtype=F64), torch.zeros_like(wk, dtype=F64)
    for start in range(0, S, chunk):
        part = [q.narrow(seq_dim, start, chunk).clone().requires_grad_(True),
                k.narrow(seq_dim, start, chunk).clone().requires_grad_(True),
                wq.clone().requires_grad_(True), wk.clone().requires_grad_(True)]
        pq, pk = qk_norm_rope(*part, **kw, offset=9 + start)
        grads = torch.autograd.grad((pq, pk), part, (gq.narrow(seq_dim, start, chunk), gk.narrow(seq_dim, start, chunk)))
        parts["q"].append(pq.detach())
        parts["k"].append(pk.detach())
        parts["dq"].append(grads[0])
        parts["dk"].append(grads[1])
        sum_wq += grads[2].to(F64)
        sum_wk += grads[3].to(F64)
    assert torch.equal(out_q.detach(), torch.cat(parts["q"], seq_dim))
    assert torch.equal(out_k.detach(), torch.cat(parts["k"], seq_dim))
    assert torch.equal(dq, torch.cat(parts["dq"], seq_dim))
    assert torch.equal(dk, torch.cat(parts["dk"], seq_dim))
    scale = max(sum_wq.abs().max().item(), 1.0)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(dwq.to(F64), sum_wq, atol=atol * scale * 4, rtol=rtol * 4)
    torch.testing.assert_close(dwk.to(F64), sum_wk, atol=atol * scale * 4, rtol=rtol * 4)
