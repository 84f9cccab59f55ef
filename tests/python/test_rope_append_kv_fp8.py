"""rope_append_kv into FP8 caches (issue 39, item 1). The contract, checked bit for bit: an FP8
cache holds exactly what the same call on float32 copies of k and v writes into a float32
cache, then divided by the scale in float32, saturated to the format's largest finite value
and rounded to nearest even, in plain PyTorch: ``(x32 / scale).clamp(-max, max).to(fp8)``.
Rows the call does not write keep their bits; q (and the returned k) are those of a call
with caches of k's dtype."""

import math

import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from posenc.functional import rope_append_kv
from test_rope_append_kv import reference

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["bshd", "bhsd", "thd"]

# Every RoPE feature, one per case (the case index picks one): rotation settings, scaling types
# (per-token angles and attention factors), positions, multi-axis sections.
ROPE_ARGS = [
    dict(),
    dict(interleaved=True, rotary_dim=16),
    dict(scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8}, base=500000.0),
    dict(scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(16)],
                  "long_factor": [2.0 + i / 4 for i in range(16)], "original_max_position_embeddings": 8,
                  "factor": 4.0}),
    dict(rotary_offset=8),
    dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}),
    dict(scaling={"rope_type": "linear", "factor": 2.0}, interleaved=True),
    dict(sections=[4, 6, 6], sections_mode="mrope"),
]
SCALES = [None, 0.7, "0d", "1elem", 3.0, 0.01]


def scale_arg(kind, value=0.37):
    if kind == "0d":
        return torch.tensor(value, dtype=torch.float32)
    if kind == "1elem":
        return torch.tensor([value], dtype=torch.float32)
    return kind


def scale_value(kind):
    return 1.0 if kind is None else (0.37 if isinstance(kind, str) else kind)


def quantise(x32, fmt, scale):
    """The contract in plain PyTorch: float32 division by the float32 scale, saturate, round."""
    m = FP8[fmt]
    return (x32 / torch.tensor(scale, dtype=torch.float32)).clamp(-m, m).to(fmt)


def make(layout, dtype, fmt, D=32, Dv=24, g=None, B=2, S=5, Hq=4, Hkv=2, L=12, blocks=5, block=4):
    def rand(*shape, scale=1.0):
        x = torch.randn(*shape, generator=g) * scale
        # A spread of magnitudes: saturating (beyond 448 / scale), normal, and FP8-subnormal values.
        x *= torch.tensor([300.0, 1.0, 3e-3])[torch.randint(0, 3, shape, generator=g)]
        return x.to(dtype)

    if layout == "thd":
        q, k, v = rand(S, Hq, D), rand(S, Hkv, D), rand(S, Hkv, Dv)
        cache_k, cache_v = (blocks, block, Hkv, D), (blocks, block, Hkv, Dv)
    elif layout == "bhsd":
        q, k, v = rand(B, Hq, S, D), rand(B, Hkv, S, D), rand(B, Hkv, S, Dv)
        cache_k, cache_v = (B, Hkv, L, D), (B, Hkv, L, Dv)
    else:
        q, k, v = rand(B, S, Hq, D), rand(B, S, Hkv, D), rand(B, S, Hkv, Dv)
        cache_k, cache_v = (B, L, Hkv, D), (B, L, Hkv, Dv)
    # Caches start with random bits (no NaN encodings needed: any bits must be kept).
    kc = torch.randint(0, 120, cache_k, dtype=torch.uint8, generator=g).view(fmt)
    vc = torch.randint(0, 120, cache_v, dtype=torch.uint8, generator=g).view(fmt)
    return q, k, v, kc, vc


def where_kw(layout, S, g):
    if layout == "thd":
        return dict(slot_mapping=torch.tensor([5, -1, 0, 19, 12])[:S], positions=torch.tensor([3, 9, 0, 7, 1])[:S])
    if layout == "bhsd":
        return dict(offset=torch.tensor([0, 7]))
    return dict(offset=3)


