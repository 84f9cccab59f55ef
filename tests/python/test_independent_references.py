"""Independent float64 references for (op, feature) pairs whose expected numbers came only from
posenc itself (a test-coverage audit): the RMSNorm and the rotation written here (or taken
from the plain-PyTorch reference modules), never posenc's functions.

1. qk_norm_rope with the RoPE settings its own tests checked only through apply_rope or not
   at all: linear, llama3, dynamic and longrope (the call's longest position sets the scale),
   proportional, multi-axis axial / mrope_interleaved, rotary_offset with a scaled width.
2. rope_append_kv with QK-norm ("QK-norm straight into the cache") and those settings: q, the
   returned k and the cache rows against the norm-then-rotate formula.
3. MLA's latent cache ``[kv_c | k_pe]`` and the in-place q_pe (test_rope_append_kv_mla.py took
   its expected q_pe / k_pe from posenc's apply_rope): GPT-J adjacent pairs written as complex
   products, DeepSeek's yarn attention factor included.
"""

import math

import pytest
import torch

import posenc  # noqa: F401
from multi_axis_reference import generic_multi_axis_rope
from posenc.functional import qk_norm_rope, rope_append_kv
from rope_reference import default_inv_freq, formula_inv_freq, reference_inv_freq

F64 = torch.float64


# --- the formulas ----------------------------------------------------------------------------


def rms_norm64(x, w, eps, weight_offset, norm):
    """x (B, S, H, D): x * rsqrt(mean(x**2) + eps) * (w + weight_offset) in float64, over each
    head's vector ("head") or each token's whole projection ("hidden", w heads-major)."""
    x, w = x.to(F64), w.to(F64)
    if norm == "head":
        ms, wv = x.pow(2).mean(-1, keepdim=True), w
    else:
        ms, wv = x.pow(2).mean((-2, -1), keepdim=True), w.view(x.shape[-2], x.shape[-1])
    return x * torch.rsqrt(ms + eps) * (wv + weight_offset)


def rotate64(x, pos, inv, attn, begin, rot, interleaved):
    """x (B, S, H, D) float64: features [begin, begin + rot) turned by pos * inv (pairs (i,
    i + rot/2), or (2i, 2i + 1) when interleaved), times attn; the others as they are."""
    angle = pos.to(F64)[..., None, None] * inv  # (B, S, 1, rot/2)
    c, s = angle.cos() * attn, angle.sin() * attn
    part = x[..., begin:begin + rot]
    half = rot // 2
    idx = torch.arange(half)
    i1, i2 = (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)
    a, b = part[..., i1], part[..., i2]
    out = x.clone()
    out[..., begin + i1] = a * c - b * s
    out[..., begin + i2] = b * c + a * s
    return out


def rope64(x, pos, *, base=10000.0, scaling=None, rotary_dim=None, rotary_offset=0, interleaved=False,
           sections=None, sections_mode="axial"):
    """RoPE of x (B, S, H, D) in float64 at pos (B, S) (sections: (axes, B, S)); dynamic and
    longrope scale by the call's longest position + 1."""
    if sections is not None:
        return generic_multi_axis_rope(x, pos, sections, sections_mode, base, interleaved)
    rot = x.shape[-1] - rotary_offset if rotary_dim is None else rotary_dim
    inv, attn = formula_inv_freq(rot, base, scaling, int(pos.max()) + 1, x.shape[-1])
    return rotate64(x.to(F64), pos, inv, attn, rotary_offset, rot, interleaved)


# --- 1. qk_norm_rope with every RoPE setting ----------------------------------------------------

LONG = [2.0 + i / 4 for i in range(10)]
SHORT = [1.0 + i / 8 for i in range(10)]
QK_SETTINGS = {
    "linear": dict(scaling={"rope_type": "linear", "factor": 2.5}, interleaved=True),
    "llama3": dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8}, base=500000.0),
    "dynamic_scaled": dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}),
    "dynamic_unscaled": dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}),
    "longrope_short": dict(scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "longrope_long": dict(scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0,
                                   "original_max_position_embeddings": 8}, interleaved=True),
    "proportional": dict(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}),
    "rotary_offset_scaled": dict(rotary_offset=4, rotary_dim=8, interleaved=True,
                                 scaling={"rope_type": "linear", "factor": 2.0}),
    "axial": dict(sections=[2, 4], sections_mode="axial", base=100.0),
    "mrope_interleaved": dict(sections=[4, 3, 3], sections_mode="mrope_interleaved", interleaved=True),
}
B, S, HQ, HK, D = 2, 7, 3, 1, 20


def qk_inputs(norm, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, S, HQ, D, generator=g, dtype=F64) * 2 + 0.3).to(dtype)
    k = (torch.randn(B, S, HK, D, generator=g, dtype=F64) * 2 - 0.2).to(dtype)
    lq, lk = (D, D) if norm == "head" else (HQ * D, HK * D)
    wq = (torch.rand(lq, generator=g, dtype=F64) + 0.5).to(dtype)
    wk = (torch.rand(lk, generator=g, dtype=F64) + 0.5).to(dtype)
    return q, k, wq, wk


