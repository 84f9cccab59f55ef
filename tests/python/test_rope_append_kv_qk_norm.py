"""rope_append_kv with QK-norm (issue 39, item 2): q_weight / k_weight normalise q and k as
qk_norm_rope does before they are rotated and written. The contract, checked bit for bit: q,
the returned k and the cache rows are qk_norm_rope's outputs for the same arguments (an FP8
cache: qk_norm_rope's k of float32 copies, quantised); the rows not written keep their bits;
and both agree with the float64 formula (test_qk_norm_rope.reference)."""

import math

import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from posenc.functional import qk_norm_rope, rope_append_kv
from conftest import DEVICES
from test_qk_norm_rope import MODELS, close, reference
from test_qk_norm_rope import make as make_qk

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
LAYOUTS = ["bshd", "bhsd", "thd"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
B, S, HQ, HKV, D, DV, L = 2, 5, 4, 2, 32, 24, 12
BLOCKS, BLOCK = 5, 4
SLOTS = torch.tensor([5, -1, 0, 19, 12])
THD_POSITIONS = torch.tensor([3, 9, 0, 7, 1])
ROW_OFFSETS = torch.tensor([0, 7])


def inputs(layout, dtype, norm, seed):
    """q, k (test_qk_norm_rope's values), v, the weights, NaN-filled caches, the call's
    placement keywords and the positions each token turns at, (batch, seq)."""
    q, k, wq, wk = make_qk(B, S, HQ, HKV, D, dtype, "cpu", norm, layout="bshd" if layout == "thd" else layout,
                           seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    if layout == "thd":
        q, k = q[0], k[0]  # (tokens, heads, head_dim)
        v = torch.randn(S, HKV, DV, generator=g).to(dtype)
        kc, vc = torch.full((BLOCKS, BLOCK, HKV, D), math.nan), torch.full((BLOCKS, BLOCK, HKV, DV), math.nan)
        return q, k, v, wq, wk, kc, vc, dict(slot_mapping=SLOTS, positions=THD_POSITIONS), THD_POSITIONS.view(1, S)
    if layout == "bhsd":
        v = torch.randn(B, HKV, S, DV, generator=g).to(dtype)
        kc, vc = torch.full((B, HKV, L, D), math.nan), torch.full((B, HKV, L, DV), math.nan)
        return q, k, v, wq, wk, kc, vc, dict(offset=ROW_OFFSETS), ROW_OFFSETS[:, None] + torch.arange(S)
    v = torch.randn(B, S, HKV, DV, generator=g).to(dtype)
    kc, vc = torch.full((B, L, HKV, D), math.nan), torch.full((B, L, HKV, DV), math.nan)
    return q, k, v, wq, wk, kc, vc, dict(offset=3), (3 + torch.arange(S)).expand(B, S)


def cache_rows(cache, layout, placement):
    """The rows the call wrote, in the tokens' layout (thd: tokens with slot -1 left out)."""
    if layout == "thd":
        flat = cache.reshape(-1, *cache.shape[2:])
        return flat[placement["slot_mapping"][placement["slot_mapping"] >= 0]]
    if layout == "bhsd":
        return torch.stack([cache[b, :, o:o + S] for b, o in enumerate(ROW_OFFSETS.tolist())])
    return cache[:, 3:3 + S]


def qk_norm_rope_at(q, k, wq, wk, layout, pos, **kw):
    """qk_norm_rope at the tokens' positions (thd: the tokens as one bshd row)."""
    if layout == "thd":
        out = qk_norm_rope(q[None], k[None], wq, wk, positions=pos, layout="bshd", **kw)
        return out[0][0], out[1][0]
    return qk_norm_rope(q, k, wq, wk, positions=pos, layout=layout, **kw)


def written_tokens(x, layout):
    return x[SLOTS >= 0] if layout == "thd" else x


CASES = [(layout, dtype, model) for layout in LAYOUTS for dtype in DTYPES for model in MODELS]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_cache_holds_qk_norm_rope_k(index):
    layout, dtype, model = CASES[index]
    norm, offset, eps = MODELS[model]
    q, k, v, wq, wk, kc, vc, placement, pos = inputs(layout, dtype, norm, index)
    kc, vc = kc.to(dtype), vc.to(dtype)
    rope = dict(interleaved=True, rotary_dim=16) if index % 3 == 1 else (
        dict(scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
        if index % 3 == 2 else {})
    norm_kw = dict(eps=eps, weight_offset=offset, norm=norm)
    before_k, before_v = kc.clone(), vc.clone()
    got_q, got_k = rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, return_k=True, layout=layout,
                                  **norm_kw, **placement, **rope)
    # qk_norm_rope at the same positions: the same bits.
    want_q, want_k = qk_norm_rope_at(q, k, wq, wk, layout, pos, **norm_kw, **rope)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(cache_rows(kc, layout, placement), written_tokens(want_k, layout))
    assert torch.equal(cache_rows(vc, layout, placement), written_tokens(v, layout))
    # Every other row keeps its bits (NaN).
    assert kc.isnan().sum() == before_k.isnan().sum() - written_tokens(want_k, layout).numel()
    assert vc.isnan().sum() == before_v.isnan().sum() - written_tokens(v, layout).numel()
    # The float64 formula.
    ref_q, ref_k = reference(q, k, wq, wk, eps=eps, offset=offset, norm=norm, layout=layout, pos=pos,
                             rotary_dim=rope.get("rotary_dim"), interleaved=rope.get("interleaved", False),
                             scaling=rope.get("scaling"))
    close(got_q, ref_q, dtype)
    close(got_k, ref_k, dtype)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_cache_holds_the_quantised_float32_norm(fmt, layout, dtype):
    norm, offset, eps = MODELS["olmo2" if layout == "bhsd" else "gemma3"]
    q, k, v, wq, wk, kc, vc, placement, pos = inputs(layout, dtype, norm, 7)
    k = k * 300  # saturates some values
    kc8 = torch.randint(0, 120, kc.shape, dtype=torch.uint8).view(fmt)
    vc8 = torch.randint(0, 120, vc.shape, dtype=torch.uint8).view(fmt)
    before = kc8.view(torch.uint8).clone()
    norm_kw = dict(eps=eps, weight_offset=offset, norm=norm)
    got_q = rope_append_kv(q, k, v, kc8, vc8, q_weight=wq, k_weight=wk, k_scale=0.37, v_scale=2.0, layout=layout,
                           **norm_kw, **placement)
    assert torch.equal(got_q, qk_norm_rope_at(q, k, wq, wk, layout, pos, **norm_kw)[0])
    k32 = k.float()
    want_k = qk_norm_rope_at(k32, k32, wk.float(), wk.float(), layout, pos, **norm_kw)[1]
    m = FP8[fmt]
    quantised = (written_tokens(want_k, layout) / torch.tensor(0.37)).clamp(-m, m).to(fmt)
    assert torch.equal(cache_rows(kc8, layout, placement).view(torch.uint8), quantised.view(torch.uint8))
    assert torch.isfinite(kc8.float()).all()
    # Unwritten rows keep their bits.
    kept = torch.ones(kc8.shape, dtype=torch.bool)
    if layout == "thd":
        kept.view(-1, HKV, D)[SLOTS[SLOTS >= 0]] = False
    elif layout == "bhsd":
        for b, o in enumerate(ROW_OFFSETS.tolist()):
            kept[b, :, o:o + S] = False
    else:
        kept[:, 3:3 + S] = False
    assert torch.equal(kc8.view(torch.uint8)[kept], before[kept])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_inplace_and_strided_inputs(layout):
    """q, k, v as slices of one projection (non-contiguous rows); in place: q and k hold
    qk_norm_rope's outputs."""
    norm, offset, eps = MODELS["qwen3"]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, S, HQ + 2 * HKV, D, generator=g, dtype=torch.float64).to(torch.bfloat16)
    q, k, v = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HKV], qkv[:, :, HQ + HKV:]
    if layout == "bhsd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    wq, wk = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5  # float32 master weights
    shape = (B, L, HKV, D) if layout == "bshd" else (B, HKV, L, D)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    want_q, want_k = qk_norm_rope(q, k, wq, wk, offset=2, layout=layout, eps=eps, weight_offset=offset, norm=norm)
    q2, k2 = q.clone(), k.clone()
    out = rope_append_kv(q2, k2, v, kc, vc, offset=2, layout=layout, q_weight=wq, k_weight=wk, inplace=True,
                         return_k=True)
    assert out[0] is q2 and torch.equal(q2, want_q) and torch.equal(k2, want_k)
    rows = kc[:, 2:2 + S] if layout == "bshd" else kc[:, :, 2:2 + S]
    assert torch.equal(rows, want_k)


