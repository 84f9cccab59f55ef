"""rotary_offset: the rotary features start at feature rotary_offset ([nope | rope] heads,
DeepSeek's layout) in every RoPE op, front end and backend, against a float64 reference
that rotates the slice and passes the rest through."""

import pytest
import torch
from torch.library import opcheck

import posenc
from aten_fallback_mode import ThroughTheFallback
from conftest import DEVICES
from posenc.functional import apply_rope, qk_norm_rope, rope_append_kv
from rope_reference import reference_inv_freq, reference_rope, to_bshd
from test_qk_norm_rope import MODELS, make, reference_norm

F64 = torch.float64
LAYOUT_SHAPES = {"bshd": lambda B, S, H, D: (B, S, H, D), "bhsd": lambda B, S, H, D: (B, H, S, D),
                 "sbhd": lambda B, S, H, D: (S, B, H, D)}


def reference_offset_rope(x, layout, pos, *, begin, rot, interleaved=False, base=10000.0, scaling=None):
    """float64: features [begin, begin + rot) of x rotated as plain RoPE of width rot, the
    others passed through."""
    inv_freq, attn = reference_inv_freq(rot, base, scaling, 0)
    x = x.to(F64)
    head, tail = x[..., :begin], x[..., begin:]
    rotated = reference_rope(tail, layout, pos, inv_freq, rot, interleaved, attn)
    return torch.cat((head, rotated), dim=-1)


def positions_of(q, layout):
    b, s = to_bshd(q, layout).shape[:2]
    return torch.arange(s).expand(b, s)


def tolerance(dtype):
    return {F64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2),
            torch.float16: (2e-3, 2e-3)}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("begin,rot,D", [(128 - 64, 64, 128), (6, 4, 14), (2, None, 10), (0, 8, 8), (3, 2, 9)])
def test_apply_rope_rotates_the_slice(device, dtype, layout, interleaved, begin, rot, D):
    torch.manual_seed(0)
    B, S, Hq, Hk = 2, 5, 3, 1
    q = torch.randn(LAYOUT_SHAPES[layout](B, S, Hq, D), dtype=F64).to(device, dtype)
    k = torch.randn(LAYOUT_SHAPES[layout](B, S, Hk, D), dtype=F64).to(device, dtype)
    width = D - begin if rot is None else rot
    out_q, out_k = apply_rope(q, k, layout=layout, interleaved=interleaved, rotary_dim=rot, rotary_offset=begin)
    pos = positions_of(q, layout)
    for x, y in ((q, out_q), (k, out_k)):
        want = reference_offset_rope(x.cpu(), layout, pos, begin=begin, rot=width, interleaved=interleaved)
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(y.cpu().to(F64), want, atol=atol, rtol=rtol)
        # The features outside the rotary part are copied bit for bit.
        assert torch.equal(y[..., :begin], x[..., :begin])
        assert torch.equal(y[..., begin + width:], x[..., begin + width:])


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_offset_views_and_positions(device):
    torch.manual_seed(1)
    base = torch.randn(3, 7, 4, 2 * 24, dtype=torch.float32, device=device)
    q = base[1:, :, :, ::2]  # strided last dim, offset storage
    pos = torch.randint(0, 4096, (2, 7), device=device)
    out = apply_rope(q, positions=pos, rotary_offset=8, rotary_dim=12, base=500000.0)
    want = reference_offset_rope(q.cpu(), "bshd", pos.cpu(), begin=8, rot=12, base=500000.0)
    torch.testing.assert_close(out.cpu().to(F64), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}])
def test_scaling_types(device, scaling):
    torch.manual_seed(2)
    q = torch.randn(1, 9, 2, 20, dtype=F64, device=device)
    out = apply_rope(q, rotary_offset=4, scaling=scaling)
    want = reference_offset_rope(q.cpu(), "bshd", positions_of(q, "bshd"), begin=4, rot=16, scaling=scaling)
    torch.testing.assert_close(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_thd(device):
    torch.manual_seed(3)
    q = torch.randn(6, 2, 12, dtype=F64, device=device)
    cu = torch.tensor([0, 2, 6], device=device)
    out = apply_rope(q, layout="thd", cu_seqlens=cu, rotary_offset=4)
    pos = torch.tensor([[0, 1, 0, 1, 2, 3]])
    want = reference_offset_rope(q.cpu().unsqueeze(0), "bshd", pos, begin=4, rot=8).squeeze(0)
    torch.testing.assert_close(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_and_autograd(device):
    torch.manual_seed(4)
    q = torch.randn(2, 3, 2, 10, dtype=F64, device=device)
    want = apply_rope(q, rotary_offset=2, rotary_dim=6)
    inplace = q.clone()
    apply_rope(inplace, rotary_offset=2, rotary_dim=6, inplace=True)
    assert torch.equal(inplace, want)
    x = q.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, rotary_offset=2, rotary_dim=6), (x,))
    assert torch.autograd.gradgradcheck(lambda t: apply_rope(t, rotary_offset=2, rotary_dim=6), (x,))