def positions_for(rope, rows):
    """The call's positions: the rows (B, S) as given, or (multi-axis) axis a at
    rows * (a + 1) + 5 a: axes that differ, so a pair that reads the wrong axis is seen."""
    sections = rope.get("sections")
    return rows if sections is None else torch.stack([rows * (a + 1) + 5 * a for a in range(len(sections))])


@pytest.mark.parametrize("norm,weight_offset,eps", [("head", 1.0, 1e-6), ("hidden", 0.0, 1e-5)])
@pytest.mark.parametrize("name", sorted(QK_SETTINGS))
def test_qk_norm_rope_every_rope_setting_against_the_formula(name, norm, weight_offset, eps):
    rope = QK_SETTINGS[name]
    for dtype, tol in ((F64, 1e-10), (torch.float32, 2e-5)):
        q, k, wq, wk = qk_inputs(norm, dtype, seed=len(name))
        offsets = torch.tensor([3, 11])  # per-row offsets: the longest position is 17
        rows = offsets[:, None] + torch.arange(S)
        kw = dict(positions=positions_for(rope, rows)) if rope.get("sections") else dict(offset=offsets)
        out_q, out_k = qk_norm_rope(q, k, wq, wk, eps=eps, weight_offset=weight_offset, norm=norm, **kw, **rope)
        for out, x, w in ((out_q, q, wq), (out_k, k, wk)):
            want = rope64(rms_norm64(x, w, eps, weight_offset, norm), positions_for(rope, rows), **rope)
            assert out.dtype == dtype
            torch.testing.assert_close(out.to(F64), want, atol=tol, rtol=tol)


# --- 2. rope_append_kv with QK-norm: q, k and the cache rows -------------------------------------

APPEND_SETTINGS = ["dynamic_scaled", "longrope_long", "longrope_short", "proportional", "rotary_offset_scaled",
                   "axial", "llama3"]


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("name", APPEND_SETTINGS)
def test_rope_append_kv_qk_norm_cache_rows_against_the_formula(name, layout):
    rope = QK_SETTINGS[name]
    norm, weight_offset, eps = ("hidden", 0.0, 1e-5) if name in ("longrope_short", "axial") else ("head", 1.0, 1e-6)
    for dtype, tol in ((F64, 1e-10), (torch.float32, 2e-5)):
        q, k, wq, wk = qk_inputs(norm, dtype, seed=7 + len(name))
        v = torch.randn(B, S, HK, 12, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)
        norm_kw = dict(q_weight=wq, k_weight=wk, eps=eps, weight_offset=weight_offset, norm=norm)
        if layout == "bshd":
            offsets = torch.tensor([2, 10])
            rows = offsets[:, None] + torch.arange(S)  # cache rows and positions, (B, S)
            kc, vc = torch.full((B, 20, HK, D), math.nan, dtype=dtype), torch.full((B, 20, HK, 12), math.nan, dtype=dtype)
            # offset: the cache rows (and the positions, unless multi-axis ones are given).
            place = dict(offset=offsets, positions=positions_for(rope, rows)) if rope.get("sections") else dict(
                offset=offsets)
            got_q, got_k = rope_append_kv(q, k, v, kc, vc, return_k=True, **place, **norm_kw, **rope)
            qv, kv, vv, pos = q, k, v, rows
        else:  # paged: the B * S tokens packed, slots in 4 blocks of 5 rows, one token not written
            T = B * S
            qv, kv, vv = q.reshape(1, T, HQ, D), k.reshape(1, T, HK, D), v.reshape(1, T, HK, 12)
            pos = torch.randperm(T, generator=torch.Generator().manual_seed(2))[None] + 1  # up to 14
            slots = torch.randperm(20, generator=torch.Generator().manual_seed(3))[:T]
            slots[5] = -1
            kc, vc = torch.full((4, 5, HK, D), math.nan, dtype=dtype), torch.full((4, 5, HK, 12), math.nan, dtype=dtype)
            got_q, got_k = rope_append_kv(qv[0], kv[0], vv[0], kc, vc, return_k=True, layout="thd",
                                          positions=positions_for(rope, pos[0]), slot_mapping=slots,
                                          **norm_kw, **rope)
            got_q, got_k = got_q[None], got_k[None]
        want_q = rope64(rms_norm64(qv, wq, eps, weight_offset, norm), positions_for(rope, pos), **rope)
        want_k = rope64(rms_norm64(kv, wk, eps, weight_offset, norm), positions_for(rope, pos), **rope)
        torch.testing.assert_close(got_q.to(F64), want_q, atol=tol, rtol=tol)
        torch.testing.assert_close(got_k.to(F64), want_k, atol=tol, rtol=tol)
        # The cache rows: the formula's k (and v as it is) where written, NaN elsewhere.
        want_kc = torch.full(kc.shape, math.nan, dtype=F64)
        want_vc = torch.full(vc.shape, math.nan, dtype=F64)
        if layout == "bshd":
            for b in range(B):
                want_kc[b, rows[b]] = want_k[b]
                want_vc[b, rows[b]] = vv[b].to(F64)
        else:
            for t, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    want_kc[slot // 5, slot % 5] = want_k[0, t]
                    want_vc[slot // 5, slot % 5] = vv[0, t].to(F64)
        torch.testing.assert_close(kc.to(F64), want_kc, atol=tol, rtol=tol, equal_nan=True)
        torch.testing.assert_close(vc.to(F64), want_vc, atol=0, rtol=0, equal_nan=True)


# --- 3. MLA's latent cache [kv_c | k_pe] and q_pe ------------------------------------------------

NOPE, ROPE, LORA = 16, 8, 24  # DeepSeek's qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, scaled down
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


def gptj_complex64(x, pos, inv, attn):
    """GPT-J / DeepSeek's adjacent pairs as complex numbers times attn * exp(i * pos * inv):
    x (B, S, H, 2P) float64, pos (B, S)."""
    xc = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], -1, 2).contiguous())
    turn = torch.polar(torch.full_like(inv, attn).expand(*pos.shape, -1), pos.to(F64)[..., None] * inv)
    return torch.view_as_real(xc * turn[:, :, None, :]).flatten(-2)