def test_bad_norm_arguments_are_errors_that_write_nothing():
    q, k, v, wq, wk, kc, vc, placement, _ = inputs("bshd", torch.float32, "head", 1)
    before = kc.clone()
    with pytest.raises(ValueError, match="q_weight and k_weight together.*q_weight alone"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq, **placement)
    with pytest.raises(ValueError, match="weight_offset and norm set QK-norm.*weight_offset=1"):
        torch.ops.posenc.rope_append_kv(q, k, v, kc, vc, weight_offset=1.0)
    with pytest.raises(ValueError, match="unknown norm 'rms'"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, norm="rms", **placement)
    with pytest.raises(ValueError, match="eps > 0"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, eps=0.0, **placement)
    with pytest.raises(ValueError, match=r"k_weight of shape \(64,\)"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq.repeat(HQ), k_weight=wk, norm="hidden", **placement)
    with pytest.raises(TypeError, match="rope_append_kv: expected q_weight to have q's dtype"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq.double(), k_weight=wk, **placement)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference"):
        rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, **placement)
    assert torch.equal(kc.nan_to_num(), before.nan_to_num())


def test_opcheck_meta_and_fallback():
    from aten_fallback_mode import ThroughTheFallback

    for layout, norm in (("bshd", "head"), ("thd", "hidden"), ("bhsd", "head")):
        q, k, v, wq, wk, kc, vc, placement, _ = inputs(layout, torch.bfloat16, norm, 5)
        kc, vc = kc.to(torch.bfloat16).zero_(), vc.to(torch.bfloat16).zero_()
        kw = dict(placement, layout=layout, q_weight=wq.float(), k_weight=wk, eps=1e-5, weight_offset=0.5, norm=norm,
                  return_k=True)
        if isinstance(kw.get("offset"), torch.Tensor):
            kw["offsets"] = kw.pop("offset")
        opcheck(torch.ops.posenc.rope_append_kv, (q, k, v, kc, vc), kw)
        meta = [t.to("meta") for t in (q, k, v, kc, vc)]
        meta_kw = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        out_q, out_k = torch.ops.posenc.rope_append_kv(*meta, **meta_kw)
        assert out_q.shape == q.shape and out_k.shape == k.shape
        # The ATen composite: the same bits (it rotates through qk_norm_rope's kernel).
        kc_f, vc_f = kc.clone(), vc.clone()
        want = torch.ops.posenc.rope_append_kv(q, k, v, kc, vc, **kw)
        with ThroughTheFallback() as mode:
            got = torch.ops.posenc.rope_append_kv(q, k, v, kc_f, vc_f, **kw)
        assert mode.calls["posenc::rope_append_kv"] == 1
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(kc_f, kc) and torch.equal(vc_f, vc)


