"""torch.func transforms and forward-mode AD through the rope op (apply_rope in every form,
the module), against the same transforms of the float64 references written from the
formulas (rope_reference.py, multi_axis_reference.py). The derivatives are the op's own
(csrc/ops/rope/autograd.cpp): one C++ definition for autograd, torch.func and forward AD."""

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jvp, vmap

import posenc
from posenc.functional import apply_rope
from func_transforms import check_transforms, gradcheck_all
from multi_axis_reference import generic_inv_freq_and_axis, generic_multi_axis_rope
from rope_reference import reference_inv_freq, reference_rope, rotate_half, thd_positions

F64 = torch.float64


def joined(*outs):
    return torch.cat([o.reshape(-1) for o in outs])


def grid(b, s, offset=0):
    return (torch.arange(s) + offset).expand(b, s)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts_q_and_gqa_k(layout, interleaved):
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 3, 2, 1, 6
    shape = {"bshd": lambda h: (b, s, h, d), "bhsd": lambda h: (b, h, s, d), "sbhd": lambda h: (s, b, h, d)}[layout]
    q, k = torch.randn(shape(hq), dtype=F64), torch.randn(shape(hk), dtype=F64)
    inv, _ = reference_inv_freq(d)
    pos = grid(b, s, offset=2)

    def f(q, k):
        return joined(*apply_rope(q, k, layout=layout, interleaved=interleaved, offset=2))

    def ref(q, k):
        return joined(reference_rope(q, layout, pos, inv, d, interleaved), reference_rope(k, layout, pos, inv, d,
                                                                                           interleaved))

    check_transforms(f, ref, (q, k), batch_inputs=(torch.randn(3, *q.shape, dtype=F64), k))


@pytest.mark.parametrize("kwargs,ref_kwargs", [
    (dict(rotary_dim=4), dict(rotary_dim=4)),
    (dict(scaling={"rope_type": "linear", "factor": 2.0}), dict(scaling={"rope_type": "linear", "factor": 2.0})),
    (dict(scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
     dict(scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})),
])
def test_partial_rotary_and_scaling_q_alone(kwargs, ref_kwargs):
    torch.manual_seed(1)
    b, s, h, d = 2, 4, 2, 8
    q = torch.randn(b, s, h, d, dtype=F64)
    positions = torch.tensor([[0, 5, 9, 3], [1, 1, 7, 2]])
    rot = ref_kwargs.get("rotary_dim", d)
    inv, attn = reference_inv_freq(rot, scaling=ref_kwargs.get("scaling"))

    def f(q):
        return apply_rope(q, positions=positions, **kwargs)

    def ref(q):
        return reference_rope(q, "bshd", positions, inv, rot, False, attn)

    check_transforms(f, ref, (q,))


def test_rotary_offset_and_packed_thd():
    torch.manual_seed(2)
    cu = torch.tensor([0, 2, 5])
    q, k = torch.randn(5, 2, 10, dtype=F64), torch.randn(5, 1, 10, dtype=F64)
    pos = thd_positions(cu)
    inv, _ = reference_inv_freq(6)

    def ref_one(x):  # rotary features [4, 10): the first 4 pass through
        rotated = reference_rope(x[..., 4:], "thd", pos, inv, 6, False)
        return torch.cat([x[..., :4], rotated], -1)

    def f(q, k):
        return joined(*apply_rope(q, k, layout="thd", cu_seqlens=cu, rotary_offset=4))

    check_transforms(f, lambda q, k: joined(ref_one(q), ref_one(k)), (q, k),
                     batch_inputs=(torch.randn(2, *q.shape, dtype=F64), k))


