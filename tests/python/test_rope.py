"""RoPE against the float64 references of rope_reference.py: layouts, conventions, GQA,
partial rotary, positions, offsets, packed sequences, strides, dtypes, empty tensors,
scaling types, the relative-position property and long-position accuracy."""


import pytest
import torch

import posenc
from conftest import DEVICES, DTYPES
from posenc.functional import apply_rope, rope_frequencies
from rope_reference import (
    default_inv_freq,
    reference_inv_freq,
    reference_rope,
    thd_positions,
)

TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}


def make(shape, layout, dtype, device, heads):
    """A random tensor of canonical shape (B, S, heads, D) laid out as `layout`."""
    B, S, D = shape
    x = torch.randn(B, S, heads, D, dtype=torch.float64) * 2 + 0.5
    if layout == "bhsd":
        x = x.transpose(1, 2).contiguous()
    elif layout == "sbhd":
        x = x.transpose(0, 1).contiguous()
    elif layout == "thd":
        x = x.reshape(B * S, heads, D)
    return x.to(dtype=dtype, device=device)


def grid_positions(B, S, positions=None, offset=0):
    if positions is None:
        pos = torch.arange(S).expand(B, S)
    elif positions.dim() == 1:
        pos = positions.cpu().expand(B, S)
    else:
        pos = positions.cpu()
    if isinstance(offset, torch.Tensor):
        return pos + offset.cpu()[:, None]
    return pos + offset


def check(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().to(torch.float64), ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 14])
@pytest.mark.parametrize("D", [24, 128])
def test_q_and_k_match_reference(device, dtype, layout, interleaved, rotary_dim, D):
    # head_dim 24: even, not a power of two, and its 12 pairs split into 16-byte chunks for
    # float32/float64 only; 128 (LLaMA's) takes the vector path in every dtype; rotary_dim
    # 14 (7 pairs) takes the element path.
    torch.manual_seed(0)
    B, S = 3, 11
    q = make((B, S, D), layout, dtype, device, heads=6)
    k = make((B, S, D), layout, dtype, device, heads=2)  # GQA: 6 q heads, 2 k heads
    oq, ok = apply_rope(q, k, layout=layout, interleaved=interleaved, rotary_dim=rotary_dim)
    rot = rotary_dim or D
    pos = grid_positions(B, S)
    inv = default_inv_freq(rot, 10000.0)
    check(oq, reference_rope(q.cpu(), layout, pos, inv, rot, interleaved), dtype)
    check(ok, reference_rope(k.cpu(), layout, pos, inv, rot, interleaved), dtype)
    assert oq.shape == q.shape and ok.shape == k.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_positions_and_offsets(device, interleaved):
    torch.manual_seed(1)
    B, S, D = 4, 9, 16
    q = make((B, S, D), "bshd", torch.float64, device, heads=3)
    k = make((B, S, D), "bshd", torch.float64, device, heads=1)  # MQA
    inv = default_inv_freq(D, 500.0)
    cases = [
        dict(positions=torch.randint(0, 100000, (S,))),
        dict(positions=torch.randint(0, 100000, (B, S))),
        dict(positions=torch.randint(0, 1000, (B, S)), offset=17),
        dict(offset=123456),
        dict(offset=torch.tensor([0, 5, 1000, 7])),  # per-sequence KV-cache lengths
        dict(positions=torch.randint(-50, 50, (S,)), offset=torch.tensor([3, 0, 2, 1])),
    ]
    for case in cases:
        kwargs = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in case.items()}
        oq, ok = apply_rope(q, k, base=500.0, interleaved=interleaved, **kwargs)
        pos = grid_positions(B, S, case.get("positions"), case.get("offset", 0))
        check(oq, reference_rope(q.cpu(), "bshd", pos, inv, D, interleaved), torch.float64)
        check(ok, reference_rope(k.cpu(), "bshd", pos, inv, D, interleaved), torch.float64)


@pytest.mark.parametrize("offset", [torch.tensor(True), torch.tensor(2, dtype=torch.int32), torch.tensor(2.0),
                                    torch.tensor([1, 2], dtype=torch.int32)], ids=["bool", "int32", "float", "int32s"])