def test_fp8_fallback_keeps_the_contract():
    from aten_fallback_mode import ThroughTheFallback

    q, k, v, wq, wk, kc, vc, placement, _ = inputs("bhsd", torch.bfloat16, "hidden", 8)
    kc8, vc8 = torch.zeros(kc.shape).to(torch.float8_e4m3fn), torch.zeros(vc.shape).to(torch.float8_e4m3fn)
    kw = dict(placement, layout="bhsd", q_weight=wq, k_weight=wk, norm="hidden", k_scale=0.5)
    kc_f, vc_f = kc8.clone(), vc8.clone()
    rope_append_kv(q, k, v, kc8, vc8, **kw)
    with ThroughTheFallback():
        rope_append_kv(q, k, v, kc_f, vc_f, **kw)
    assert torch.equal(kc_f.view(torch.uint8), kc8.view(torch.uint8))
    assert torch.equal(vc_f.view(torch.uint8), vc8.view(torch.uint8))


def test_compile_fullgraph_decode_step():
    torch._dynamo.reset()
    q, k, v, wq, wk, kc, vc, _, _ = inputs("bhsd", torch.bfloat16, "head", 4)
    q, k, v = q[:, :, :1], k[:, :, :1], v[:, :, :1]
    kc, vc = kc.to(torch.bfloat16).zero_(), vc.to(torch.bfloat16).zero_()
    lengths = torch.tensor([3, 8])

    def step(q, k, v, kc, vc, lengths):
        return rope_append_kv(q, k, v, kc, vc, offset=lengths, layout="bhsd", q_weight=wq, k_weight=wk)

    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(q, k, v, kc_e, vc_e, lengths)
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, kc, vc, lengths)
    assert torch.equal(out, eager) and torch.equal(kc, kc_e) and torch.equal(vc, vc_e)
    assert kc[0, :, 3].abs().sum() > 0 and kc[1, :, 8].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", ["head", "hidden"])