def test_multi_axis():
    torch.manual_seed(3)
    b, s, h, d = 1, 6, 2, 12
    q = torch.randn(b, s, h, d, dtype=F64)
    positions = torch.stack([torch.arange(s) // 3, torch.arange(s) % 3, torch.arange(s)])  # (3, seq)
    sections = [1, 2, 3]

    def f(q):
        return apply_rope(q, positions=positions, sections=sections, sections_mode="mrope")

    inv, axis = generic_inv_freq_and_axis(sections, "mrope", 10000.0)
    angle = positions.to(F64)[axis].T * inv  # (seq, pairs): each pair turns with its axis' position
    emb = torch.cat([angle, angle], -1)[None, :, None, :]

    def ref(q):  # rotate_half form (the shared reference writes with index_put_, which vmap refuses)
        xr, xp = q[..., :12], q[..., 12:]
        return torch.cat([xr * emb.cos() + rotate_half(xr) * emb.sin(), xp], -1)

    torch.testing.assert_close(ref(q), generic_multi_axis_rope(q, positions, sections, "mrope", 10000.0, False))
    check_transforms(f, ref, (q,))


def test_gradcheck_with_forward_ad_and_batched_grads():
    torch.manual_seed(4)
    q, k = torch.randn(1, 3, 2, 4, dtype=F64), torch.randn(1, 3, 1, 4, dtype=F64)
    gradcheck_all(lambda q, k: apply_rope(q, k, offset=1, interleaved=True), (q, k))
    gradcheck_all(lambda q: apply_rope(q, positions=torch.tensor([[4, 0, 2]]), rotary_dim=2), (q,))


def test_the_module_under_grad_vmap_and_jvp():
    torch.manual_seed(5)
    rope = posenc.RotaryPositionalEncoding(8, max_len=32)
    q = torch.randn(3, 2, 5, 2, 8, dtype=F64)  # a batch of 3 samples of (2, 5, 2, 8)
    inv, _ = reference_inv_freq(8)
    pos = grid(2, 5)
    w = torch.randn(2, 5, 2, 8, dtype=F64)
    per_sample = vmap(grad(lambda x: (rope(x) * w).sum()))(q)
    want = torch.stack([grad(lambda x: (reference_rope(x, "bshd", pos, inv, 8, False) * w).sum())(x) for x in q])
    torch.testing.assert_close(per_sample, want, rtol=1e-12, atol=1e-12)
    t = torch.randn_like(q[0])
    out, tangent = jvp(rope, (q[0],), (t,))
    torch.testing.assert_close(tangent, rope(t), rtol=0, atol=0)  # the tangent is the op itself


def test_the_module_under_vmap_with_batched_positions():
    """Per-sample positions through the module: its eager range check (op
    rope_position_bounds) had no batching rule (RuntimeError), where apply_rope worked. The
    check looks at every sample's positions: one out of range is the module's IndexError."""
    rope = posenc.RotaryPositionalEncoding(8, max_len=32)
    q = torch.randn(3, 1, 5, 2, 8, dtype=F64)
    pos = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(2))
    got = vmap(lambda x, p: rope(x, positions=p))(q, pos)
    inv, _ = reference_inv_freq(8)
    for i in range(3):
        torch.testing.assert_close(got[i], reference_rope(q[i], "bshd", pos[i].expand(1, 5), inv, 8, False),
                                   rtol=1e-12, atol=1e-12)
    pos[1, 3] = 32
    with pytest.raises(IndexError, match="32"):
        vmap(lambda x, p: rope(x, positions=p))(q, pos)


def test_vmap_over_per_sample_tensor_offsets():
    """A 0-dim offset batched by vmap (one decode offset per sample): its pinned-memory test
    had no batching rule (RuntimeError), in apply_rope, qk_norm_rope and the module alike."""
    q, k = torch.randn(3, 1, 4, 2, 6, dtype=F64), torch.randn(3, 1, 4, 1, 6, dtype=F64)
    offsets = torch.tensor([0, 5, 2])
    rope = posenc.RotaryPositionalEncoding(6, max_len=16)
    w = torch.randn(6, dtype=F64)
    inv, _ = reference_inv_freq(6)
    for f in (lambda a, b, o: apply_rope(a, b, offset=o), lambda a, b, o: rope(a, b, offset=o)):
        got_q, got_k = vmap(f)(q, k, offsets)
        for i in range(3):
            pos = grid(1, 4, offset=int(offsets[i]))
            torch.testing.assert_close(got_q[i], reference_rope(q[i], "bshd", pos, inv, 6, False), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got_k[i], reference_rope(k[i], "bshd", pos, inv, 6, False), rtol=1e-12, atol=1e-12)
    got_q, got_k = vmap(lambda a, b, o: posenc.functional.qk_norm_rope(a, b, w, w, offset=o))(q, k, offsets)
    for i in range(3):
        want_q, want_k = posenc.functional.qk_norm_rope(q[i], k[i], w, w, offset=int(offsets[i]))
        assert torch.equal(got_q[i], want_q) and torch.equal(got_k[i], want_k)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 8,
     "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]},
])
@pytest.mark.parametrize("index", ["positions", "offset"])
def test_the_module_under_vmap_scales_each_sample_by_its_own_length(scaling, index):
    """A length-scaled type ("dynamic", "longrope") under vmap over per-sample positions or
    offsets: each sample's frequencies follow its own longest position, as a loop over the
    samples gives. The module passed the longest position its range check had read, which
    under vmap is the batch's: every sample took the frequencies of the longest one (0.6-4.7
    off in the forward, 0.3-6 in per-sample gradients; found by an audit). apply_rope was
    right."""
    rope = posenc.RotaryPositionalEncoding(8, max_len=128, scaling=scaling)
    q = torch.randn(3, 1, 4, 2, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(1, 4, 2, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    if index == "positions":
        idx = torch.tensor([[[0, 1, 2, 3]], [[0, 1, 2, 100]], [[4, 5, 6, 7]]])  # longest: 3, 100, 7
        f = lambda x, p: rope(x, positions=p)  # noqa: E731
    else:
        idx = torch.tensor([0, 97, 4])
        f = lambda x, o: rope(x, offset=o)  # noqa: E731
    for g in (f, lambda x, i: apply_rope(x, **({"positions": i} if index == "positions" else {"offset": i}),
                                         scaling=scaling)):
        got = vmap(g)(q, idx)
        got_grad = vmap(grad(lambda x, i, g=g: (g(x, i) * w).sum()))(q, idx)
        for i in range(3):
            assert torch.equal(got[i], g(q[i], idx[i]))
            assert torch.equal(got_grad[i], grad(lambda x, g=g, i=i: (g(x, idx[i]) * w).sum())(q[i]))


def test_vmap_of_the_in_place_ops_is_refused():
    """What docs/guide/func.md says: the ops that write in place have no batching rule, and
    vmap says so (PyTorch's RuntimeError), never a silent per-sample write."""
    q, k = torch.randn(2, 1, 3, 2, 8), torch.randn(2, 1, 3, 1, 8)
    calls = {
        "rope_": lambda q, k: apply_rope(q.clone(), k.clone(), inplace=True),
        "rope_append_kv": lambda q, k: posenc.functional.rope_append_kv(q, k, k, torch.zeros(1, 8, 1, 8),
                                                                      torch.zeros(1, 8, 1, 8)),
        "rope_shift_kv_": lambda q, k: posenc.functional.rope_shift_kv(k.clone(), torch.arange(3), torch.arange(3) + 1),
    }
    for op, f in calls.items():
        with pytest.raises(RuntimeError, match=f"Batching rule not implemented for posenc::{op}"):
            vmap(f)(q, k)


def test_inplace_refuses_gradients_and_tangents():
    q = torch.randn(1, 2, 1, 4, dtype=F64)
    with pytest.raises(RuntimeError, match="inplace=True rotates q and k in their own storage"):
        grad(lambda x: apply_rope(x.clone(), inplace=True).sum())(q)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q.clone(), torch.ones_like(q))
        # Under no_grad too (it does not turn forward AD off): the advice is forward AD's own.
        for mode in (torch.enable_grad, torch.no_grad):
            with mode(), pytest.raises(RuntimeError, match="inplace=True rotates q and k in their own storage, "
                                       "which cannot carry their forward-mode AD tangents .* use inplace=False$"):
                apply_rope(dual, inplace=True)
    with torch.no_grad():  # inference: allowed, and the version counter moves
        x = q.clone()
        v = x._version
        apply_rope(x, inplace=True)
        assert x._version > v


def test_inplace_writes_into_captured_tensors_are_refused_under_grad_transforms():
    """A function transformed by torch.func.grad / vjp / jvp that saves a captured tensor for a
    gradient and then writes it in place with an in-place posenc op: the gradient would
    silently use the overwritten values (torch.func's own check reads only schemas returning
    their first argument). Refused as torch.func refuses ATen's in-place ops on captures, views
    of captures too; a tensor the function made itself is written, with the right gradient."""
    w = torch.randn(1, 3, 2, 4, dtype=F64)
    q = torch.randn(1, 3, 2, 4, dtype=F64)
    ones = torch.ones(4, dtype=F64)
    F = posenc.functional
    writes = {
        "apply_rope": (lambda t: F.apply_rope(t, offset=5, inplace=True), "q"),
        "qk_norm_rope": (lambda t: F.qk_norm_rope(t, t[:, :, :1].clone(), ones, ones, inplace=True), "q"),
        "rope_shift_kv": (lambda t: F.rope_shift_kv(t, torch.arange(3), torch.arange(3) + 7), "k_cache"),
        "rope_append_kv": (lambda t: F.rope_append_kv(q[:, :1].clone(), q[:, :1].clone(), q[:, :1].clone(), t,
                                                      torch.zeros_like(t), offset=1), "k_cache"),
    }
    for fn, (write, name) in writes.items():
        def f(w, of=lambda t: t, write=write):
            y = (w * q).sum()  # saves q
            write(of(q))
            return y

        message = f"{fn}: would write {name} in place, a tensor captured by a torch.func transform"
        before = q.clone()
        with pytest.raises(RuntimeError, match=message):
            grad(f)(w)
        with pytest.raises(RuntimeError, match=message):  # a view of the captured tensor
            grad(f)(w, lambda t: t[:, 1:])
        with pytest.raises(RuntimeError, match=message):
            torch.func.vjp(f, w)
        with pytest.raises(RuntimeError, match=message):
            jvp(f, (w,), (torch.ones_like(w),))
        assert torch.equal(q, before)  # refused before anything was written

        def g(w, write=write):  # a tensor of its own: written, and then read with its new values
            own = q.clone()
            write(own)
            return (w * own).sum()

        written = q.clone()
        with torch.no_grad():
            write(written)
        assert not torch.equal(written, q) and torch.equal(grad(g)(w), written)
    with torch.no_grad():  # outside torch.func: writing a captured tensor is the caller's business
        F.apply_rope(q.clone(), inplace=True)


def test_tangents_of_their_own_dtypes():
    """Forward AD takes a tangent of another floating dtype than its primal's (plain torch ops
    carry it): q's and k's tangents of two dtypes are rotated each in its own (the formula's one
    fused call refused them: "expected k to have q's dtype"), apply_rope_cos_sin's too."""
    q, k = torch.randn(1, 3, 2, 8, dtype=torch.float16), torch.randn(1, 3, 1, 8, dtype=torch.float16)
    tq, tk = torch.randn(q.shape), torch.randn(k.shape, dtype=torch.float16)
    cos, sin = posenc.functional.rope_cos_sin(torch.arange(3), 8)
    calls = {"apply_rope": lambda q, k: apply_rope(q, k),
             "apply_rope_cos_sin": lambda q, k: posenc.functional.apply_rope_cos_sin(q, k, cos, sin, layout="bshd")}
    for name, call in calls.items():
        with forward_ad.dual_level():
            oq, ok = call(forward_ad.make_dual(q, tq), forward_ad.make_dual(k, tk))
            gq, gk = forward_ad.unpack_dual(oq).tangent, forward_ad.unpack_dual(ok).tangent
        assert (gq.dtype, gk.dtype) == (torch.float32, torch.float16), name
        assert torch.equal(gq, call(tq, tq[:, :, :1])[0]) and torch.equal(gk, call(tk, tk)[1]), name


def test_a_missing_output_gradient_is_zero():
    """Only k's output used: q's gradient is zero (an undefined gradient, not an error)."""
    q = torch.randn(1, 3, 2, 4, dtype=F64, requires_grad=True)
    k = torch.randn(1, 3, 1, 4, dtype=F64, requires_grad=True)
    _, ok = apply_rope(q, k)
    gq, gk = torch.autograd.grad(ok.sum(), (q, k), allow_unused=True)
    assert gq is None or torch.count_nonzero(gq) == 0
    inv, _ = reference_inv_freq(4)
    want = torch.autograd.grad(reference_rope(k, "bshd", grid(1, 3), inv, 4, False).sum(), k)[0]
    torch.testing.assert_close(gk, want, rtol=1e-12, atol=1e-12)


def test_compile_vmap_grad_fullgraph():
    torch._dynamo.reset()
    rope = posenc.RotaryPositionalEncoding(8, max_len=16)
    w = torch.randn(4, 2, 8)

    def loss(x):
        return (rope(x) * w).square().sum()

    f = torch.compile(vmap(grad(loss)), fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 1, 4, 2, 8)
    torch.testing.assert_close(f(x), vmap(grad(loss))(x))


def test_per_sample_gradients_of_a_tiny_transformer_with_functional_call():
    """Opacus-style per-sample gradients: vmap(grad) over a model holding a learned table
    and RoPE, against a loop of ordinary backward passes."""
    torch.manual_seed(6)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pe = posenc.LearnedPositionalEncoding(8, max_len=16, dropout=0.0)
            self.qk = torch.nn.Linear(8, 16, dtype=F64)
            self.rope = posenc.RotaryPositionalEncoding(4, max_len=16)

        def forward(self, x):  # x: (seq, 8) one sample
            h = self.pe(x[None])  # (1, seq, 8)
            q, k = self.qk(h).view(1, -1, 4, 4).chunk(2, dim=2)
            q, k = self.rope(q, k)
            return torch.einsum("bshd,bthd->bhst", q, k).softmax(-1).sum()

    model = Tiny().double()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(3, 5, 8, dtype=F64)
    per_sample = vmap(grad(lambda p, xi: functional_call(model, p, (xi,))), in_dims=(None, 0))(params, x)
    for i in range(3):
        model.zero_grad()
        model(x[i]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
def test_vmap_batch_rule_one_fused_call(layout, no_vmap_fallback):
    """vmap folds the samples into the heads: one call, no per-sample fallback loop (which
    the fixture turns into an error), same numbers as a loop of calls."""
    torch.manual_seed(7)
    shape = {"bshd": (2, 3, 2, 6), "bhsd": (2, 2, 3, 6), "sbhd": (3, 2, 2, 6), "thd": (5, 2, 6)}[layout]
    kw = dict(layout=layout, cu_seqlens=torch.tensor([0, 2, 5])) if layout == "thd" else dict(layout=layout)
    q = torch.randn(4, *shape, dtype=F64)
    k = torch.randn(*shape, dtype=F64)  # not batched: expanded inside
    out_q, out_k = vmap(lambda q: apply_rope(q, k, offset=1, **kw))(q)
    for i in range(4):
        want_q, want_k = apply_rope(q[i], k, offset=1, **kw)
        assert torch.equal(out_q[i], want_q) and torch.equal(out_k[i], want_k)
    out = vmap(lambda x: apply_rope(x, **kw), in_dims=1)(q.movedim(0, 1))
    for i in range(4):
        assert torch.equal(out[i], apply_rope(q[i], **kw))


def test_vmap_with_batched_positions_loops_over_samples():
    torch.manual_seed(8)
    q = torch.randn(3, 1, 4, 2, 6, dtype=F64)
    positions = torch.randint(0, 50, (3, 1, 4))
    out = vmap(lambda x, p: apply_rope(x, positions=p))(q, positions)
    for i in range(3):
        assert torch.equal(out[i], apply_rope(q[i], positions=positions[i]))


def test_vmap_rules_of_the_other_rope_ops_fold_into_the_heads(no_vmap_fallback):
    """apply_rope_cos_sin and qk_norm_rope (norm "head") under vmap: one fused call, no
    per-sample fallback, the same numbers as a loop; norm "hidden" (spanning a token's
    heads) and batched tables or weights take one call per sample."""
    from posenc.functional import apply_rope_cos_sin, qk_norm_rope, rope_cos_sin

    torch.manual_seed(9)
    q = torch.randn(3, 2, 4, 5, 8, dtype=F64)  # 3 samples of bhsd (2, 4, 5, 8)
    k = torch.randn(2, 2, 5, 8, dtype=F64)
    cos, sin = rope_cos_sin(torch.arange(5), 8, dtype=F64)
    out_q, out_k = vmap(lambda x: apply_rope_cos_sin(x, k, cos, sin))(q)
    for i in range(3):
        want_q, want_k = apply_rope_cos_sin(q[i], k, cos, sin)
        assert torch.equal(out_q[i], want_q) and torch.equal(out_k[i], want_k)
    qs = q.transpose(2, 3)  # bshd samples
    w, wk = torch.rand(8, dtype=F64) + 0.5, torch.rand(8, dtype=F64) + 0.5
    ks = k.transpose(1, 2)
    hidden = (torch.rand(32, dtype=F64) + 0.5, torch.rand(16, dtype=F64) + 0.5)
    for norm, wq_, wk_ in (("head", w, wk), ("hidden", *hidden)):
        a, b = vmap(lambda x, wq_=wq_, wk_=wk_, norm=norm: qk_norm_rope(x, ks, wq_, wk_, norm=norm, offset=2))(qs)
        for i in range(3):
            want_a, want_b = qk_norm_rope(qs[i], ks, wq_, wk_, norm=norm, offset=2)
            assert torch.equal(a[i], want_a) and torch.equal(b[i], want_b)
    ws = torch.rand(3, 8, dtype=F64) + 0.5  # batched weights (an ensemble): one call per sample
    a, _ = vmap(lambda x, wq: qk_norm_rope(x, ks, wq, wk))(qs, ws)
    for i in range(3):
        assert torch.equal(a[i], qk_norm_rope(qs[i], ks, ws[i], wk)[0])


def test_vmap_and_jacobians_of_zero_samples_and_zero_elements():
    """A vmap batch of 0 samples (and so jacfwd / jacrev of a zero-element q) gives empty
    results of the shapes torch's own ops give; the fold into the heads could not infer the
    heads of an empty output (an internal unflatten error), nor stack zero per-sample calls."""
    from torch.func import jacfwd, jacrev
    from posenc.functional import apply_rope_cos_sin, qk_norm_rope

    q = torch.randn(0, 1, 3, 2, 4, dtype=F64)  # 0 samples of bshd (1, 3, 2, 4)
    k = torch.randn(0, 1, 3, 1, 4, dtype=F64)
    cos, sin = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    w = torch.ones(4, dtype=F64)
    for fn in (lambda x, y: apply_rope(x, y), lambda x, y: apply_rope_cos_sin(x, y, cos, sin, layout="bshd"),
               lambda x, y: qk_norm_rope(x, y, w, w)):
        out_q, out_k = vmap(fn)(q, k)
        assert out_q.shape == (0, 1, 3, 2, 4) and out_k.shape == (0, 1, 3, 1, 4)
    positions = torch.zeros(0, 1, 3, dtype=torch.long)  # batched positions: the per-sample path
    out = vmap(lambda x, p: apply_rope(x, positions=p))(q, positions)
    assert out.shape == (0, 1, 3, 2, 4)
    q0 = torch.randn(1, 0, 2, 4, dtype=F64)
    for jac in (jacfwd, jacrev):
        assert jac(lambda x: apply_rope(x))(q0).shape == jac(torch.sin)(q0).shape == (1, 0, 2, 4, 1, 0, 2, 4)