def expected_caches(q, k, v, kc, vc, fmt_k, fmt_v, k_scale, v_scale, **kw):
    """The contract: the float32 call into float32 caches that start as NaN (so the written
    rows show), quantised; unwritten rows keep the caches' bits. That float32 call itself
    (its q and rows) against the formula: test_rope_append_kv's float64 reference."""
    ref_k = torch.full(kc.shape, math.nan)
    ref_v = torch.full(vc.shape, math.nan)
    formula = reference(q.float(), k.float(), v.float(), ref_k, ref_v, **kw)
    q32 = rope_append_kv(q.float(), k.float(), v.float(), ref_k, ref_v, **kw)
    big = max(q.float().abs().max().item(), k.float().abs().max().item())  # inputs up to ~1000
    for got, want in zip((q32, ref_k, ref_v), formula[:1] + formula[2:]):
        torch.testing.assert_close(got.double(), want, atol=2e-6 * big, rtol=2e-6, equal_nan=True)
    out = []
    for ref, cache, fmt, scale in ((ref_k, kc, fmt_k, k_scale), (ref_v, vc, fmt_v, v_scale)):
        written = ~ref.isnan()
        assert written.any()
        out.append(torch.where(written, quantise(ref, fmt, scale).view(torch.uint8), cache.view(torch.uint8)))
    return out


CASES = [(layout, dtype, fmt) for layout in LAYOUTS for dtype in DTYPES for fmt in FP8]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_fp8_cache_holds_the_quantised_float32_rows(index):
    layout, dtype, fmt = CASES[index]
    g = torch.Generator().manual_seed(index)
    rope = dict(ROPE_ARGS[index % len(ROPE_ARGS)])
    if "sections" in rope:
        rope["positions"] = torch.randint(0, 20, (3, 5) if layout == "thd" else (3, 2, 5), generator=g)
    kind_k, kind_v = SCALES[index % len(SCALES)], SCALES[(index + 2) % len(SCALES)]
    q, k, v, kc, vc = make(layout, dtype, fmt, g=g)
    kw = dict(where_kw(layout, 5, g), layout=layout, **rope)
    if "positions" in rope and layout == "thd":
        kw["positions"] = rope["positions"]
    want_k, want_v = expected_caches(q, k, v, kc, vc, fmt, fmt, scale_value(kind_k), scale_value(kind_v), **kw)
    # q and k as a call with caches of k's dtype gives them.
    plain_kc, plain_vc = torch.zeros(kc.shape, dtype=dtype), torch.zeros(vc.shape, dtype=dtype)
    want_q, want_rk = rope_append_kv(q, k, v, plain_kc, plain_vc, return_k=True, **kw)
    got_q, got_k = rope_append_kv(q, k, v, kc, vc, return_k=True, k_scale=scale_arg(kind_k),
                                  v_scale=scale_arg(kind_v), **kw)
    assert kc.dtype == fmt and vc.dtype == fmt
    assert torch.equal(kc.view(torch.uint8), want_k)
    assert torch.equal(vc.view(torch.uint8), want_v)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_rk)
    # No NaN or inf from finite inputs: the saturated values are the format's largest.
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()
    assert kc.float().abs().max() <= FP8[fmt]


@pytest.mark.parametrize("inplace", [False, True])
def test_mixed_caches_strided_inputs_and_inplace(inplace):
    """A float8 k cache beside a v cache of v's dtype; q, k, v slices of one qkv projection
    (non-contiguous), caches as transposed views; in place."""
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, L = 2, 4, 4, 2, 16, 9
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D, generator=g, dtype=torch.bfloat16) * 50
    q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    kc = torch.zeros(B, Hkv, L, D, dtype=torch.float8_e5m2).transpose(1, 2)  # (B, L, Hkv, D) strided
    vc = torch.zeros(B, L, Hkv, D, dtype=torch.bfloat16)
    ref_k, ref_v = torch.full(kc.shape, math.nan), torch.zeros(vc.shape)
    rope_append_kv(q.float(), k.float(), v.float(), ref_k, ref_v, offset=2)
    q_in = q.clone()
    out = rope_append_kv(q_in, k, v, kc, vc, offset=2, k_scale=0.25, inplace=inplace)
    written = ~ref_k.isnan()
    want = torch.where(written, quantise(ref_k, torch.float8_e5m2, 0.25).view(torch.uint8), 0)
    assert torch.equal(kc.view(torch.uint8), want)
    assert torch.equal(vc[:, 2:2 + S], v)  # the plain cache holds v as it is
    assert (out is q_in) == inplace