@pytest.mark.parametrize("scaling", [None, DEEPSEEK_YARN], ids=["default", "deepseek_yarn"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_mla_latent_cache_and_q_pe_against_the_formula(dtype, paged, scaling):
    g = torch.Generator().manual_seed(5)
    H = 3
    if paged:
        T = 5
        q = torch.randn(T, H, NOPE + ROPE, generator=g, dtype=F64).to(dtype)
        kv_c = torch.randn(T, 1, LORA, generator=g, dtype=F64).to(dtype)
        k_pe = torch.randn(T, 1, ROPE, generator=g, dtype=F64).to(dtype)
        latent = torch.zeros(3, 4, 1, LORA + ROPE, dtype=dtype)
        slots, pos = torch.tensor([7, 0, -1, 11, 2]), torch.tensor([4, 0, 9, 13, 1])
        kw = dict(positions=pos, slot_mapping=slots, layout="thd")
        pos2 = pos[None]  # (1, T)
        as4 = (lambda x: x[None])  # noqa: E731
        writes = [((s // 4, s % 4), (0, t)) for t, s in enumerate(slots.tolist()) if s >= 0]
    else:
        Bm, Sm, L = 2, 3, 9
        q = torch.randn(Bm, Sm, H, NOPE + ROPE, generator=g, dtype=F64).to(dtype)
        kv_c = torch.randn(Bm, Sm, 1, LORA, generator=g, dtype=F64).to(dtype)
        k_pe = torch.randn(Bm, Sm, 1, ROPE, generator=g, dtype=F64).to(dtype)
        latent = torch.zeros(Bm, L, 1, LORA + ROPE, dtype=dtype)
        lengths = torch.tensor([1, 6])
        kw = dict(offset=lengths)
        pos2 = lengths[:, None] + torch.arange(Sm)
        as4 = (lambda x: x)  # noqa: E731
        writes = [((b, int(pos2[b, s])), (b, s)) for b in range(Bm) for s in range(Sm)]
    q0 = q.clone()
    # docs/guide/kv_cache.md's recipe: q_pe (a view of q) rotated in place, [kv_c | k_pe] written.
    out = rope_append_kv(q[..., NOPE:], k_pe, kv_c, latent[..., LORA:], latent[..., :LORA], inplace=True,
                         interleaved=True, scaling=scaling, **kw)
    assert out.data_ptr() == q[..., NOPE:].data_ptr()
    inv, attn = (default_inv_freq(ROPE, 10000.0), 1.0) if scaling is None else reference_inv_freq(ROPE, 10000.0, scaling)
    if scaling is not None:
        assert attn != 1.0  # DeepSeek's mscale ratio
    tol = {F64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]
    want_q_pe = gptj_complex64(as4(q0[..., NOPE:]), pos2, inv, attn)
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE])  # the nope part is not touched
    torch.testing.assert_close(as4(q[..., NOPE:]).to(F64), want_q_pe, atol=tol, rtol=tol)
    want_k_pe = gptj_complex64(as4(k_pe), pos2, inv, attn)
    want_latent = torch.zeros(latent.shape, dtype=F64)
    for (i, j), (b, s) in writes:
        want_latent[i, j, 0] = torch.cat([as4(kv_c)[b, s, 0].to(F64), want_k_pe[b, s, 0]])
    torch.testing.assert_close(latent[..., :LORA].to(F64), want_latent[..., :LORA], atol=0, rtol=0)
    torch.testing.assert_close(latent.to(F64), want_latent, atol=tol, rtol=tol)
