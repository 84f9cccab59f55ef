"""torch.func transforms and forward-mode AD through apply_rope_cos_sin (gradients to q, k,
cos and sin) and qk_norm_rope (gradients to q, k and both weights), against the same
transforms of float64 references written in plain PyTorch: transformers' formula
``x * cos + rotate_half(x) * sin`` for the tables, RMSNorm then RoPE (rope_reference.py) for
qk-norm. The derivatives are the ops' own (csrc/ops/rope_cos_sin/autograd.cpp,
csrc/ops/qk_norm_rope/autograd.cpp): one C++ definition for autograd, torch.func and
forward AD."""

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jvp, vmap

import posenc
from func_transforms import check_transforms, gradcheck_all
from posenc.functional import apply_rope_cos_sin, qk_norm_rope
from rope_reference import from_bshd, reference_inv_freq, reference_rope, to_bshd

F64 = torch.float64


def joined(*outs):
    return torch.cat([o.reshape(-1) for o in outs])


# ---- apply_rope_cos_sin ------------------------------------------------------------------

def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_apply(x, cos, sin, layout, interleaved):
    """transformers' apply_rotary_pos_emb on the first rotary_dim features (the rest pass
    through, GPT-NeoX), tables unsqueezed over heads; GPT-J's rotate_every_two when
    interleaved."""
    c, s = (cos if cos.dim() == 3 else cos[None]), (sin if sin.dim() == 3 else sin[None])
    dim = 1 if layout == "bhsd" else 2
    c, s = c.unsqueeze(dim), s.unsqueeze(dim)
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    turned = rotate_every_two(xr) if interleaved else rotate_half(xr)
    return torch.cat((xr * c + turned * s, xp), dim=-1)


def cos_sin_inputs(layout, b=2, s=3, hq=2, hk=1, d=6, rot=None, table_batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (b, h, s, d)) if layout == "bhsd" else (lambda h: (b, s, h, d))
    q = torch.randn(shape(hq), generator=g, dtype=F64)
    k = torch.randn(shape(hk), generator=g, dtype=F64)
    rot = d if rot is None else rot
    tshape = (s, rot) if table_batch is None else (table_batch, s, rot)
    # Arbitrary tables (not cos/sin of one angle): the gradients see every entry.
    return q, k, torch.randn(tshape, generator=g, dtype=F64), torch.randn(tshape, generator=g, dtype=F64)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_sin_q_and_k_with_table_gradients(layout, interleaved):
    q, k, cos, sin = cos_sin_inputs(layout, table_batch=2)

    def f(q, k, cos, sin):
        return joined(*apply_rope_cos_sin(q, k, cos, sin, layout=layout, interleaved=interleaved))

    def ref(q, k, cos, sin):
        return joined(hf_apply(q, cos, sin, layout, interleaved), hf_apply(k, cos, sin, layout, interleaved))

    check_transforms(f, ref, (q, k, cos, sin))


@pytest.mark.parametrize("table_batch", [None, 1])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cos_sin_q_alone_partial_rotary_broadcast_tables(table_batch, layout):
    q, _, cos, sin = cos_sin_inputs(layout, d=8, rot=4, table_batch=table_batch, seed=1)

    def f(q, cos, sin):
        return apply_rope_cos_sin(q, None, cos, sin, layout=layout)

    def ref(q, cos, sin):
        return hf_apply(q, cos, sin, layout, False)

    check_transforms(f, ref, (q, cos, sin))


def test_cos_sin_q_and_k_only_differentiable_in_x():
    """The usual call: tables from a buffer, gradients (and tangents) of q and k only."""
    q, k, cos, sin = cos_sin_inputs("bhsd", d=8, rot=6, table_batch=1, seed=2)

    def f(q, k):
        return joined(*apply_rope_cos_sin(q, k, cos, sin, interleaved=True))

    def ref(q, k):
        return joined(hf_apply(q, cos, sin, "bhsd", True), hf_apply(k, cos, sin, "bhsd", True))

    check_transforms(f, ref, (q, k))
    t = torch.randn_like(q)
    _, tangent = jvp(lambda x: apply_rope_cos_sin(x, None, cos, sin), (q,), (t,))
    torch.testing.assert_close(tangent, apply_rope_cos_sin(t, None, cos, sin), rtol=0, atol=0)  # the op itself