def test_a_tensor_offset_of_another_dtype_is_refused_by_its_name(offset):
    # The ops call a tensor offset "offsets"; the functions and the module name the argument the user passed.
    from posenc import QKNormRotary, RotaryPositionalEncoding
    from posenc.functional import qk_norm_rope

    q = torch.randn(2, 3, 2, 8)
    expected = rf"expected offset to be an int or an int64 tensor, got a tensor of dtype {offset.dtype}"
    with pytest.raises(TypeError, match="apply_rope: " + expected):
        apply_rope(q, q, offset=offset)
    with pytest.raises(TypeError, match="qk_norm_rope: " + expected):
        qk_norm_rope(q, q, torch.ones(8), torch.ones(8), offset=offset)
    with pytest.raises(TypeError, match="RotaryPositionalEncoding: " + expected):
        RotaryPositionalEncoding(8, max_len=16)(q, q, offset=offset)
    with pytest.raises(TypeError, match=expected):
        QKNormRotary(8)(q, q, offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_sequences_thd(device, dtype, interleaved):
    torch.manual_seed(2)
    lengths = [5, 0, 1, 12, 3]  # an empty sequence too
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    T, D = int(cu[-1]), 32
    q = (torch.randn(T, 4, D, dtype=torch.float64) + 0.3).to(dtype=dtype, device=device)
    k = (torch.randn(T, 2, D, dtype=torch.float64) - 0.2).to(dtype=dtype, device=device)
    inv = default_inv_freq(D, 10000.0)
    for offsets in (None, torch.tensor([7, 0, 100, 3, 2048])):
        off = offsets.to(device) if offsets is not None else 0
        oq, ok = apply_rope(q, k, cu_seqlens=cu.to(device), offset=off, layout="thd", interleaved=interleaved)
        pos = thd_positions(cu, offsets)
        check(oq, reference_rope(q.cpu(), "thd", pos, inv, D, interleaved), dtype)
        check(ok, reference_rope(k.cpu(), "thd", pos, inv, D, interleaved), dtype)
    # An int offset and int64 cu_seqlens as well.
    oq = apply_rope(q, cu_seqlens=cu.long().to(device), offset=11, layout="thd", interleaved=interleaved)
    check(oq, reference_rope(q.cpu(), "thd", thd_positions(cu) + 11, inv, D, interleaved), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_views(device, dtype, interleaved):
    """Slices of a fused qkv projection, a transposed view, a strided last dimension and a
    misaligned storage offset: every one equals the reference on a contiguous copy."""
    torch.manual_seed(3)
    B, S, Hq, Hk, D = 2, 13, 4, 2, 40
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, dtype=torch.float64).to(dtype=dtype, device=device)
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, S, Hk, D)
    assert not q.is_contiguous()
    views = {
        "qkv slices": (q, k, "bshd"),
        "transposed": (q.transpose(1, 2), k.transpose(1, 2), "bhsd"),
        "strided last dim": (
            torch.randn(B, S, Hq, 2 * D, device=device).to(dtype)[..., ::2],
            torch.randn(B, S, Hk, 2 * D, device=device).to(dtype)[..., 1::2],
            "bshd",
        ),
        "storage offset": (
            torch.randn(B * S * Hq * D + 1, device=device).to(dtype)[1:].view(B, S, Hq, D),
            torch.randn(B * S * Hk * D + 3, device=device).to(dtype)[3:].view(B, S, Hk, D),
            "bshd",
        ),
    }
    inv = default_inv_freq(D, 10000.0)
    pos = grid_positions(B, S)
    for qv, kv, layout in views.values():
        oq, ok = apply_rope(qv, kv, layout=layout, interleaved=interleaved)
        check(oq, reference_rope(qv.cpu(), layout, pos, inv, D, interleaved), dtype)
        check(ok, reference_rope(kv.cpu(), layout, pos, inv, D, interleaved), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_tensors(device, dtype):
    for shape_q, shape_k in [((0, 5, 2, 8), (0, 5, 1, 8)), ((2, 0, 2, 8), (2, 0, 1, 8)), ((2, 3, 2, 8), (2, 3, 0, 8))]:
        q = torch.randn(shape_q, device=device).to(dtype)
        k = torch.randn(shape_k, device=device).to(dtype)
        oq, ok = apply_rope(q, k)
        assert oq.shape == q.shape and ok.shape == k.shape
        # The non-empty one of a pair is still rotated (k without heads beside a q with some).
        inv = default_inv_freq(8, 10000.0)
        check(oq, reference_rope(q.cpu().double(), "bshd", grid_positions(*shape_q[:2]), inv, 8, False), dtype)
    q = torch.randn(0, 2, 8, device=device).to(dtype)
    out = apply_rope(q, cu_seqlens=torch.tensor([0], device=device), layout="thd")
    assert out.shape == (0, 2, 8)
    # A q without heads beside a k with some, partial rotary: k's pass-through features are
    # still copied (an empty q has no storage, so "q.in == q.out" says nothing).
    q = torch.randn(2, 3, 0, 8, device=device).to(dtype)
    k = torch.randn(2, 3, 2, 8, device=device).to(dtype)
    oq, ok = apply_rope(q, k, rotary_dim=4)
    assert oq.shape == q.shape
    inv = default_inv_freq(4, 10000.0)
    check(ok, reference_rope(k.cpu().double(), "bshd", grid_positions(2, 3), inv, 4, False), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_relative_position_property(device, interleaved):
    """<R(m) q, R(n) k> depends only on m - n."""
    torch.manual_seed(4)
    D = 64
    q = torch.randn(1, 1, 1, D, dtype=torch.float64, device=device)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64, device=device)

    def score(m, n):
        rq = apply_rope(q, positions=torch.tensor([m], device=device), interleaved=interleaved)
        rk = apply_rope(k, positions=torch.tensor([n], device=device), interleaved=interleaved)
        return float((rq * rk).sum())

    for delta in (0, 1, 7, -13, 1000):
        scores = [score(m, m - delta) for m in (delta + 5, 3000, 2**20, 123457)]
        assert max(scores) - min(scores) < 1e-9 * max(1.0, abs(scores[0])), (delta, scores)
    assert abs(score(10, 3) - score(10, 4)) > 1e-3  # and it does depend on m - n


SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "attention_factor": 1.25},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
@pytest.mark.parametrize("rotary_dim", [128, 96])
def test_scaling_frequencies(scaling, rotary_dim):
    for seq_len in (0, 50, 1000):
        inv, attn = rope_frequencies(rotary_dim, base=500000.0, scaling=scaling, seq_len=seq_len)
        ref, ref_attn = reference_inv_freq(rotary_dim, 500000.0, scaling, seq_len)
        assert inv.dtype == torch.float64 and inv.shape == (rotary_dim // 2,)
        torch.testing.assert_close(inv, ref, atol=0, rtol=1e-13)
        assert attn == pytest.approx(ref_attn, rel=1e-14)
    assert not torch.equal(inv, default_inv_freq(rotary_dim, 500000.0))  # scaling did something


def test_frequencies_under_torch_compile():
    """rope_frequencies in a compiled function (fullgraph): the op has no tensor input, so it
    cannot be a graph node (it failed with "Could not find common device"); the values are
    the eager call's, a fresh tensor per call."""
    scaling = SCALINGS[-1]

    def fn(x):
        inv, attn = rope_frequencies(64, base=500000.0, scaling=scaling, seq_len=100)
        axes, _ = rope_frequencies(48, sections=[8, 8, 8], sections_mode="mrope")
        return x * attn, inv, axes

    got = torch.compile(fn, fullgraph=True)(torch.ones(3))
    want = fn(torch.ones(3))
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.dtype == w.dtype
    torch.testing.assert_close(got[1], reference_inv_freq(64, 500000.0, scaling, 100)[0], atol=0, rtol=1e-13)
    (a, _), (b, _) = rope_frequencies(64), rope_frequencies(64)
    assert a.data_ptr() != b.data_ptr()  # callers may write into their tensor
    # Under compile the eager ValueError reaches the caller as dynamo wraps errors raised
    # while tracing: a RuntimeError whose message starts with the ValueError's.
    with pytest.raises(RuntimeError, match="^ValueError: posenc: expected rotary_dim to be a positive even number, got 63"):
        torch.compile(lambda: rope_frequencies(63), fullgraph=True)()


@pytest.mark.parametrize("rope_type", ["dynamic", "default"])
def test_frequencies_of_a_shape_derived_length_under_torch_compile(rope_type):
    """seq_len from a shape: torch.compile recompiles with that size a symbol, which the
    frequencies' host call cannot take (it raised "SymNodeVariable() is not a constant"):
    "dynamic" gets a graph per length, the default type (which does not read it) one."""
    from torch._dynamo.testing import CompileCounter

    scaling = dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=4) if rope_type == "dynamic" \
        else None

    def fn(x):
        inv, attn = rope_frequencies(16, scaling=scaling, seq_len=x.shape[0])
        return x.sum() * inv * attn

    counter = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for n in (5, 6, 7, 9):
        x = torch.ones(n, dtype=torch.float64)
        assert torch.equal(compiled(x), fn(x))
    if rope_type == "dynamic":
        assert counter.frame_count == 4
    else:  # 5, then a symbolic length (one graph when Dynamo already holds this code's shapes dynamic)
        assert counter.frame_count <= 2