def test_aten_fallback_computes_what_the_kernels_do():
    torch.manual_seed(5)
    q = torch.randn(2, 4, 3, 14, dtype=torch.float32)
    k = torch.randn(2, 4, 1, 14, dtype=torch.float32)
    want = apply_rope(q, k, rotary_offset=6, rotary_dim=4, interleaved=True)
    with ThroughTheFallback() as mode:
        got = apply_rope(q, k, rotary_offset=6, rotary_dim=4, interleaved=True)
    assert mode.calls.get("posenc::rope", 0) == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_qk_norm_rope_normalises_the_head_and_rotates_the_slice(device, model):
    norm, offset, eps = MODELS[model]
    q, k, wq, wk = make(2, 4, 4, 2, 12, F64, device, norm)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, norm=norm, weight_offset=offset, eps=eps, rotary_offset=4)
    for x, w, y in ((q, wq, out_q), (k, wk, out_k)):
        normed = reference_norm(x, w, eps, offset, norm, "bshd")
        want = reference_offset_rope(normed.cpu(), "bshd", positions_of(x, "bshd"), begin=4, rot=8)
        torch.testing.assert_close(y.cpu(), want)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    assert torch.autograd.gradcheck(
        lambda *a: qk_norm_rope(*a, norm=norm, weight_offset=offset, eps=1e-3, rotary_offset=4, rotary_dim=6),
        inputs)


@pytest.mark.parametrize("rotary_offset,rotary_dim", [(8, 16), (4, 6), (16, 8), (0, 24), (0, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_low_precision_backward_turns_back_only_the_slice(rotary_offset, rotary_dim, dtype):
    """The backward's vector path (float32 arithmetic, contiguous rows of 4 heads at a time)
    reads the gradient's rotary slice straight from its row and copies the features around
    it: against the float64 gradients of the same call."""
    torch.manual_seed(rotary_offset + rotary_dim)
    q, k = torch.randn(2, 3, 5, 24, dtype=dtype), torch.randn(2, 3, 4, 24, dtype=dtype)
    wq, wk = 1 + 0.1 * torch.randn(24, dtype=dtype), 1 + 0.1 * torch.randn(24, dtype=dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    grads = []
    for t in (dtype, F64):
        ins = [x.to(t).requires_grad_(True) for x in (q, k, wq, wk)]
        outs = qk_norm_rope(*ins, rotary_offset=rotary_offset, rotary_dim=rotary_dim)
        grads.append(torch.autograd.grad(outs, ins, (gq.to(t), gk.to(t))))
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (3e-2, 3e-2)
    for got, want in zip(*grads):
        torch.testing.assert_close(got.to(F64), want, atol=atol * max(1.0, want.abs().max().item()), rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_append_kv_writes_the_rotated_slice(device):
    torch.manual_seed(6)
    q = torch.randn(2, 3, 4, 12, device=device)
    k = torch.randn(2, 3, 2, 12, device=device)
    v = torch.randn(2, 3, 2, 12, device=device)
    kc = torch.zeros(2, 8, 2, 12, device=device)
    vc = torch.zeros(2, 8, 2, 12, device=device)
    out_q, out_k = rope_append_kv(q, k, v, kc, vc, offset=5, rotary_offset=4, return_k=True)
    want_q, want_k = apply_rope(q, k, offset=5, rotary_offset=4)
    assert torch.equal(out_q, want_q)
    assert torch.equal(out_k, want_k)
    assert torch.equal(kc[:, 5:8], want_k)
    assert torch.equal(vc[:, 5:8], v)


def test_modules_take_it():
    torch.manual_seed(7)
    q = torch.randn(2, 5, 3, 16)
    k = torch.randn(2, 5, 1, 16)
    rope = posenc.RotaryPositionalEncoding(16, max_len=64, rotary_offset=10)
    assert rope.rotary_dim == 6 and dict(rope.rope_config.settings) == {"rotary_offset": 10}
    for a, b in zip(rope(q, k), apply_rope(q, k, rotary_offset=10)):
        assert torch.equal(a, b)
    m = posenc.QKNormRotary(16, rotary_offset=8)
    wq, wk = m.q_norm.weight, m.k_norm.weight
    for a, b in zip(m(q, k), qk_norm_rope(q, k, wq, wk, rotary_offset=8)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    (dict(rotary_offset=-1), "rotary part to start inside the head"),
    (dict(rotary_offset=8), "rotary part to start inside the head"),
    (dict(rotary_offset=4, rotary_dim=6), r"rotary features \[4, 10\)"),
])
def test_bad_values_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rope(torch.randn(1, 2, 1, 8), **kwargs)
    with pytest.raises(TypeError, match="rotary_offset"):
        apply_rope(torch.randn(1, 2, 1, 8), rotary_offset=1.5)


def test_one_declaration_reaches_every_front_end():
    """The plain settings of the schema (POSENC_ROPE_SETTINGS) are what Python's RoPE
    functions and modules take as keywords: declared once, in C++."""
    import inspect

    schema_names = [a.name for a in torch.ops.posenc.rope.default._schema.arguments]
    plain = schema_names[schema_names.index("sections_mode") + 1:]
    assert plain == ["rotary_offset"]
    for fn in (apply_rope, qk_norm_rope, rope_append_kv, posenc.RotaryPositionalEncoding, posenc.QKNormRotary):
        params = inspect.signature(fn).parameters
        assert all(name in params for name in plain), fn
    for op in (torch.ops.posenc.rope_.default, torch.ops.posenc.qk_norm_rope.default,
               torch.ops.posenc.rope_append_kv.default):
        assert "rotary_offset" in [a.name for a in op._schema.arguments], op


def test_opcheck():
    q = torch.randn(2, 3, 2, 12, requires_grad=True)
    k = torch.randn(2, 3, 1, 12, requires_grad=True)
    opcheck(torch.ops.posenc.rope.default, (q, k), dict(rotary_offset=4, rotary_dim=6))


def test_compile_fullgraph_and_export():
    q = torch.randn(2, 3, 2, 12)
    want = apply_rope(q, rotary_offset=4)
    compiled = torch.compile(lambda t: apply_rope(t, rotary_offset=4), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q), want)

    class M(torch.nn.Module):
        def forward(self, t):
            return apply_rope(t, rotary_offset=4)

    exported = torch.export.export(M(), (q,))
    assert torch.equal(exported.module()(q), want)