def test_cos_sin_table_tangent_alone_and_unused_output():
    """A tangent on cos only (sin's is zero), and a gradient through k's output only."""
    q, k, cos, sin = cos_sin_inputs("bshd", seed=3)
    tc = torch.randn_like(cos)
    _, tangent = jvp(lambda c: joined(*apply_rope_cos_sin(q, k, c, sin, layout="bshd")), (cos,), (tc,))
    _, want = jvp(lambda c: joined(hf_apply(q, c, sin, "bshd", False), hf_apply(k, c, sin, "bshd", False)),
                  (cos,), (tc,))
    torch.testing.assert_close(tangent, want, rtol=1e-12, atol=1e-12)
    gq, gk, gc = grad(lambda q, k, c: apply_rope_cos_sin(q, k, c, sin, layout="bshd")[1].square().sum(),
                      argnums=(0, 1, 2))(q, k, cos)
    wq, wk, wc = grad(lambda q, k, c: hf_apply(k, c, sin, "bshd", False).square().sum(), argnums=(0, 1, 2))(q, k, cos)
    assert torch.count_nonzero(gq) == 0
    torch.testing.assert_close((gk, gc), (wk, wc), rtol=1e-12, atol=1e-12)


def test_cos_sin_gradcheck_with_forward_ad_and_batched_grads():
    q, k, cos, sin = cos_sin_inputs("bhsd", b=1, s=2, d=4, table_batch=1, seed=4)
    gradcheck_all(lambda q, k, c, s: apply_rope_cos_sin(q, k, c, s, interleaved=True), (q, k, cos, sin))
    q, _, cos, sin = cos_sin_inputs("bshd", b=1, s=2, d=6, rot=4, seed=5)
    gradcheck_all(lambda q, c, s: apply_rope_cos_sin(q, None, c, s, layout="bshd"), (q, cos, sin))


# ---- qk_norm_rope ------------------------------------------------------------------------

def rms_norm(x, w, eps, offset, norm, layout):
    """Plain RMSNorm in float64: per head, or over each token's whole projection."""
    xb = to_bshd(x, layout)
    if norm == "head":
        ms, wv = xb.pow(2).mean(-1, keepdim=True), w
    else:
        ms, wv = xb.pow(2).mean((-2, -1), keepdim=True), w.view(xb.shape[-2], xb.shape[-1])
    return from_bshd(xb * torch.rsqrt(ms + eps) * (wv + offset), layout)


def qk_reference(q, k, wq, wk, *, eps, offset, norm, layout, pos, rot, interleaved=False, scaling=None):
    inv, attn = reference_inv_freq(rot, scaling=scaling)
    return [reference_rope(rms_norm(x, w, eps, offset, norm, layout), layout, pos, inv, rot, interleaved, attn)
            for x, w in ((q, wq), (k, wk))]


def qk_inputs(layout, norm, b=2, s=3, hq=2, hk=1, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {"bshd": lambda h: (b, s, h, d), "bhsd": lambda h: (b, h, s, d)}[layout]
    q = torch.randn(shape(hq), generator=g, dtype=F64) * 2 + 0.3
    k = torch.randn(shape(hk), generator=g, dtype=F64) * 2 - 0.2
    lq, lk = (d, d) if norm == "head" else (hq * d, hk * d)
    return q, k, torch.rand(lq, generator=g, dtype=F64) + 0.5, torch.rand(lk, generator=g, dtype=F64) + 0.5


QK_CASES = {
    # Qwen3: per-head norm, GQA.
    "qwen3": dict(layout="bshd", norm="head", eps=1e-6, offset=0.0, kw={}, ref={}),
    # Gemma 3: (1 + w), partial rotary, given positions, interleaved pairs, bhsd.
    "gemma3-partial-positions": dict(layout="bhsd", norm="head", eps=1e-6, offset=1.0,
                                     kw=dict(rotary_dim=4, interleaved=True, positions=torch.tensor([[0, 5, 2],
                                                                                                     [7, 1, 3]])),
                                     ref=dict(rot=4, interleaved=True, pos=torch.tensor([[0, 5, 2], [7, 1, 3]]))),
    # OLMo 2: the token's whole projection, a scaling type and an offset.
    "olmo2-hidden-yarn": dict(layout="bshd", norm="hidden", eps=1e-5, offset=0.0,
                              kw=dict(offset=2, scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 8}),
                              ref=dict(pos=torch.arange(2, 5).expand(2, 3),
                                       scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 8})),
}