def test_frequencies_of_changing_settings_under_torch_compile():
    """rotary_dim, base and scaling values that change between calls (Dynamo makes them symbols
    on the recompile), or under dynamic=True: specialised, as rope_cos_sin's are, with the
    eager numbers (they reached the host call as symbols)."""
    calls = {
        "rotary_dim": (lambda x, v: rope_frequencies(v)[0] * x, (8, 16, 32)),
        "base": (lambda x, v: rope_frequencies(16, base=v)[0] * x, (100.0, 500.0, 900.0)),
        "factor": (lambda x, v: rope_frequencies(16, scaling=dict(rope_type="yarn", factor=v,
                                                                   original_max_position_embeddings=4.0))[0] * x,
                   (2.0, 4.0, 8.0)),
        "seq_len": (lambda x, v: rope_frequencies(16, scaling=dict(rope_type="dynamic", factor=2.0,
                                                                    original_max_position_embeddings=4),
                                                  seq_len=v)[0] * x, (3, 9, 2**63 - 1)),
    }
    for name, (fn, values) in calls.items():
        for dynamic in (None, True):
            compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
            for v in values:
                assert torch.equal(compiled(torch.ones(()), v), fn(torch.ones(()), v)), (name, v, dynamic)
    # A negative length is the op's ValueError under compile too (Dynamo wraps it).
    with pytest.raises(Exception, match="expected seq_len >= 0, got -7"):
        torch.compile(lambda x: rope_frequencies(16, seq_len=x.shape[0] - 10)[0], dynamic=True, fullgraph=True)(
            torch.ones(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_scaled_rotation(device, scaling):
    torch.manual_seed(5)
    B, S, D = 2, 80, 32
    q = make((B, S, D), "bshd", torch.float64, device, heads=2)
    k = make((B, S, D), "bshd", torch.float64, device, heads=1)
    offset = 30
    oq, ok = apply_rope(q, k, offset=offset, scaling=scaling, base=10000.0)
    # dynamic: the call's longest position + 1 (here 110 > original 64) sets the frequencies.
    inv, attn = reference_inv_freq(D, 10000.0, scaling, seq_len=S + offset)
    pos = grid_positions(B, S, offset=offset)
    check(oq, reference_rope(q.cpu(), "bshd", pos, inv, D, False, attn), torch.float64)
    check(ok, reference_rope(k.cpu(), "bshd", pos, inv, D, False, attn), torch.float64)


def test_hf_float32_frequencies_agree():
    """transformers computes inv_freq in float32: we agree to float32 rounding."""
    dim, base = 128, 500000.0
    hf = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv, _ = rope_frequencies(dim, base=base)
    torch.testing.assert_close(inv.float(), hf, atol=0, rtol=2.5e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_long_position_accuracy(device):
    """Angle error at positions up to 2**20 against float64: posenc (float32 output) vs a plain
    float32 `pos * inv_freq`; must be at least 100x smaller. Measured numbers in the README."""
    D = 128
    pos = torch.cat([torch.arange(0, 2**20 + 1, 4099), torch.tensor([2**20 - 1, 2**20])])
    x = torch.zeros(1, pos.numel(), 1, D)
    x[..., : D // 2] = 1.0  # (1, 0) in every pair: the output is (cos, sin)
    out = apply_rope(x.to(device), positions=pos.to(device)).cpu()
    inv = default_inv_freq(D, 10000.0)
    exact = pos.to(torch.float64)[:, None] * inv
    ours_err = torch.maximum((out[0, :, 0, : D // 2].double() - exact.cos()).abs(), (out[0, :, 0, D // 2 :].double() - exact.sin()).abs()).max().item()
    plain = pos.float()[:, None] * inv.float()
    plain_err = torch.maximum((plain.cos().double() - exact.cos()).abs(), (plain.sin().double() - exact.sin()).abs()).max().item()
    print(f"max |error| at positions <= 2**20: posenc {ours_err:.3g}, plain float32 {plain_err:.3g}")
    assert plain_err > 1e-2  # the float32 product really is that far off
    assert ours_err * 100 <= plain_err
    assert ours_err < 1e-6


@pytest.mark.parametrize("through", ["kernel", "composite"])
@pytest.mark.parametrize("D", [2, 34])
def test_float32_angles_accurate_at_every_accepted_position(D, through):
    """Positions are accepted in [-2**53, 2**53]; the float32 cos and sin are within 1.5e-7
    of float64 ones of the same double angle over all of it. Past |angle| ~ 2**49 the
    reduction's quotient k came out one off (the rounded product angle * 2/pi), leaving
    |r| up to pi/2 for polynomials made for pi/4: 1.2e-4 off in [2**52, 2**53). D=2: the
    frequency is 1 (the angle is the position, exact); D=34: 17 pairs, the vector lanes and
    the scalar tail."""
    from aten_fallback_mode import ThroughTheFallback
    import contextlib

    g = torch.Generator().manual_seed(5)
    pos = torch.cat([torch.randint(2**e, 2**(e + 1), (200,), generator=g) for e in (20, 44, 49, 51, 52)])
    pos = torch.cat([pos, -pos, torch.tensor([2**53, -2**53, 2**53 - 1])])
    x = torch.zeros(1, pos.numel(), 1, D)
    x[..., : D // 2] = 1.0  # (1, 0) in every pair: the output is (cos, sin)
    with ThroughTheFallback() if through == "composite" else contextlib.nullcontext():
        out = apply_rope(x, positions=pos)
    inv, _ = rope_frequencies(D)
    angle = pos.to(torch.float64)[:, None] * inv  # the double angle the kernels reduce
    err = torch.maximum((out[0, :, 0, : D // 2].double() - angle.cos()).abs(),
                        (out[0, :, 0, D // 2 :].double() - angle.sin()).abs())
    assert err.max().item() < 1.5e-7, err.max(dim=1).values.view(-1)[:: 200]


@pytest.mark.parametrize("through", ["kernel", "composite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_angles_beyond_2_pow_53_times_pi_over_2(dtype, through):
    """Summed positions (a position plus a per-row offset, each up to 2**53) and frequencies
    above 1 (linear factor 0.5) give angles up to 2**55. Past 2**53 * pi/2 the reduction's
    quotient k0 is even and k0 + 1 not representable: the quadrant stayed k0's while the
    remainder took the step, a quarter turn off (cos and sin swapped, 1.41 off, float32 and
    float64, in every RoPE kernel); and the quotient can be two off, two steps back. Each
    output within float rounding of torch's cos / sin of the same double angle."""
    from aten_fallback_mode import ThroughTheFallback
    import contextlib

    g = torch.Generator().manual_seed(11)
    pos = torch.randint(2**52, 2**53 + 1, (2, 300), generator=g)
    offsets = torch.tensor([2**53, 2**53 - 12345])
    linear = {"rope_type": "linear", "factor": 0.5}  # inv_freq 2, 0.2, 0.02, ...
    x = torch.zeros(2, 300, 1, 8, dtype=dtype)
    x[..., :4] = 1.0  # (1, 0) in every pair: the output is (cos, sin)
    with ThroughTheFallback() if through == "composite" else contextlib.nullcontext():
        out = apply_rope(x, positions=pos, offset=offsets, scaling=linear)
    inv, _ = rope_frequencies(8, scaling=linear)
    angle = (pos + offsets[:, None]).to(torch.float64)[..., None] * inv
    assert angle.abs().max().item() > 2**54  # beyond 2**53 * pi/2 by far
    err = torch.maximum((out[..., 0, :4].double() - angle.cos()).abs(), (out[..., 0, 4:].double() - angle.sin()).abs())
    assert err.max().item() < (1.5e-7 if dtype == torch.float32 else 1e-13), err.max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_reads_longest_position(device):
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64, device=device)
    positions = torch.tensor([[0, 1, 2, 3], [40, 41, 42, 99]], device=device)
    out = apply_rope(q, positions=positions, scaling=scaling)
    inv, _ = reference_inv_freq(8, 10000.0, scaling, seq_len=100)
    check(out, reference_rope(q.cpu(), "bshd", positions.cpu(), inv, 8, False), torch.float64)


def token_bounds(pos):
    """(min, max) of a call's per-token positions written out, (0, -1) when there is none."""
    return (int(pos.min()), int(pos.max())) if pos.numel() > 0 else (0, -1)


@pytest.mark.parametrize("device", DEVICES)
def test_position_bounds_are_exact(device):
    """posenc::rope_position_bounds against every token's position, written out. The
    (batch, seq) positions + per-row offsets case is where a min + min bound would be loose."""
    def bounds(q, positions, offsets, offset, cu_seqlens, layout):
        return torch.ops.posenc.rope_position_bounds(
            q, positions=positions, offsets=offsets, offset=offset, cu_seqlens=cu_seqlens, layout=layout
        )

    q = torch.randn(2, 3, 1, 4, device=device)
    pos2 = torch.tensor([[0, 1, 2], [100, 101, 102]], device=device)
    offs = torch.tensor([100, 0], device=device)
    pos1 = torch.tensor([5, 3, 9], device=device)
    cases = [
        (None, None, 7, grid_positions(2, 3, offset=7)),
        (pos1, None, 0, grid_positions(2, 3, pos1)),
        (pos1, offs, 2, grid_positions(2, 3, pos1, offs) + 2),
        (pos2, offs, 0, grid_positions(2, 3, pos2, offs)),  # 100..102, not 100..202
        (pos2, None, -4, grid_positions(2, 3, pos2) - 4),
        (None, offs, 1, grid_positions(2, 3, offset=offs) + 1),
    ]
    for positions, offsets, offset, want in cases:
        assert bounds(q, positions, offsets, offset, None, "bshd") == token_bounds(want)
    # The layouts read seq from their own dimension.
    qt = q.transpose(1, 2).contiguous()
    assert bounds(qt, None, None, 0, None, "bhsd") == (0, 2)
    assert bounds(q, None, None, 0, None, "sbhd") == (0, 1)  # (seq=2, batch=3, ...)
    # Packed sequences: empty ones (even with a large offset) hold no position.
    cu = torch.tensor([0, 5, 5, 6, 18, 21], dtype=torch.int32)
    qp = torch.randn(21, 1, 4, device=device)
    for offsets in (None, torch.tensor([7, 5000, 100, 3, 2048]), torch.tensor([7, 5000, 100, 3, -9])):
        got = bounds(qp, None, None if offsets is None else offsets.to(device), 3, cu.to(device), "thd")
        assert got == token_bounds(thd_positions(cu, offsets) + 3)
    all_empty = torch.tensor([0, 0, 0], device=device)
    assert bounds(qp[:0], None, torch.tensor([4, 9], device=device), 0, all_empty, "thd") == (0, -1)
    # Nothing to rotate: empty batch or sequence.
    assert bounds(q[:0], pos2[:0], offs[:0], 0, None, "bshd") == (0, -1)
    assert bounds(q[:, :0], None, None, 5, None, "bshd") == (0, -1)
    # The rope op's own checks apply.
    with pytest.raises(ValueError, match="cu_seqlens"):
        bounds(qp, None, None, 0, None, "thd")
    with pytest.raises(RuntimeError, match=r"positions of shape \(seq,\)"):
        bounds(q, pos2[:, :2], None, 0, None, "bshd")
    with pytest.raises(TypeError, match="offsets to have dtype torch.int64"):
        bounds(q, None, offs.int(), 0, None, "bshd")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 128])
def test_half_precision_rotates_in_float32(device, dtype, D):
    """float16/bfloat16 inputs are rotated in float32 and rounded once: bit-equal to rotating
    the same values in float32 and rounding the result (a half-precision rotation is not)."""
    torch.manual_seed(5)
    q = torch.randn(2, 7, 3, D, device=device).to(dtype)
    k = torch.randn(2, 7, 1, D, device=device).to(dtype)
    pos = torch.randint(0, 50000, (2, 7), device=device)
    for interleaved in (False, True):
        oq, ok = apply_rope(q, k, positions=pos, interleaved=interleaved)
        wq, wk = apply_rope(q.float(), k.float(), positions=pos, interleaved=interleaved)
        assert torch.equal(oq, wq.to(dtype)) and torch.equal(ok, wk.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_module_dynamic_scales_beyond_the_trained_context(device):
    """The module with "dynamic": positions within original_max_position_embeddings rotate as
    unscaled RoPE, longer calls rescale by their longest position, up to max_len."""
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}
    rope = posenc.RotaryPositionalEncoding(8, max_len=64, scaling=scaling).to(device)
    q = torch.randn(2, 40, 1, 8, dtype=torch.float64, device=device)
    short = rope(q[:, :16])
    check(short, reference_rope(q[:, :16].cpu(), "bshd", grid_positions(2, 16), default_inv_freq(8, 10000.0), 8, False), torch.float64)
    long = rope(q, offset=20)  # positions 20..59: the call's length 60 sets the base
    inv, _ = reference_inv_freq(8, 10000.0, scaling, seq_len=60)
    assert not torch.allclose(inv, default_inv_freq(8, 10000.0))
    check(long, reference_rope(q.cpu(), "bshd", grid_positions(2, 40, offset=20), inv, 8, False), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_module_dynamic_reads_tensor_positions_once(device):
    """With tensor positions the module's range check already reads the longest position;
    it hands it to the op (seq_len = longest + 1) instead of the op reading the tensors
    again ("dynamic" would otherwise pass -1), and the numbers are those of that length."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordRope(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seq_lens = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.posenc.rope.default:
                self.seq_lens.append(args[9])
            return func(*args, **(kwargs or {}))

    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    rope = posenc.RotaryPositionalEncoding(8, max_len=64, scaling=scaling).to(device)
    q = torch.randn(2, 5, 1, 8, dtype=torch.float64, device=device)
    positions = torch.tensor([[0, 3, 9, 2, 40], [1, 1, 7, 50, 6]], device=device)
    with RecordRope() as mode:
        out = rope(q, positions=positions)
    assert mode.seq_lens == [51]
    inv, _ = reference_inv_freq(8, 10000.0, scaling, seq_len=51)
    check(out, reference_rope(q.cpu(), "bshd", positions.cpu(), inv, 8, False), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_ignores_empty_packed_sequences(device):
    """"dynamic" scales by the longest position rotated; an empty sequence's offset is not one."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    cu = torch.tensor([0, 6, 6, 30], device=device)
    offsets = torch.tensor([0, 1000, 4], device=device)
    q = torch.randn(30, 1, 8, dtype=torch.float64, device=device)
    out = apply_rope(q, cu_seqlens=cu, offset=offsets, scaling=scaling, layout="thd")
    inv, _ = reference_inv_freq(8, 10000.0, scaling, seq_len=28)  # longest: 4 + 23
    pos = thd_positions(cu.cpu(), offsets.cpu())
    check(out, reference_rope(q.cpu(), "thd", pos, inv, 8, False), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_undoes_rotation(device, interleaved):
    """The op's inverse=True (what backward runs) undoes the rotation, pass-through included."""
    q = torch.randn(2, 7, 3, 20, dtype=torch.float64, device=device)
    args = dict(offset=5, base=333.0, rotary_dim=12, interleaved=interleaved)
    rq, _ = torch.ops.posenc.rope(q, **args, inverse=False)
    back, _ = torch.ops.posenc.rope(rq, **args, inverse=True)
    torch.testing.assert_close(back, q, atol=1e-13, rtol=0)
    assert not torch.allclose(rq[..., :12], q[..., :12])
    assert torch.equal(rq[..., 12:], q[..., 12:])


class TestModule:
    def test_state_dict_and_buffer(self):
        rope = posenc.RotaryPositionalEncoding(64, max_len=128, base=500000.0)
        assert list(rope.state_dict()) == []
        assert rope.inv_freq.dtype == torch.float32 and rope.inv_freq.shape == (32,)
        torch.testing.assert_close(rope.inv_freq, default_inv_freq(64, 500000.0).float(), atol=0, rtol=0)
        scaled = posenc.RotaryPositionalEncoding(
            64, max_len=128, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        )
        ref, attn = reference_inv_freq(64, 10000.0, scaled.scaling)
        torch.testing.assert_close(scaled.inv_freq, ref.float(), atol=0, rtol=0)
        assert scaled.attention_scaling == pytest.approx(attn)
        assert "yarn" in repr(scaled)

    @pytest.mark.parametrize("device", DEVICES)
    def test_forward_forms(self, device):
        torch.manual_seed(6)
        rope = posenc.RotaryPositionalEncoding(16, max_len=64, interleaved=True).to(device)
        q = torch.randn(2, 5, 4, 16, dtype=torch.float64, device=device)
        k = torch.randn(2, 5, 2, 16, dtype=torch.float64, device=device)
        inv = default_inv_freq(16, 10000.0)
        oq, ok = rope(q, k, offset=3)
        pos = grid_positions(2, 5, offset=3)
        check(oq, reference_rope(q.cpu(), "bshd", pos, inv, 16, True), torch.float64)
        check(ok, reference_rope(k.cpu(), "bshd", pos, inv, 16, True), torch.float64)
        x = rope(q)  # one tensor, torchtune's form
        check(x, reference_rope(q.cpu(), "bshd", grid_positions(2, 5), inv, 16, True), torch.float64)
        offsets = torch.tensor([10, 59], device=device)
        oq, _ = rope(q, k, offset=offsets)
        check(oq, reference_rope(q.cpu(), "bshd", grid_positions(2, 5, offset=offsets), inv, 16, True), torch.float64)

    @pytest.mark.parametrize("device", DEVICES)
    def test_positions_beyond_max_len_raise(self, device):
        rope = posenc.RotaryPositionalEncoding(8, max_len=32)
        q = torch.randn(2, 4, 1, 8, device=device)
        with pytest.raises(IndexError, match=r"max_len=32\), found 32 \(positions range from 29 to 32\)"):
            rope(q, offset=29)
        with pytest.raises(IndexError, match="max_len=32"):
            rope(q, positions=torch.tensor([0, 1, 2, 32], device=device))
        with pytest.raises(IndexError, match="from -1"):
            rope(q, positions=torch.tensor([-1, 1, 2, 3], device=device))
        with pytest.raises(IndexError, match="max_len=32"):
            rope(q, offset=torch.tensor([0, 29], device=device))
        packed = posenc.RotaryPositionalEncoding(8, max_len=4, layout="thd")
        with pytest.raises(IndexError, match=r"max_len=4\), found 4 \(positions range from 0 to 4\)"):
            packed(torch.randn(7, 1, 8, device=device), cu_seqlens=torch.tensor([0, 2, 7], device=device))
        assert rope(q, offset=28).shape == q.shape  # 28..31 is fine
        # offset + seq - 1 past int64 (as the C++ module: an IndexError, not the schema's
        # RuntimeError about an int); at the very end of int64, max_len too.
        int64_max = 2**63 - 1
        for offset in (int64_max - 2, int64_max):
            with pytest.raises(IndexError, match=rf"max_len=32\), found {offset} \(positions range from {offset} to "
                                                 rf"{offset} \+ 3\)"):
                rope(q, offset=offset)
        with pytest.raises(IndexError, match=rf"max_len={int64_max}\), found {int64_max} "):
            posenc.RotaryPositionalEncoding(8, max_len=int64_max)(q, offset=int64_max - 1)
        # Exact bounds: row 0 holds 29..31 + 0, row 1 holds 0..3 + 28; both inside.
        positions = torch.tensor([[29, 30, 31, 31], [0, 1, 2, 3]], device=device)
        assert rope(q, positions=positions, offset=torch.tensor([0, 28], device=device)).shape == q.shape

    def test_arguments_are_checked(self):
        with pytest.raises(ValueError, match="rotary_dim"):
            posenc.RotaryPositionalEncoding(8, rotary_dim=7)
        with pytest.raises(ValueError, match="rotary_dim"):
            posenc.RotaryPositionalEncoding(8, rotary_dim=10)
        with pytest.raises(ValueError, match="layout"):
            posenc.RotaryPositionalEncoding(8, layout="bsdh")
        with pytest.raises(ValueError, match="head_dim 8"):
            posenc.RotaryPositionalEncoding(8)(torch.randn(1, 2, 1, 6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_code_path_gives_the_same_bits(device, dtype, interleaved):
    """The vectorised path (contiguous rows), the element-wise path (strided rows, or a
    misaligned start) and in place round the pair rotation alike (math::rope_rotate_pair):
    bitwise equal results. Compilers contracting x1*c - x2*s into FMAs differently per path
    made them differ by 1 ulp."""
    torch.manual_seed(3)
    q = (torch.randn(2, 33, 3, 128, dtype=torch.float64) * 3).to(dtype=dtype, device=device)
    pos = torch.randint(0, 10**6, (33,), device=device)
    want = apply_rope(q, positions=pos, interleaved=interleaved)
    strided = torch.zeros(2, 33, 3, 256, dtype=dtype, device=device)
    strided[..., ::2] = q
    assert torch.equal(apply_rope(strided[..., ::2], positions=pos, interleaved=interleaved), want)
    shifted = torch.zeros(2 * 33 * 3 * 128 + 1, dtype=dtype, device=device)[1:].view(2, 33, 3, 128)
    shifted.copy_(q)  # rows one element off their usual alignment
    assert torch.equal(apply_rope(shifted, positions=pos, interleaved=interleaved), want)
    apply_rope(shifted, positions=pos, interleaved=interleaved, inplace=True)
    assert torch.equal(shifted, want)


@pytest.mark.parametrize("dtype,interleaved,rotary_dim,layout", [
    (torch.float32, False, None, "bshd"),
    (torch.float32, True, None, "bhsd"),
    (torch.bfloat16, False, 96, "bshd"),
    (torch.bfloat16, True, None, "sbhd"),
    (torch.float32, False, 40, "bshd"),  # halves of 80 bytes: not 32-byte aligned, plain stores
])
def test_large_call_streams_with_the_bits_of_small_calls(dtype, interleaved, rotary_dim, layout):
    """An out-of-place call that writes 12 MiB (float32; 6 MiB + the backward's in bfloat16
    at S 4096) takes the CPU kernel's streaming stores (kStreamBytes, rope_rows.h) where its
    rows are aligned: the same bits as eight calls small enough for plain stores, forward
    and backward, and the float64 reference's values. (objdump: the AVX2 object has them.)"""
    torch.manual_seed(21)
    S = 2048 if dtype == torch.float32 else 4096
    B, Hq, Hk, D = 1, 8, 4, 128
    q, k = make((B, S, D), layout, dtype, "cpu", Hq), make((B, S, D), layout, dtype, "cpu", Hk)
    q.requires_grad_(True)
    kw = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, offset=9)
    out_q, out_k = apply_rope(q, k, **kw)
    rot = D if rotary_dim is None else rotary_dim
    pos = grid_positions(B, S, offset=9)
    check(out_q.detach(), reference_rope(q.detach(), layout, pos, default_inv_freq(rot, 10000.0), rot, interleaved),
          dtype)
    check(out_k, reference_rope(k, layout, pos, default_inv_freq(rot, 10000.0), rot, interleaved), dtype)
    grad = torch.randn_like(out_q)
    (grad_q,) = torch.autograd.grad(out_q, q, grad)
    seq_dim = {"bshd": 1, "bhsd": 2, "sbhd": 0}[layout]
    chunk = S // 8
    parts_q, parts_k, parts_g = [], [], []
    for start in range(0, S, chunk):
        q_part = q.detach().narrow(seq_dim, start, chunk).clone().requires_grad_(True)
        pq, pk = apply_rope(q_part, k.narrow(seq_dim, start, chunk), **dict(kw, offset=9 + start))
        (pg,) = torch.autograd.grad(pq, q_part, grad.narrow(seq_dim, start, chunk))
        parts_q.append(pq.detach())
        parts_k.append(pk)
        parts_g.append(pg)
    assert torch.equal(out_q.detach(), torch.cat(parts_q, seq_dim))
    assert torch.equal(out_k, torch.cat(parts_k, seq_dim))
    assert torch.equal(grad_q, torch.cat(parts_g, seq_dim))


def test_an_edited_inv_freq_is_warned_about_not_ignored_silently():
    """forward never reads inv_freq (the kernels evaluate the frequencies from the
    configuration): an edit of it, as Hugging Face users patch theirs, changed nothing and
    said nothing (the rotation stayed the configured one, 3.7 away from the edited one's).
    Now the buffer is compared with the configuration's when its version or identity
    changed: an edit is a UserWarning, once per change; a dtype round trip, a copy, a
    pickle and reset_parameters are not."""
    import copy
    import io
    import warnings

    rope = posenc.RotaryPositionalEncoding(16, max_len=64, scaling={"rope_type": "linear", "factor": 2.0})
    q = torch.randn(1, 4, 2, 16)
    want = rope(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        rope.half().float()
        assert torch.equal(rope(q), want)
        copy.deepcopy(rope)(q)
        buffer = io.BytesIO()
        torch.save(rope, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=False)(q)
        torch.func.functional_call(rope, {"inv_freq": rope.inv_freq.clone()}, (q,))
    rope.inv_freq.mul_(0.5)
    with pytest.warns(UserWarning, match=r"inv_freq differs from the frequencies of the module's configuration"):
        got = rope(q)
    assert torch.equal(got, want)  # what the warning says: the configured rotation
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope(q)  # once per change
        rope.reset_parameters()
        rope(q)
    with pytest.warns(UserWarning, match="inv_freq differs"):
        torch.func.functional_call(rope, {"inv_freq": rope.inv_freq * 2}, (q,))
    with torch.device("meta"):
        empty = posenc.RotaryPositionalEncoding(16, max_len=64)
    empty.to_empty(device="cpu")
    with torch.no_grad():
        empty.inv_freq.fill_(float("nan"))
    with pytest.warns(UserWarning, match=r"reset_parameters\(\) restores it"):
        empty(q)
    # Built or called under inference mode: its inv_freq is then an inference tensor, which has
    # no version counter (reading it raised in every forward, found by a review).
    with torch.inference_mode():
        served = posenc.RotaryPositionalEncoding(16, max_len=64, scaling={"rope_type": "linear", "factor": 2.0})
        assert torch.equal(served(q), want)
    assert torch.equal(served(q), want)


def test_an_inv_freq_made_a_parameter_is_warned_about():
    """inv_freq made a Parameter (learnable frequencies, as some fine-tuning recipes do with
    Hugging Face's buffer) left the buffer slot empty, and the edit check skipped it: no
    gradient reached it and training it changed nothing, silently. Now a trainable one is a
    UserWarning, once per Parameter (also on a device: no value is read)."""
    import warnings

    rope = posenc.RotaryPositionalEncoding(16, max_len=64)
    q = torch.randn(1, 4, 2, 16)
    want = rope(q)
    rope.inv_freq = torch.nn.Parameter(rope.inv_freq.clone())
    with pytest.warns(UserWarning, match="inv_freq is a Parameter, but forward does not read it"):
        assert torch.equal(rope(q), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope(q)  # once per Parameter
        rope.inv_freq = torch.nn.Parameter(rope.inv_freq.detach().clone(), requires_grad=False)
        rope(q)  # frozen, the configuration's values: nothing to say
    with torch.no_grad():
        rope.inv_freq.mul_(2)  # a frozen edited one is an edit, as a buffer's
    with pytest.warns(UserWarning, match="inv_freq differs from the frequencies"):
        assert torch.equal(rope(q), want)
    rope.inv_freq = torch.nn.Parameter(rope.inv_freq.detach())
    with pytest.warns(UserWarning, match="gets no gradient and training it changes nothing"):
        rope(q)


def test_a_parametrized_inv_freq_is_warned_about():
    """A parametrization of inv_freq (torch.nn.utils.parametrize) left neither a buffer nor a
    parameter of that name, so the edit check skipped it: a doubling changed nothing, silently."""
    import warnings

    class Double(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    rope = posenc.RotaryPositionalEncoding(16, max_len=64)
    q = torch.randn(1, 4, 2, 16)
    want = rope(q)
    torch.nn.utils.parametrize.register_parametrization(rope, "inv_freq", Double())
    with pytest.warns(UserWarning, match="inv_freq is parametrized, but forward does not read it"):
        assert torch.equal(rope(q), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope(q)  # once per module


@pytest.mark.parametrize("context", ["device", "default_device"])
def test_inv_freq_is_made_on_the_default_device(context):
    """Under `with torch.device("meta")` or set_default_device the module's inv_freq was a CPU
    tensor (the frequencies' op takes no tensor): meta construction allocated and mixed devices."""
    if context == "device":
        with torch.device("meta"):
            rope = posenc.RotaryPositionalEncoding(16, max_len=64)
    else:
        before = torch.get_default_device()
        torch.set_default_device("meta")
        try:
            rope = posenc.RotaryPositionalEncoding(16, max_len=64)
        finally:
            torch.set_default_device(before)
    assert rope.inv_freq.is_meta and rope.inv_freq.dtype == torch.float32
    rope.to_empty(device="cpu")
    rope.reset_parameters()
    torch.testing.assert_close(rope.inv_freq, posenc.RotaryPositionalEncoding(16, max_len=64).inv_freq,
                               rtol=0, atol=0)


def test_device_factory_argument_places_inv_freq():
    """``device=`` (Hugging Face's rotary embeddings take one) places ``inv_freq``; forward
    does not read it (the kernel evaluates the frequencies), so a meta one still rotates."""
    rope = posenc.RotaryPositionalEncoding(8, 16, device="meta")
    assert rope.inv_freq.is_meta and rope.inv_freq.dtype == torch.float32
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    assert torch.equal(rope(q), posenc.RotaryPositionalEncoding(8, 16)(q))
    rope.to_empty(device="cpu")
    rope.reset_parameters()
    assert torch.equal(rope.inv_freq, posenc.RotaryPositionalEncoding(8, 16).inv_freq)