def test_k_and_v_caches_of_two_fp8_formats():
    """Each cache's format and scale are its own: k in e5m2 and v in e4m3fn in one call."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, h, 16, generator=g) * 30 for h in (4, 2, 2))
    kc, vc = torch.zeros(2, 8, 2, 16, dtype=torch.float8_e5m2), torch.zeros(2, 8, 2, 16, dtype=torch.float8_e4m3fn)
    ref_k, ref_v = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    rope_append_kv(q, k, v, ref_k, ref_v, offset=4)
    rope_append_kv(q, k, v, kc, vc, offset=4, k_scale=0.5, v_scale=0.125)
    assert torch.equal(kc.view(torch.uint8), quantise(ref_k, torch.float8_e5m2, 0.5).view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), quantise(ref_v, torch.float8_e4m3fn, 0.125).view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FP8))
def test_nan_stays_nan_and_inf_saturates(fmt):
    k = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.5, -0.0, 1e-30]).view(1, 1, 1, 8)
    q = torch.zeros(1, 1, 1, 8)
    v = k.clone()
    kc, vc = torch.zeros(1, 1, 1, 8, dtype=fmt), torch.zeros(1, 1, 1, 8, dtype=fmt)
    pos = torch.zeros(1, 1, dtype=torch.long)
    rope_append_kv(q, k, v, kc, vc, positions=pos)
    got = vc.float().flatten()  # v is not rotated: its values as they are, quantised
    m = FP8[fmt]
    assert math.isnan(got[0]) and got[1] == m and got[2] == -m and got[3] == m and got[4] == -m
    assert got[5] == 0.5 and got[6] == 0 and math.copysign(1, got[6]) < 0 and got[7] == 0
    assert torch.equal(vc.view(torch.uint8), quantise(v, fmt, 1.0).view(torch.uint8))
    # k is rotated first (at position 0, inf * sin 0 is NaN, as in float32): the contract.
    ref = torch.zeros(1, 1, 1, 8)
    rope_append_kv(q, k, v, ref, torch.zeros(1, 1, 1, 8), positions=pos)
    assert torch.equal(kc.view(torch.uint8), quantise(ref, fmt, 1.0).view(torch.uint8))


def test_bad_caches_and_scales_are_errors_that_write_nothing():
    g = torch.Generator().manual_seed(1)
    q, k, v, kc, vc = make("bshd", torch.float32, torch.float8_e4m3fn, g=g)
    plain = torch.zeros(kc.shape)
    before = kc.clone().view(torch.uint8), vc.clone().view(torch.uint8)
    cases = [
        (dict(k_scale=0.0), ValueError, "k_scale to be a finite positive number.*got 0"),
        (dict(v_scale=-1.0), ValueError, "v_scale to be a finite positive number.*got -1"),
        (dict(k_scale=math.nan), ValueError, "k_scale to be a finite positive number.*got nan"),
        (dict(k_scale=math.inf), ValueError, "k_scale to be a finite positive number.*got inf"),
        (dict(k_scale=torch.tensor([0.5, 0.5])), ValueError, r"k_scale to hold one value.*\[2\]"),
        (dict(k_scale=torch.tensor(0.5, dtype=torch.float64)), TypeError, "k_scale to be a Python float or a "
                                                                          "float32 tensor.*Double"),
        (dict(k_scale=torch.tensor(0.5, device="meta")), ValueError, "k_scale on the CPU or on q's device"),
        (dict(k_scale="1"), TypeError, "k_scale to be a float or a float32 tensor, got str"),
        (dict(k_scale=True), TypeError, "k_scale to be a float or a float32 tensor, got bool"),
    ]
    for kw, error, message in cases:
        with pytest.raises(error, match=message):
            rope_append_kv(q, k, v, kc, vc, offset=2, **kw)
        assert torch.equal(kc.view(torch.uint8), before[0]) and torch.equal(vc.view(torch.uint8), before[1])
    with pytest.raises(ValueError, match="k_scale is only used with a float8 k_cache.*Float"):
        rope_append_kv(q, k, v, plain, vc, k_scale=0.5)
    with pytest.raises(TypeError, match="a float8 k_cache takes k of dtype float32, bfloat16 or float16.*Double"):
        rope_append_kv(q.double(), k.double(), v.double(), kc, vc)
    with pytest.raises(TypeError, match="k_cache to have k's dtype Float or a float8 dtype.*Char"):
        rope_append_kv(q, k, v, torch.zeros(kc.shape, dtype=torch.int8), vc)


def test_opcheck_and_meta():
    g = torch.Generator().manual_seed(2)
    for layout in ("bshd", "thd"):
        q, k, v, kc, vc = make(layout, torch.bfloat16, torch.float8_e4m3fn, g=g)
        kw = dict(where_kw(layout, 5, g), layout=layout)
        if "offset" in kw and isinstance(kw["offset"], torch.Tensor):
            kw["offsets"] = kw.pop("offset")
        # opcheck's test_schema compares values with ops float8 has no CPU kernel for (mul);
        # the schema's aliases are those of plain caches, which test_rope_append_kv.py opchecks.
        opcheck(torch.ops.posenc.rope_append_kv, (q, k, v, kc, vc),
                dict(kw, k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]), return_k=True),
                test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    meta = [t.to("meta") for t in make("bshd", torch.float16, torch.float8_e5m2, g=g)]
    out_q, _ = torch.ops.posenc.rope_append_kv(*meta, k_scale=torch.tensor(0.5))
    assert out_q.device.type == "meta" and out_q.shape == meta[0].shape


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_writes_fp8_caches(backend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    q, k, v, kc, vc = make("bhsd", torch.bfloat16, torch.float8_e4m3fn, g=g, S=1)
    lengths = torch.tensor([3, 8])
    k_scale = torch.tensor(0.5)

    def step(q, k, v, kc, vc, lengths, k_scale):
        return rope_append_kv(q, k, v, kc, vc, offset=lengths, layout="bhsd", k_scale=k_scale, v_scale=0.25)

    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(q, k, v, kc_e, vc_e, lengths, k_scale)
    out = torch.compile(step, fullgraph=True, backend=backend)(q, k, v, kc, vc, lengths, k_scale)
    assert torch.equal(out, eager)
    assert torch.equal(kc.view(torch.uint8), kc_e.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_e.view(torch.uint8))
    assert not torch.equal(kc.view(torch.uint8), make("bhsd", torch.bfloat16, torch.float8_e4m3fn,
                                                      g=torch.Generator().manual_seed(6), S=1)[3].view(torch.uint8))


def test_aten_fallback_keeps_the_contract():
    """The ATen composite (rope_append_kv.cpp, reached through the dispatcher) quantises the
    float32 rotation of its own path bit for bit by the same rule, and refuses the same scales."""
    from aten_fallback_mode import ThroughTheFallback

    g = torch.Generator().manual_seed(9)
    for layout, fmt in (("bshd", torch.float8_e4m3fn), ("bhsd", torch.float8_e5m2), ("thd", torch.float8_e4m3fn)):
        q, k, v, kc, vc = make(layout, torch.bfloat16, fmt, g=g)
        kw = dict(where_kw(layout, 5, g), layout=layout, interleaved=True)
        ref_k, ref_v = torch.full(kc.shape, math.nan), torch.full(vc.shape, math.nan)
        with ThroughTheFallback() as mode:
            rope_append_kv(q.float(), k.float(), v.float(), ref_k, ref_v, **kw)
            rope_append_kv(q, k, v, kc, vc, k_scale=0.75, v_scale=torch.tensor([1.5]), **kw)
            with pytest.raises(ValueError, match="k_scale to be a finite positive number"):
                rope_append_kv(q, k, v, kc, vc, k_scale=-0.75, **kw)
        assert mode.calls["posenc::rope_append_kv"] == 3
        for ref, cache, scale in ((ref_k, kc, 0.75), (ref_v, vc, 1.5)):
            written = ~ref.isnan()
            assert torch.equal(cache.view(torch.uint8)[written], quantise(ref, fmt, scale).view(torch.uint8)[written])


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("scale", [1.0, 0.37, 1e-20])
def test_every_kind_of_float32_quantises_as_torch(fmt, scale):
    """v's values as random float32 bit patterns (every exponent: subnormals, NaN, inf, values
    that saturate or round to FP8 subnormals), through the vector and the scalar code of the
    kernel (rows of 64, 72 and 7 elements: on an AVX-512 CPU 72 takes its 16-lane steps and
    the AVX2 8-lane one), bit for bit against torch's conversion."""
    g = torch.Generator().manual_seed(int(scale * 100) + len(str(fmt)))
    for d in (64, 72, 7):
        bits = torch.randint(-2**31, 2**31, (4, 3, 1, d), dtype=torch.int64, generator=g).to(torch.int32)
        v = bits.view(torch.float32)
        k = torch.zeros_like(v)
        kc, vc = torch.zeros(4, 3, 1, d, dtype=fmt), torch.zeros(4, 3, 1, d, dtype=fmt)
        rope_append_kv(torch.zeros_like(v), k, v, kc, vc, v_scale=scale, rotary_dim=6 if d == 7 else None)
        assert torch.equal(vc.view(torch.uint8), quantise(v, fmt, scale).view(torch.uint8))