def qk_case(name, d=8):
    c = QK_CASES[name]
    q, k, wq, wk = qk_inputs(c["layout"], c["norm"], d=d, seed=len(name))
    ref_kw = dict(c["ref"])
    ref_kw.setdefault("rot", d)
    ref_kw.setdefault("pos", torch.arange(3).expand(2, 3))

    def f(q, k, wq, wk):
        return joined(*qk_norm_rope(q, k, wq, wk, eps=c["eps"], weight_offset=c["offset"], norm=c["norm"],
                                    layout=c["layout"], **c["kw"]))

    def ref(q, k, wq, wk):
        return joined(*qk_reference(q, k, wq, wk, eps=c["eps"], offset=c["offset"], norm=c["norm"],
                                    layout=c["layout"], **ref_kw))

    return f, ref, (q, k, wq, wk)


@pytest.mark.parametrize("name", sorted(QK_CASES))
def test_qk_norm_rope_all_inputs(name):
    f, ref, inputs = qk_case(name)
    check_transforms(f, ref, inputs)


@pytest.mark.parametrize("name", sorted(QK_CASES))
def test_qk_norm_rope_weights_alone_and_x_alone(name):
    """Tangents and gradients of the weights only, and of q and k only (the other part of
    the forward formula's sum absent)."""
    f, ref, (q, k, wq, wk) = qk_case(name)
    check_transforms(lambda wq, wk: f(q, k, wq, wk), lambda wq, wk: ref(q, k, wq, wk), (wq, wk),
                     hessian_check=False, batched=False)
    check_transforms(lambda q, k: f(q, k, wq, wk), lambda q, k: ref(q, k, wq, wk), (q, k), hessian_check=False)


@pytest.mark.parametrize("norm,offset", [("head", 1.0), ("hidden", 0.0)])
def test_qk_norm_rope_gradcheck_with_forward_ad_and_batched_grads(norm, offset):
    q, k, wq, wk = qk_inputs("bshd", norm, b=1, s=2, d=4, seed=7)
    gradcheck_all(lambda *a: qk_norm_rope(*a, norm=norm, weight_offset=offset, rotary_dim=2, offset=1),
                  (q, k, wq, wk))


def test_qk_norm_rope_rotation_of_the_tangent_is_the_rope_op():
    """With a tangent on the weights only, dy = rope(n(x) * dw): the rope op itself."""
    q, k, wq, wk = qk_inputs("bshd", "head", seed=8)
    tq, tk = torch.randn_like(wq), torch.randn_like(wk)
    _, (dq, dk) = jvp(lambda a, b: qk_norm_rope(q, k, a, b, offset=3), (wq, wk), (tq, tk))
    want_q, want_k = qk_norm_rope(q, k, tq, tk, offset=3)  # linear in the weights (no offset)
    torch.testing.assert_close((dq, dk), (want_q, want_k), rtol=1e-12, atol=1e-12)