def test_on_each_device_the_cache_holds_that_devices_qk_norm_rope_k(device, layout, norm):
    """On each device (CUDA: its own kernel, one warp per normalised vector, the reduction
    order of qk_norm_rope's CUDA kernel), the bits of that device's qk_norm_rope; FP8 too."""
    for dtype, fmt in ((torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)):
        q, k, v, wq, wk, kc, vc, placement, pos = inputs(layout, dtype, norm, 11)
        q, k, v, wq, wk = (t.to(device) for t in (q, k, v, wq, wk))
        placement = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in placement.items()}
        kc, vc = kc.to(device, fmt or dtype), vc.to(device, fmt or dtype)
        got_q, got_k = rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, norm=norm, return_k=True,
                                      layout=layout, k_scale=0.5 if fmt else None, v_scale=0.5 if fmt else None,
                                      **placement)
        want_q, want_k = qk_norm_rope_at(q, k, wq, wk, layout, pos.to(device), norm=norm)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        rows = cache_rows(kc, layout, {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in placement.items()})
        if fmt is None:
            assert torch.equal(rows, written_tokens(want_k, layout).to(rows.device) if layout != "thd"
                               else want_k[SLOTS.to(device) >= 0])
        else:
            want = (want_k[SLOTS.to(device) >= 0] if layout == "thd" else want_k) / torch.tensor(0.5, device=device)
            assert torch.equal(rows.view(torch.uint8), want.clamp(-448, 448).to(fmt).view(torch.uint8))


@pytest.mark.parametrize("dtype,norm", [(torch.float32, "head"), (torch.bfloat16, "hidden")])
def test_large_prefill_streams_with_qk_norm_rope_bits(dtype, norm):
    """A prefill that writes 12 MiB or more takes streaming stores for q's rows and the cache
    rows (kStreamBytes, rope_rows.h): the same bits as qk_norm_rope of the same tokens, which
    a 12 MiB call of its own also streams, and eight small calls into a second cache."""
    S = 2048 if dtype == torch.float32 else 4096
    Hq, Hkv, Dh, offset = 8, 4, 128, 5
    q, k, wq, wk = make_qk(1, S, Hq, Hkv, Dh, dtype, "cpu", norm, seed=23)
    v = torch.randn(1, S, Hkv, Dh, generator=torch.Generator().manual_seed(24)).to(dtype)
    kc = torch.full((1, S + offset, Hkv, Dh), math.nan, dtype=dtype)
    vc = kc.clone()
    kc_small, vc_small = kc.clone(), vc.clone()
    got_q = rope_append_kv(q, k, v, kc, vc, q_weight=wq, k_weight=wk, norm=norm, offset=offset)
    pos = (offset + torch.arange(S)).expand(1, S)
    want_q, want_k = qk_norm_rope(q, k, wq, wk, norm=norm, positions=pos)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc[:, offset:], want_k) and torch.equal(vc[:, offset:], v)
    chunk = S // 8
    parts = [rope_append_kv(q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk], kc_small, vc_small,
                            q_weight=wq, k_weight=wk, norm=norm, offset=offset + s) for s in range(0, S, chunk)]
    assert torch.equal(got_q, torch.cat(parts, 1))
    for got, small in ((kc, kc_small), (vc, vc_small)):  # the rows before `offset` stay NaN
        torch.testing.assert_close(got, small, rtol=0, atol=0, equal_nan=True)
    assert kc[:, :offset].isnan().all() and vc[:, :offset].isnan().all()
    ref_q, ref_k = reference(q, k, wq, wk, eps=1e-6, offset=0.0, norm=norm, pos=pos)
    close(got_q, ref_q, dtype)
    close(kc[:, offset:], ref_k, dtype)