@pytest.mark.parametrize("dtype,fmt,D,aligned,qk_norm", [
    (torch.float32, torch.float8_e4m3fn, 128, True, False),
    (torch.bfloat16, torch.float8_e5m2, 96, True, False),
    (torch.float16, torch.float8_e4m3fn, 128, False, False),
    (torch.bfloat16, torch.float8_e4m3fn, 128, True, True),
    (torch.float32, torch.float8_e5m2, 128, True, True),
])
def test_large_prefill_into_fp8_caches_streams_with_the_same_bits(dtype, fmt, D, aligned, qk_norm):
    """A prefill that writes 8 MiB or more (kStreamBytes) stores its FP8 cache rows' whole
    64-byte lines with streaming stores where they are aligned (rows of 96 bytes: every other
    head's row starts a line; a cache one byte off its allocation: none): the same bits as
    eight calls small enough for plain stores, and the contract's (the quantised rows of the
    float32 call)."""
    g = torch.Generator().manual_seed(D + len(str(fmt)))
    S, Hq, Hkv, offset = (2048 if dtype == torch.float32 else 4096), 8, 4, 3  # >= 12 MiB of q, k, v
    q, k, v, kc, vc = make("bshd", dtype, fmt, D=D, Dv=D, g=g, B=1, S=S, Hq=Hq, Hkv=Hkv, L=S + 8)
    if not aligned:
        kc, vc = (torch.empty(c.numel() + 1, dtype=torch.uint8)[1:].view(c.shape).copy_(c.view(torch.uint8))
                  .view(fmt) for c in (kc, vc))
    norm = dict(q_weight=torch.rand(D, generator=g) + 0.5, k_weight=torch.rand(D, generator=g) + 0.5) if qk_norm else {}
    kc_small, vc_small = kc.clone(), vc.clone()
    kc_before, vc_before = kc.clone(), vc.clone()
    scales = dict(k_scale=0.37, v_scale=torch.tensor(3.0))
    got_q = rope_append_kv(q, k, v, kc, vc, offset=offset, **scales, **norm)
    chunk = S // 8
    parts = [rope_append_kv(q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk], kc_small, vc_small,
                            offset=offset + s, **scales, **norm) for s in range(0, S, chunk)]
    assert torch.equal(got_q, torch.cat(parts, 1))
    assert torch.equal(kc.view(torch.uint8), kc_small.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_small.view(torch.uint8))
    # The contract: the float32 call's rows, quantised; the rows around them keep their bits.
    ref_k, ref_v = torch.full(kc.shape, math.nan), torch.full(vc.shape, math.nan)
    rope_append_kv(q.float(), k.float(), v.float(), ref_k, ref_v, offset=offset, **norm)
    for ref, cache, before, scale in ((ref_k, kc, kc_before, 0.37), (ref_v, vc, vc_before, 3.0)):
        rows = cache.view(torch.uint8)[:, offset:offset + S]
        assert torch.equal(rows, quantise(ref[:, offset:offset + S], fmt, scale).view(torch.uint8))
        assert not ref[:, :offset].isfinite().any() and not ref[:, offset + S:].isfinite().any()
        for part in (slice(0, offset), slice(offset + S, None)):  # the rows around them keep their bytes
            assert torch.equal(cache.view(torch.uint8)[:, part], before.view(torch.uint8)[:, part])