def test_qk_norm_rope_keeps_a_wider_tangent():
    """A float32 tangent of a float16 q stays float32 (as apply_rope's and torch's own ops'):
    the op's float32 tangent was rounded to float16. A tangent of q's own dtype stays in it."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 2, 8, generator=g).to(torch.float16)
    k = torch.randn(1, 3, 1, 8, generator=g).to(torch.float16)
    wq, wk = torch.rand(8, generator=g).to(torch.float16), torch.rand(8, generator=g).to(torch.float16)
    tq, tk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g).to(torch.float16)
    with forward_ad.dual_level():
        oq, ok = qk_norm_rope(forward_ad.make_dual(q, tq), forward_ad.make_dual(k, tk), wq, wk, offset=2)
        gq, gk = forward_ad.unpack_dual(oq).tangent, forward_ad.unpack_dual(ok).tangent
    assert (oq.dtype, gq.dtype, gk.dtype) == (torch.float16, torch.float32, torch.float16)
    # the float64 formula on the float16 primals: float32's error, not float16's
    f = lambda a: qk_norm_rope(a, k.double(), wq.double(), wk.double(), offset=2)[0]  # noqa: E731
    _, want = jvp(f, (q.double(),), (tq.double(),))
    torch.testing.assert_close(gq.double(), want, rtol=1e-5, atol=1e-5)
    assert (gq.double() - want).abs().max() < (gq.half().double() - want).abs().max()
    with forward_ad.dual_level():  # a float32 tangent of the float16 weight alone
        oq, ok = qk_norm_rope(q, k, forward_ad.make_dual(wq, tq[0, 0, 0].clone()), wk, offset=2)
        assert forward_ad.unpack_dual(oq).tangent.dtype == torch.float32
        assert forward_ad.unpack_dual(ok).tangent is None


def test_complex_tangents_are_refused():
    """A complex tangent of a real primal (forward AD allows one): refused with a TypeError,
    as the ops refuse complex inputs; qk_norm_rope returned it complex with a zero imaginary
    part (its formula's real arithmetic dropped it)."""
    q, k, wq, wk = qk_inputs("bshd", "head", seed=13)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(q.shape[1]), q.shape[-1], dtype=q.dtype)
    calls = {
        "q": lambda t: qk_norm_rope(forward_ad.make_dual(q, t), k, wq, wk),
        "weight": lambda t: qk_norm_rope(q, k, forward_ad.make_dual(wq, t[0, 0, 0].clone()), wk),
        "cos": lambda t: apply_rope_cos_sin(q, None, forward_ad.make_dual(cos, t[0, :, 0].clone()), sin, layout="bshd"),
        "table": lambda t: posenc.functional.add_position(q[0], forward_ad.make_dual(q[1, :, 0].clone(),
                                                                                   t[1, :, 0].clone())),
    }
    for name, call in calls.items():
        t = torch.complex(torch.randn(q.shape, dtype=q.dtype), torch.randn(q.shape, dtype=q.dtype))
        with forward_ad.dual_level(), pytest.raises(TypeError, match="expected real floating-point tangents"):
            call(t)
            print(f"{name}: no TypeError")  # reached only when the call did not raise


def test_cos_sin_table_tangents_keep_a_wider_dtype():
    """float16 q and tables: float32 tangents of the tables stay float32 (they were rounded to
    q's float16), alone or beside a float16 tangent of q."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 3, 2, 8, generator=g).to(torch.float16)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(3), 8)
    tc, ts = torch.randn(cos.shape, generator=g), torch.randn(sin.shape, generator=g)
    tx = torch.randn(q.shape, generator=g).to(torch.float16)
    for with_q in (False, True):
        with forward_ad.dual_level():
            qd = forward_ad.make_dual(q, tx) if with_q else q
            out = apply_rope_cos_sin(qd, None, forward_ad.make_dual(cos.half(), tc),
                                     forward_ad.make_dual(sin.half(), ts), layout="bshd")
            got = forward_ad.unpack_dual(out).tangent
        f = lambda a, c, s: apply_rope_cos_sin(a, None, c, s, layout="bshd")  # noqa: E731
        primals = (q.double(), cos.half().double(), sin.half().double())
        _, want = jvp(f, primals, ((tx if with_q else torch.zeros_like(q)).double(), tc.double(), ts.double()))
        assert got.dtype == torch.float32, with_q
        tol = 2e-3 if with_q else 1e-5  # q's tangent term rotated in float16
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_qk_norm_rope_inplace_refuses_gradients_and_tangents():
    q, k, wq, wk = qk_inputs("bshd", "head", seed=9)
    with pytest.raises(RuntimeError, match="inplace=True overwrites q and k"):
        grad(lambda w: qk_norm_rope(q.clone(), k.clone(), w, wk, inplace=True)[0].sum())(wq)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q.clone(), torch.ones_like(q))
        for mode in (torch.enable_grad, torch.no_grad):  # no_grad does not turn forward AD off
            with mode(), pytest.raises(RuntimeError, match="inplace=True overwrites q and k, which cannot carry "
                                       "forward-mode AD tangents .* use inplace=False$"):
                qk_norm_rope(dual, k.clone(), wq, wk, inplace=True)
    with torch.no_grad():
        x, y = q.clone(), k.clone()
        vx, vy = x._version, y._version
        qk_norm_rope(x, y, wq, wk, inplace=True)
        assert x._version > vx and y._version > vy


# ---- the module, functional_call, compile ------------------------------------------------

def test_qk_norm_rotary_module_functional_call_grad_of_parameters():
    torch.manual_seed(10)
    m = posenc.QKNormRotary(8, weight_offset=1.0, rotary_dim=4).to(F64)
    params = {n: torch.randn_like(p) * 0.1 for n, p in m.named_parameters()}
    assert sorted(params) == ["k_norm.weight", "q_norm.weight"]
    q, k = torch.randn(2, 3, 4, 8, dtype=F64), torch.randn(2, 3, 2, 8, dtype=F64)
    a, b = torch.randn_like(q), torch.randn_like(k)

    def loss(p, q, k, a, b):
        oq, ok = functional_call(m, p, (q, k))
        return (oq * a).sum() + (ok * b).sum()

    def loss_ref(p, q, k, a, b):
        oq, ok = qk_reference(q, k, p["q_norm.weight"], p["k_norm.weight"], eps=1e-6, offset=1.0, norm="head",
                              layout="bshd", pos=torch.arange(3).expand(q.shape[0], 3), rot=4)
        return (oq * a).sum() + (ok * b).sum()

    torch.testing.assert_close(grad(loss)(params, q, k, a, b), grad(loss_ref)(params, q, k, a, b),
                               rtol=1e-10, atol=1e-10)
    # Per-sample gradients of the parameters: 2 samples of (1, 3, heads, 8).
    per = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(params, q[:, None], k[:, None], a[:, None], b[:, None])
    for i in range(2):
        sl = slice(i, i + 1)
        want = grad(loss_ref)(params, q[sl], k[sl], a[sl], b[sl])
        torch.testing.assert_close({n: t[i] for n, t in per.items()}, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["apply_rope_cos_sin", "qk_norm_rope"])
def test_compile_vmap_grad_fullgraph(op):
    torch._dynamo.reset()
    if op == "apply_rope_cos_sin":
        q, k, cos, sin = cos_sin_inputs("bhsd", d=8, rot=4, table_batch=1, seed=11)

        def f(x):
            oq, ok = apply_rope_cos_sin(x, k, cos, sin)
            return oq.square().sum() + ok.sum()

        def ref(x):
            return hf_apply(x, cos, sin, "bhsd", False).square().sum()
    else:
        q, k, wq, wk = qk_inputs("bshd", "head", seed=12)

        def f(x):
            oq, ok = qk_norm_rope(x, k, wq, wk, offset=1)
            return oq.square().sum() + ok.sum()

        def ref(x):
            return qk_reference(x, k, wq, wk, eps=1e-6, offset=0.0, norm="head", layout="bshd",
                                pos=torch.arange(1, 4).expand(2, 3), rot=8)[0].square().sum()
    xs = torch.stack([q, q * 0.5, q + 1])
    compiled = torch.compile(vmap(grad(f)), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(xs), vmap(grad(ref))(xs), rtol=1e-9, atol=1e-9)


def test_rope_cos_sin_under_vmap_of_positions():
    """rope_cos_sin under vmap over positions: per sample for the types that do not read the
    longest position; "dynamic" and "longrope", which do (a host value), are refused by name
    (torch's message was that .item() under vmap is a bug to file with PyTorch)."""
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 100], [4, 5, 6, 7]])
    cos, sin = vmap(lambda p: posenc.functional.rope_cos_sin(p, 8))(pos)
    for i in range(3):
        c, s = posenc.functional.rope_cos_sin(pos[i], 8)
        assert torch.equal(cos[i], c) and torch.equal(sin[i], s)
    for scaling in ({"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8},
                    {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 8,
                     "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]}):
        with pytest.raises(RuntimeError, match=f"rope_cos_sin: rope_type '{scaling['rope_type']}' scales by the "
                                               "call's longest position, which a vmap over positions cannot read"):
            vmap(lambda p, scaling=scaling: posenc.functional.rope_cos_sin(p, 8, scaling=scaling))(pos)
        with pytest.raises(RuntimeError, match="a vmap over positions cannot read"):  # under grad's wrapper too
            vmap(grad(lambda w, p, scaling=scaling: (posenc.functional.rope_cos_sin(p * 1, 8, scaling=scaling)[0]
                                                     * w).sum()), in_dims=(None, 0))(torch.ones(4, 8), pos)
