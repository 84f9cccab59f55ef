"""rope_shift_kv (issue 39, item 3): cached keys re-rotated in place from the positions they
were written at to new ones.

The contract: for random k and every scaling type, rope_shift_kv(rope(k at old positions, old
configuration), ...) equals rope(k at new positions, new configuration) within float32
rounding, where a configuration is the RoPE settings with the seq_len its length-scaled type
scales for (dynamic NTK, longrope's short -> long switch). Then every layout (contiguous with
rows, paged with -1 slots), dtype, FP8 caches (against dequantise - rotate - requantise in
plain PyTorch), RoPE features, rows not listed keep their bits, errors naming the argument,
opcheck, torch.compile, the ATen fallback, CUDA against the CPU.

Every expected value is computed here in float64 plain PyTorch from the formulas, not by
posenc: the frequencies of rope_reference.reference_inv_freq (Hugging Face's scaling types),
multi_axis_reference.generic_inv_freq_and_axis (multi-axis RoPE), and below "longrope" and
"proportional" from transformers' modeling_rope_utils; a shifted row is turned by (the new
angle at the new position - the old angle at the old position), its rotated features times
new attention factor / old attention factor (the factor written once stays once)."""


import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from posenc.functional import apply_rope, rope_append_kv, rope_shift_kv
from multi_axis_reference import generic_inv_freq_and_axis
from rope_reference import longrope_inv_freq, proportional_inv_freq, reference_inv_freq, scaling_samples
from conftest import host_levels

F64 = torch.float64
D = 16
SCALINGS = scaling_samples(D)  # a valid configuration of every type
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=3e-6, rtol=3e-6),
}
PRECISION = {torch.float16: 11, torch.bfloat16: 8}  # significand bits


def assert_shift_close(got, want):
    """got (the op's cache) against the float64 want: float32 and float64 to TOL; half
    precision is turned in float32 and rounded once (docs/guide/kv_shift.md): within half an
    ulp of its dtype (the larger of got's and want's) plus the float32 turn's rounding."""
    if got.dtype not in PRECISION:
        torch.testing.assert_close(got.to(F64), want, **TOL[got.dtype])
        return
    g, p = got.to(F64), PRECISION[got.dtype]
    tiny = torch.finfo(got.dtype).smallest_normal * 2.0 ** (1 - p)  # the subnormals' spacing
    ulp = torch.maximum(*(torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - p).clamp_min(tiny) for x in (g, want)))
    err = (g - want).abs()
    assert (err <= ulp / 2 + TOL[torch.float32]["atol"] + TOL[torch.float32]["rtol"] * want.abs()).all(), \
        float((err / ulp).max())


def rand(*shape, dtype=F64, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.rand(*shape, dtype=F64, generator=g) * 4 - 2).to(dtype)


# ---- The independent reference (float64, plain PyTorch)


def rotary_part(cfg, head_dim):
    """(first rotated feature, rotated width) of a configuration over heads of head_dim features."""
    offset = cfg.get("rotary_offset", 0)
    if cfg.get("sections"):
        return offset, 2 * sum(cfg["sections"])
    return offset, cfg.get("rotary_dim") or head_dim - offset


def frequencies(cfg, width, seq_len):
    """(inv_freq (width/2,), axis of each pair (width/2,), attention factor) in float64."""
    base = cfg.get("base", 10000.0)
    scaling = cfg.get("scaling")
    if cfg.get("sections"):
        assert scaling is None
        inv, axis = generic_inv_freq_and_axis(cfg["sections"], cfg.get("sections_mode", "axial"), base)
        return inv, axis, 1.0
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "longrope":
        inv, attn = longrope_inv_freq(width, base, scaling, seq_len)
    elif kind == "proportional":
        inv, attn = proportional_inv_freq(width, base, scaling)
    else:
        inv, attn = reference_inv_freq(width, base, scaling, seq_len)
    return inv, torch.zeros(width // 2, dtype=torch.int64), attn


def angles(positions, inv, axis, multi_axis):
    """float64 angles (batch or 1, n, pairs) of positions (n,) / (batch, n), or with a leading
    axis of n_axes for multi-axis RoPE: pair p turns by positions[axis[p]] * inv[p]."""
    pos = positions.to(F64)
    if not multi_axis:
        pos = pos[None]
    if pos.dim() == 2:
        pos = pos[:, None, :]
    return (pos[axis] * inv[:, None, None]).permute(1, 2, 0)


def turn(x, angle, offset, interleaved, scale=1.0):
    """x (..., head_dim) float64 with its pairs turned by angle (..., pairs) (broadcast) and the
    turned features times scale: pairs (offset + p, offset + p + pairs) (halves, rotate_half) or
    (offset + 2p, offset + 2p + 1) (interleaved); the other features as they are."""
    half = angle.shape[-1]
    p = torch.arange(half)
    i1, i2 = (offset + 2 * p, offset + 2 * p + 1) if interleaved else (offset + p, offset + p + half)
    a, b = x[..., i1], x[..., i2]
    c, s = angle.cos(), angle.sin()
    out = x.clone()
    out[..., i1] = (a * c - b * s) * scale
    out[..., i2] = (b * c + a * s) * scale
    return out


def longest(positions):
    """The default seq_len of a call: its longest position + 1."""
    return int(positions.max()) + 1 if positions.numel() else 0


def rope_ref(k, positions, seq_len=None, **cfg):
    """k (batch, n, heads, head_dim) rotated at positions by the configuration (attention factor
    included), in float64: what apply_rope / rope_append_kv write."""
    offset, width = rotary_part(cfg, k.shape[-1])
    multi = bool(cfg.get("sections"))
    inv, axis, attn = frequencies(cfg, width, longest(positions) if seq_len is None else seq_len)
    return turn(k.to(F64), angles(positions, inv, axis, multi)[:, :, None, :], offset, cfg.get("interleaved", False),
                attn)


def shift_ref(x, old, new, from_seq_len=None, to_seq_len=None, **cfg):
    """Rows x (batch, n, heads, head_dim) written at old, moved to new, in float64: turned back
    by the old angle (divided by the old attention factor) and forward by the new one (times
    the new attention factor)."""
    offset, width = rotary_part(cfg, x.shape[-1])
    multi = bool(cfg.get("sections"))
    inv_old, axis, attn_old = frequencies(cfg, width, longest(old) if from_seq_len is None else from_seq_len)
    inv_new, _, attn_new = frequencies(cfg, width, longest(new) if to_seq_len is None else to_seq_len)
    angle = angles(new, inv_new, axis, multi) - angles(old, inv_old, axis, multi)
    return turn(x.to(F64), angle[:, :, None, :], offset, cfg.get("interleaved", False), attn_new / attn_old)


def test_the_reference_agrees_with_rope_reference():
    """The helpers above against rope_reference's own rotation (rope_neox, rope_gptj)."""
    from rope_reference import reference_rope

    k = rand(2, 12, 3, D, seed=9)
    pos = torch.arange(30, 42)
    for name in ("default", "linear", "dynamic", "yarn", "llama3"):
        for interleaved in (False, True):
            inv, attn = reference_inv_freq(D, 10000.0, SCALINGS[name], 42)
            want = reference_rope(k, "bshd", pos.expand(2, 12), inv, D, interleaved, attn)
            got = rope_ref(k, pos, scaling=SCALINGS[name], interleaved=interleaved)
            torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-13)


# ---- The contract


# (old positions, old seq_len, new positions, new seq_len): a shift down (StreamingLLM), a shift
# up past original_max_position_embeddings (dynamic rescales, longrope switches short -> long),
# and back (long -> short).
MOVES = {
    "down": (torch.arange(8, 20), 20, torch.arange(4, 16), 16),
    "short_to_long": (torch.arange(0, 12), 12, torch.arange(30, 42), 42),
    "long_to_short": (torch.arange(30, 42), 42, torch.arange(0, 12), 12),
    "far": (torch.arange(5, 17) * 1000 + 7, 17000, torch.arange(0, 12) * 3, 40),
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("move", list(MOVES))
def test_the_contract_every_scaling_type(name, move):
    """rope_shift_kv(rope(k, old), old -> new) == rope(k, new) (the float64 reference), for the
    cache written by the reference, by apply_rope and by rope_append_kv (what a decoder's cache
    holds)."""
    old, old_len, new, new_len = MOVES[move]
    scaling = SCALINGS[name]
    k = rand(2, 12, 3, D, dtype=torch.float32, seed=1)
    want = rope_ref(k, new, new_len, scaling=scaling)
    written = rope_ref(k, old, old_len, scaling=scaling)
    # The reference's two readings agree: the turn by the angle difference (shift_ref, what
    # the layout tests below use) of the keys written at old is the keys written at new (to the
    # float64 rounding of angles up to ~1.7e4 rad, "far").
    torch.testing.assert_close(shift_ref(written, old, new, old_len, new_len, scaling=scaling), want,
                               atol=1e-10, rtol=1e-10)
    for cache in (written.float(),
                  apply_rope(k, positions=old, seq_len=old_len, scaling=scaling)):
        out = rope_shift_kv(cache, old, new, from_seq_len=old_len, to_seq_len=new_len, scaling=scaling)
        assert out is cache
        torch.testing.assert_close(cache.to(F64), want, atol=3e-6, rtol=3e-6)
    # The same cache written by rope_append_kv at rows 3 .. 14 of a longer cache.
    kc, vc = torch.zeros(2, 20, 3, D), torch.zeros(2, 20, 3, D)
    q = torch.zeros(2, 12, 3, D)
    rope_append_kv(q, k, k, kc, vc, offset=3, positions=old, seq_len=old_len, scaling=scaling)
    before = kc.clone()
    rope_shift_kv(kc, old, new, rows=torch.arange(3, 15), from_seq_len=old_len, to_seq_len=new_len,
                  scaling=scaling)
    torch.testing.assert_close(kc[:, 3:15].to(F64), want, atol=3e-6, rtol=3e-6)
    assert torch.equal(kc[:, :3], before[:, :3]) and torch.equal(kc[:, 15:], before[:, 15:])


def test_a_length_scaled_type_is_not_a_rotation_by_the_delta():
    """For dynamic NTK the delta rotation is wrong by far more than rounding; the op is exact."""
    scaling = SCALINGS["dynamic"]
    old, old_len, new, new_len = MOVES["short_to_long"]
    k = rand(1, 12, 1, D, dtype=F64, seed=2)
    want = rope_ref(k, new, new_len, scaling=scaling)
    cache = rope_ref(k, old, old_len, scaling=scaling)
    delta = rope_ref(cache, new - old, new_len, scaling=scaling)
    assert (delta - want).abs().max() > 1e-2
    rope_shift_kv(cache, old, new, from_seq_len=old_len, to_seq_len=new_len, scaling=scaling)
    torch.testing.assert_close(cache, want, atol=1e-12, rtol=1e-12)


def test_seq_len_defaults_to_the_longest_position():
    scaling = SCALINGS["longrope"]
    old, new = torch.arange(0, 12), torch.arange(30, 42)
    k = rand(1, 12, 2, D, dtype=F64, seed=3)
    cache = rope_ref(k, old, 12, scaling=scaling)  # seq_len 12: short factors
    rope_shift_kv(cache, old, new, scaling=scaling)  # from 12, to 42: long factors
    torch.testing.assert_close(cache, rope_ref(k, new, 42, scaling=scaling), atol=1e-12, rtol=1e-12)


# ---- Layouts, rows, dtypes, RoPE features


def reference(cache, layout, old, new, *, rows=None, slot_mapping=None, from_seq_len=None,
              to_seq_len=None, **cfg):
    """The cache after the shift, in float64 plain PyTorch: the rows gathered, turned by
    shift_ref (the new angle at the new position minus the old angle at the old one),
    scattered back. seq_len defaults to the longest position given + 1 at each end."""
    c = cache.to(F64).clone()
    cv = c.transpose(1, 2) if layout == "bhsd" else c
    lens = dict(from_seq_len=longest(old) if from_seq_len is None else from_seq_len,
                to_seq_len=longest(new) if to_seq_len is None else to_seq_len)
    if layout == "thd":
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        flat = cv.reshape(-1, *cv.shape[2:])
        x = flat[slots].unsqueeze(0)
        flat[slots] = shift_ref(x, old[..., keep], new[..., keep], **lens, **cfg)[0]
        return c
    B, n = cv.shape[0], old.shape[-1]
    r = torch.arange(n) if rows is None else rows
    r = r.reshape(-1, n).expand(B, n)
    b = torch.arange(B)[:, None].expand(B, n)
    cv[b, r] = shift_ref(cv[b, r], old, new, **lens, **cfg)
    return c


def make_cache(layout, dtype, B=3, max_len=10, H=2, blocks=5, block=4, seed=0):
    if layout == "thd":
        return rand(blocks, block, H, D, dtype=dtype, seed=seed)
    if layout == "bhsd":
        return rand(B, H, max_len, D, dtype=dtype, seed=seed)
    return rand(B, max_len, H, D, dtype=dtype, seed=seed)


def check(cache, layout, old, new, **kw):
    dtype = cache.dtype
    before = cache.clone()
    want = reference(cache, layout, old, new, **kw)
    rope_shift_kv(cache, old, new, layout=layout, **kw)
    assert_shift_close(cache, want)
    if dtype in PRECISION:  # the same shift of a float32 copy, rounded once
        f32 = before.float()
        rope_shift_kv(f32, old, new, layout=layout, **kw)
        assert torch.equal(cache, f32.to(dtype))
    untouched = want == before.to(F64)
    assert torch.equal(cache[untouched], before[untouched])  # rows not listed keep their bits
    return before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("per_row", [False, True])
def test_contiguous_cache(dtype, layout, per_row):
    cache = make_cache(layout, dtype)
    if per_row:
        rows = torch.tensor([[0, 4, 7, 9], [9, 8, 1, 2], [3, 5, 6, 0]])
        old = torch.tensor([[10, 14, 17, 19], [5, 4, 100, 3], [0, 1, 2, 3]])
        new = old - torch.tensor([[4], [2], [1]])
    else:
        rows, old = torch.tensor([2, 5, 6, 8]), torch.tensor([20, 30, 31, 40])
        new = old - 17
    before = check(cache, layout, old, new, rows=rows, scaling=SCALINGS["yarn"])
    cv, bv = (t.transpose(1, 2) if layout == "bhsd" else t for t in (cache, before))
    listed = torch.zeros(cv.shape[:2], dtype=torch.bool)
    listed[torch.arange(3)[:, None], rows.reshape(-1, 4).expand(3, 4)] = True
    assert torch.equal(cv[~listed], bv[~listed])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("scaling", [None, "yarn"])
def test_one_call_has_the_bits_of_calls_of_one_row(dtype, per_row, scaling):
    """A shift within one configuration computes each position's angles once per call (one
    table for both ends, when their positions span fewer than 2x the rows turned): the same
    bits as calls of one row each, which compute both ends for their row."""
    cache = rand(2, 40, 3, D, dtype=dtype, seed=3)
    rows = torch.arange(8, 40)
    old = rows + 5
    new = old - 6  # both ends within 7 .. 44: 38 positions for 64 items
    if per_row:
        rows = torch.stack([rows, rows.flip(0)])
        old = torch.stack([old, old + 3])
        new = old - torch.tensor([[6], [2]])
    kw = {} if scaling is None else dict(scaling=SCALINGS[scaling])
    whole = cache.clone()
    rope_shift_kv(whole, old, new, rows=rows, **kw)
    by_row = cache.clone()
    for i in range(rows.shape[-1]):
        rope_shift_kv(by_row, old[..., i:i + 1], new[..., i:i + 1], rows=rows[..., i:i + 1], **kw)
    assert not torch.equal(whole, cache)
    assert torch.equal(whole, by_row)
    want = reference(cache, "bshd", old, new, rows=rows, **kw)
    assert_shift_close(whole, want)


def test_default_rows_are_the_first_n():
    cache = make_cache("bshd", torch.float32)
    check(cache, "bshd", torch.arange(4) + 8, torch.arange(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_cache_with_skipped_slots(dtype):
    cache = make_cache("thd", dtype)
    slots = torch.tensor([3, -1, 9, 0, 17, -1])
    old = torch.tensor([40, 41, 42, 43, 44, 45])
    new = torch.tensor([4, 5, 6, 7, 8, 9])
    check(cache, "thd", old, new, slot_mapping=slots, scaling=SCALINGS["llama3"])


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
@pytest.mark.parametrize("name", ["dynamic", "longrope"])
@pytest.mark.parametrize("lengths", [None, (46, 12)])
def test_length_scaled_types_in_every_layout(layout, name, lengths):
    """Each end with its own frequencies (given seq_lens, or each end's longest position + 1)."""
    cache = make_cache(layout, torch.float32)
    old, new = torch.tensor([40, 41, 42, 43, 44, 45]), torch.tensor([4, 5, 6, 7, 8, 9])
    kw = {} if lengths is None else dict(from_seq_len=lengths[0], to_seq_len=lengths[1])
    if layout == "thd":
        kw["slot_mapping"] = torch.tensor([3, -1, 9, 0, 17, 5])
    else:
        kw["rows"] = torch.tensor([1, 2, 3, 4, 8, 9])
    check(cache, layout, old, new, scaling=SCALINGS[name], interleaved=layout == "bhsd", **kw)


@pytest.mark.parametrize("kw", [
    dict(rotary_dim=8), dict(interleaved=True), dict(rotary_offset=4, rotary_dim=8),
    dict(rotary_offset=6, interleaved=True), dict(base=500000.0),
    dict(scaling=SCALINGS["proportional"], interleaved=True),
])
def test_rope_features(kw):
    cache = make_cache("bhsd", torch.float32)
    check(cache, "bhsd", torch.tensor([11, 12, 13]), torch.tensor([1, 2, 3]), rows=torch.tensor([7, 8, 9]), **kw)


def test_multi_axis_sections():
    """Multi-axis RoPE: positions (n_axes, n) per end."""
    cache = make_cache("bshd", torch.float64)
    old = torch.tensor([[3, 4, 5], [0, 1, 2], [7, 7, 7]])
    new = torch.tensor([[0, 1, 2], [9, 9, 9], [1, 2, 3]])
    for mode in ("axial", "mrope", "mrope_interleaved"):
        check(cache, "bshd", old, new, rows=torch.tensor([1, 2, 3]), sections=[2, 3, 3] if mode == "axial"
              else [4, 2, 2], sections_mode=mode)


def test_strided_cache():
    base = make_cache("bshd", torch.float32, H=4)
    cache = base[:, :, ::2]  # every other head
    check(cache, "bshd", torch.tensor([9, 8]), torch.tensor([0, 1]), rows=torch.tensor([5, 6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mla_latent", "every_other_head"])
def test_rows_that_lie_apart_have_the_bits_of_a_contiguous_cache(dtype, kind):
    """Rows that lie apart in memory (MLA's latent cache [kv_c 512 | k_pe 64], k_pe shifted;
    every other head of a cache) take the kernel's prefetch of the row four items on
    (cpu/kernel.cpp): the same bits as the same shift of a contiguous copy, over enough rows
    for the prefetch to run, and nothing outside the slice written."""
    g = torch.Generator().manual_seed(31)
    if kind == "mla_latent":
        base = torch.randn(2, 300, 1, 576, generator=g).to(dtype)
        cache = base[..., 512:]
    else:
        base = torch.randn(2, 300, 4, D, generator=g).to(dtype)
        cache = base[:, :, ::2]
    before, dense = base.clone(), cache.contiguous()
    rows = torch.arange(40, 300)
    rope_shift_kv(cache, rows, rows - 40, rows=rows, rotary_dim=cache.shape[-1])
    rope_shift_kv(dense, rows, rows - 40, rows=rows, rotary_dim=cache.shape[-1])
    assert torch.equal(cache, dense)
    outside = torch.ones_like(base, dtype=torch.bool)
    (outside[..., 512:] if kind == "mla_latent" else outside[:, :, ::2])[:] = False
    assert torch.equal(base[outside], before[outside])
    sliced = before[..., 512:] if kind == "mla_latent" else before[:, :, ::2]
    want = reference(sliced, "bshd", rows, rows - 40, rows=rows, rotary_dim=cache.shape[-1])
    assert_shift_close(cache, want)


def test_empty():
    cache = make_cache("bshd", torch.float32)
    before = cache.clone()
    rope_shift_kv(cache, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert torch.equal(cache, before)


# ---- FP8 caches


def quantise(x32, scale, dtype):
    m = torch.finfo(dtype).max
    return (x32 / scale).clamp(-m, m).to(dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("scale", [None, 0.03, "tensor"])
def test_fp8_cache_is_dequantise_rotate_requantise(fp8, layout, scale):
    """Dequantise in plain PyTorch (value * scale in float32), the float64 reference shift of
    that, requantise in plain PyTorch (divide, saturate, round to nearest even): every FP8 code
    is that of the reference turn, or where the reference lies within float32 rounding of a
    rounding boundary between two codes, one of the two. And bit for bit: the FP8 path rotates
    exactly as the op's float32 one (the same float32 cache shifted by the op, requantised)."""
    s = 1.0 if scale is None else 0.03
    k_scale = torch.tensor([s]) if scale == "tensor" else scale
    cache = quantise(make_cache(layout, torch.float32, seed=4) * 20, s, fp8)
    cfg = dict(scaling=SCALINGS["yarn"], rotary_dim=12, rotary_offset=2)
    if layout == "thd":
        idx = dict(slot_mapping=torch.tensor([3, -1, 9, 0, 17]))
    else:
        idx = dict(rows=torch.tensor([[1, 2, 3, 4, 5], [0, 9, 8, 7, 6], [5, 4, 3, 2, 1]]))
    old, new = torch.tensor([30, 31, 32, 33, 34]), torch.tensor([2, 3, 4, 5, 6])
    f32 = cache.to(torch.float32) * torch.tensor(s, dtype=torch.float32)
    exact = reference(f32, layout, old, new, **idx, **cfg)
    # float32 rounding of the turn: a few ulp of the largest value
    slack = exact.abs().max() * 2**-20
    low, high = quantise((exact - slack).float(), s, fp8), quantise((exact + slack).float(), s, fp8)
    before = cache.clone()
    rope_shift_kv(cache, old, new, k_scale=k_scale, layout=layout, **idx, **cfg)
    got = cache.float()
    assert ((low.float() <= got) & (got <= high.float())).all()
    assert (low.view(torch.uint8) != high.view(torch.uint8)).sum() <= 2  # the bracket is one code elsewhere
    untouched = exact == f32.to(F64)
    assert torch.equal(cache.view(torch.uint8)[untouched], before.view(torch.uint8)[untouched])
    assert not torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    rope_shift_kv(f32, old, new, layout=layout, **idx, **cfg)
    assert torch.equal(cache.view(torch.uint8), quantise(f32, s, fp8).view(torch.uint8))


def test_fp8_against_the_contract():
    """An FP8 cache written by rope_append_kv, shifted, against the keys rotated at the new
    positions: two roundings to FP8 (at the write, at the shift) against none, and the
    rotation mixes a pair's two values, so each value is within an FP8 ulp (2**-3 relative for
    e4m3) of its pair's magnitude."""
    k = rand(1, 12, 2, D, dtype=torch.float32, seed=5)
    kc = torch.zeros(1, 12, 2, D, dtype=torch.float8_e4m3fn)
    rope_append_kv(torch.zeros(1, 12, 2, D), k, k, kc, kc.clone(), positions=torch.arange(12) + 20,
                   k_scale=0.01, v_scale=0.01)
    rope_shift_kv(kc, torch.arange(12) + 20, torch.arange(12), k_scale=0.01)
    want = rope_ref(k, torch.arange(12)).float()
    norm = want[..., :D // 2].hypot(want[..., D // 2:]).repeat(1, 1, 1, 2)
    err = (kc.to(torch.float32) * 0.01 - want).abs()
    assert (err <= norm * 2**-3 + 0.01 * 2**-9).all(), (err / norm).max()


# ---- Errors


def error(fn, exc=Exception):
    with pytest.raises(exc) as info:
        fn()
    return info.type, str(info.value)


def test_out_of_range_and_repeated_rows_write_nothing():
    cache = make_cache("bshd", torch.float32)
    before = cache.clone()
    old, new = torch.tensor([5, 6]), torch.tensor([0, 1])
    t, m = error(lambda: rope_shift_kv(cache, old, new, rows=torch.tensor([3, 10])), IndexError)
    assert "rows[1] = 10" in m and "max_len = 10" in m and "nothing was written" in m
    t, m = error(lambda: rope_shift_kv(cache, old, new, rows=torch.tensor([[0, 1], [2, 2], [0, 1]])), ValueError)
    assert "rows[0] and rows[1] are both 2 of batch row 1" in m
    t, m = error(lambda: rope_shift_kv(cache, torch.arange(11), torch.arange(11)), IndexError)
    assert "max_len" in m
    paged = make_cache("thd", torch.float32)
    before_paged = paged.clone()
    t, m = error(lambda: rope_shift_kv(paged, old, new, layout="thd", slot_mapping=torch.tensor([20, 0])),
                 IndexError)
    assert "slot_mapping[0] = 20" in m
    t, m = error(lambda: rope_shift_kv(paged, old, new, layout="thd", slot_mapping=torch.tensor([4, 4])),
                 ValueError)
    assert "slot_mapping[0] and slot_mapping[1] are both 4" in m
    # A repeat after an increasing run (the check skips its sort for strictly increasing lists).
    t, m = error(lambda: rope_shift_kv(paged, torch.arange(5) + 5, torch.arange(5), layout="thd",
                                       slot_mapping=torch.tensor([1, 3, -1, 5, 3])), ValueError)
    assert "slot_mapping[1] and slot_mapping[4] are both 3" in m
    assert torch.equal(cache, before) and torch.equal(paged, before_paged)


@pytest.mark.parametrize("call, exc, words", [
    (lambda c, p: rope_shift_kv(c, p.int(), p), TypeError, "from_positions to have dtype torch.int64"),
    (lambda c, p: rope_shift_kv(c, p, p[:2]), RuntimeError, "to_positions of shape (n,) = (3,)"),
    (lambda c, p: rope_shift_kv(c, p, p, rows=torch.tensor([1, 2])), RuntimeError, "rows of shape (n,) = (3,)"),
    (lambda c, p: rope_shift_kv(c, p, p, rows=torch.tensor(1)), RuntimeError, "rows of shape (n,) = (3,)"),
    (lambda c, p: rope_shift_kv(c, p, p, rows=torch.tensor([1, 2, 3]).float()), TypeError, "rows to have dtype"),
    (lambda c, p: rope_shift_kv(c, p, p, slot_mapping=p), ValueError, "slot_mapping is for paged caches"),
    (lambda c, p: rope_shift_kv(c, p, p, layout="thd"), ValueError, "needs slot_mapping"),
    (lambda c, p: rope_shift_kv(c, p, p, layout="thd", slot_mapping=p, rows=p), ValueError, "rows is for"),
    (lambda c, p: rope_shift_kv(c, p, p, layout="sbhd"), ValueError, "(paged cache), got 'sbhd'"),
    (lambda c, p: torch.ops.posenc.rope_shift_kv_(c, p, p, layout="sbhd"), ValueError, "layout 'bshd'"),
    (lambda c, p: rope_shift_kv(c, p, p, k_scale=0.5), ValueError, "k_scale is only used with a float8"),
    (lambda c, p: rope_shift_kv(c.to(torch.float8_e4m3fn), p, p, k_scale=-1.0), ValueError,
     "k_scale to be a finite positive"),
    (lambda c, p: rope_shift_kv(c.to(torch.float8_e4m3fn), p, p, k_scale=torch.ones(2)), ValueError,
     "k_scale to hold one value"),
    # dequantised, 448 * 1e37 would be inf in float32, and the rotation would write NaN
    (lambda c, p: rope_shift_kv(c.to(torch.float8_e4m3fn), p, p, k_scale=1e37), ValueError,
     "to be finite in float32"),
    (lambda c, p: rope_shift_kv(c.to(torch.float8_e5m2), p, p, k_scale=torch.tensor(1e34)), ValueError,
     "k_scale * 57344"),
    (lambda c, p: rope_shift_kv(c.int(), p, p), TypeError, "k_cache of dtype"),
    (lambda c, p: rope_shift_kv(c[0], p, p), RuntimeError, "k_cache of shape"),
    (lambda c, p: rope_shift_kv(c, p, p, from_seq_len=-2), ValueError, "from_seq_len >= 0"),
    (lambda c, p: rope_shift_kv(c, p, p + 2**60), ValueError, "to_positions within"),
    (lambda c, p: rope_shift_kv(c, p, p, rotary_dim=18), ValueError, "rotary_dim"),
])
def test_bad_arguments_name_them(call, exc, words):
    cache = make_cache("bshd", torch.float32)
    before = cache.clone()
    _, m = error(lambda: call(cache, torch.tensor([1, 2, 3])), exc)
    assert words in m, m
    assert torch.equal(cache, before)


def test_index_tensors_may_not_alias_the_cache():
    cache = torch.zeros(1, 8, 1, 4, dtype=torch.float64)
    pos = cache.view(torch.int64).view(-1)[:3]
    _, m = error(lambda: rope_shift_kv(cache, pos, torch.tensor([0, 1, 2])), RuntimeError)
    assert "k_cache" in m and "from_positions" in m


def test_requires_grad_is_an_error_and_the_version_moves():
    cache = make_cache("bshd", torch.float32).requires_grad_()
    _, m = error(lambda: rope_shift_kv(cache, torch.tensor([1]), torch.tensor([0])), RuntimeError)
    assert "k_cache" in m and "no autograd" in m
    cache = make_cache("bshd", torch.float32)
    v = cache._version
    with torch.no_grad():
        rope_shift_kv(cache, torch.tensor([1]), torch.tensor([0]))
    assert cache._version > v


# ---- opcheck, compile, the ATen fallback


def test_opcheck():
    op = torch.ops.posenc.rope_shift_kv_
    cache = make_cache("bshd", torch.float32)
    opcheck(op, (cache, torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])), dict(rows=torch.tensor([2, 3, 4])))
    opcheck(op, (make_cache("bhsd", torch.float32), torch.tensor([5, 6]), torch.tensor([0, 1])),
            dict(layout="bhsd", rope_type="dynamic", scaling=[9.0, 4.0, 0, 0, 16.0, 0, 0, 0, 0, 0, 0, 0],
                 from_seq_len=40, to_seq_len=8))
    opcheck(op, (make_cache("thd", torch.float32), torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])),
            dict(layout="thd", slot_mapping=torch.tensor([3, -1, 0])))
    fp8 = make_cache("bshd", torch.float32).to(torch.float8_e4m3fn)
    # opcheck's test_schema compares values with ops float8 has no CPU kernel for (mul); the
    # schema's aliases are those of plain caches, checked above.
    opcheck(op, (fp8, torch.tensor([5]), torch.tensor([0])), dict(k_scale=torch.tensor(0.5)),
            test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    meta = make_cache("bshd", torch.float32).to("meta")
    op(meta, torch.tensor([5], device="meta"), torch.tensor([0], device="meta"))
    with pytest.raises(RuntimeError, match="from_positions on the meta device"):
        op(make_cache("bshd", torch.float32), torch.tensor([5], device="meta"), torch.tensor([0]))


@pytest.mark.parametrize("layout, backend", [("bshd", "aot_eager"), ("thd", "aot_eager"), ("bshd", "inductor")])
def test_compile_fullgraph_mutates_the_cache(layout, backend):
    torch._dynamo.reset()
    kw = dict(layout="thd", slot_mapping=torch.tensor([3, -1, 9])) if layout == "thd" else \
        dict(rows=torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    scaling = SCALINGS["longrope"]

    def step(cache, old, new):
        rope_shift_kv(cache, old, new, from_seq_len=40, to_seq_len=12, scaling=scaling, **kw)
        return cache.sum()

    old, new = torch.tensor([30, 31, 32]), torch.tensor([0, 1, 2])
    cache = make_cache(layout, torch.float32)
    eager = cache.clone()
    want = step(eager, old, new)
    got = torch.compile(step, fullgraph=True, backend=backend)(cache, old, new)
    torch.testing.assert_close(got, want)
    assert torch.equal(cache, eager)


FALLBACK_SCRIPT = r"""
import torch
from posenc.functional import rope_shift_kv

g = torch.Generator().manual_seed(5)
out = {}
old, new = torch.tensor([30, 31, 32, 33]), torch.tensor([2, 3, 4, 5])
scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}
for name, shape, kw in (
    ("bshd", (3, 10, 2, 16), dict(rows=torch.tensor([[0, 1, 2, 3], [9, 8, 7, 6], [4, 6, 8, 1]]), scaling=scaling)),
    ("bhsd", (3, 2, 10, 16), dict(layout="bhsd", interleaved=True, rotary_dim=8, rotary_offset=4)),
    ("thd", (5, 4, 2, 16), dict(layout="thd", slot_mapping=torch.tensor([5, -1, 0, 19]), scaling=scaling)),
    ("bf16", (3, 10, 2, 16), dict(rows=torch.tensor([2, 4, 6, 8]))),
    ("fp8", (3, 10, 2, 16), dict(rows=torch.tensor([2, 4, 6, 8]), k_scale=0.05)),
):
    cache = torch.randn(*shape, generator=g)
    if name == "bf16":
        cache = cache.bfloat16()
    if name == "fp8":
        cache = (cache / 0.05).to(torch.float8_e4m3fn)
    rope_shift_kv(cache, old, new, **kw)
    out[name] = cache
cache = torch.randn(3, 10, 2, 16, generator=g)
before = cache.clone()
try:
    rope_shift_kv(cache, old, new, rows=torch.tensor([0, 1, 2, 10]))
    out["error"] = None
except IndexError as e:
    out["error"] = (type(e).__name__, str(e), torch.equal(cache, before))
"""


def test_aten_fallback_matches_the_kernel():
    from aten_fallback_mode import ThroughTheFallback

    results = {}
    for forced in (False, True):
        scope = {}
        if forced:
            with ThroughTheFallback() as mode:
                exec(FALLBACK_SCRIPT, scope)
        else:
            exec(FALLBACK_SCRIPT, scope)
        results[forced] = scope["out"]
    assert mode.calls.get("posenc::rope_shift_kv_", 0) > 0
    kernel, fallback = results[False], results[True]
    for key in kernel:
        if key == "error":
            assert kernel[key] == fallback[key] and kernel[key][2], (kernel[key], fallback[key])
        elif key == "fp8":  # one FP8 ulp where the float32 rotations differ in their last bit
            a, b = kernel[key].float(), fallback[key].float()
            assert ((a - b).abs() <= a.abs().clamp(min=2**-6) * 2**-3 + 1e-9).all()
        elif key == "bf16":
            torch.testing.assert_close(kernel[key], fallback[key], atol=1.6e-2, rtol=1.6e-2)
        else:
            torch.testing.assert_close(kernel[key], fallback[key], atol=2e-6, rtol=2e-6)


# ---- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_cuda_kernel_matches_the_cpu_kernel(dtype, layout):
    cache = make_cache(layout, torch.float32, seed=7)
    cache = (cache * 20).to(dtype) if dtype.is_floating_point and dtype.itemsize == 1 else cache.to(dtype)
    kw = dict(layout=layout, scaling=SCALINGS["longrope"], from_seq_len=50, to_seq_len=10, interleaved=True)
    if dtype.itemsize == 1:
        kw["k_scale"] = 0.05
    if layout == "thd":
        kw["slot_mapping"] = torch.tensor([3, -1, 9, 0])
    else:
        kw["rows"] = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])
    old, new = torch.tensor([40, 41, 42, 43]), torch.tensor([0, 1, 2, 3])
    on_gpu = cache.cuda()
    rope_shift_kv(cache, old, new, **kw)
    rope_shift_kv(on_gpu, old.cuda(), new.cuda(), **{k: v.cuda() if isinstance(v, torch.Tensor) else v
                                                      for k, v in kw.items()})
    assert torch.equal(on_gpu.cpu().view(torch.uint8), cache.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("k_scale", [0.0, -1.0, 1e37, float("nan")])
def test_cuda_float_scale_is_checked_before_any_write(k_scale):
    """A k_scale given as a float is a CPU value: the CUDA runner checks it on the host, as
    the CPU kernel does (it was left to a device assert in block 0 that fired after the other
    blocks had written NaN codes, and took the CUDA context with it)."""
    cache = (make_cache("bshd", torch.float32, seed=3) * 20).to(torch.float8_e4m3fn).cuda()
    before = cache.clone()
    with pytest.raises(ValueError, match="k_scale"):
        rope_shift_kv(cache, torch.tensor([1, 2, 3]).cuda(), torch.tensor([0, 1, 2]).cuda(), k_scale=k_scale)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


# ---- Every CPU ISA level gives the same bits

ISA_SCRIPT = r"""
import sys
import torch
from posenc.functional import rope_shift_kv

g = torch.Generator().manual_seed(9)
out = {}
rows = torch.tensor([[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]])
old, new = torch.arange(6) * 977 + 13, torch.arange(6)
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
    for interleaved in (False, True):
        for head_dim, rotary_dim in ((64, None), (40, 24)):
            cache = torch.randn(2, 10, 3, head_dim, generator=g) * 4
            cache = cache.to(dtype)
            kw = dict(k_scale=0.05) if dtype == torch.float8_e4m3fn else {}
            rope_shift_kv(cache, old, new, rows=rows, interleaved=interleaved, rotary_dim=rotary_dim,
                          scaling={"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16},
                          **kw)
            out[(str(dtype), interleaved, head_dim)] = cache.view(torch.uint8) if dtype.itemsize == 1 else cache
out["capability"] = torch.ops.posenc.cpu_capability()
torch.save(out, sys.argv[1])
"""


def test_every_cpu_level_gives_the_same_bits(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    levels = host_levels()  # default, avx2, avx512: those this CPU runs
    if len(levels) < 2:
        pytest.skip("one CPU level on this host")
    root = pathlib.Path(__file__).resolve().parents[2]
    results = []
    for level in levels:
        env = dict(os.environ, POSENC_CPU_CAPABILITY=level, PYTHONPATH=str(root / "python"))
        path = tmp_path / f"{level}.pt"
        proc = subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(path)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(torch.load(path))
        assert results[-1].pop("capability") == level  # the level asked for ran
    for level, result in zip(levels[1:], results[1:]):
        for key, value in results[0].items():
            assert torch.equal(value, result[key]), (level, key)



COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


@pytest.mark.parametrize("path", ["kernel", "aten_fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_rows_shifted_to_their_own_position_keep_their_bits(path, dtype):
    # A row shifted to where it is (the sinks of an attention-sinks loop, shifted with the
    # window) turns by exactly nothing and is left as it is: cn co + sn so rounds to 1 - 1 ulp,
    # and repeated shifts in place used to drift by an ulp a call (6881 of 16384 float32
    # values). Rows that move still turn; signed zeros and FP8 codes of kept rows stay.
    cache = make_cache("bshd", torch.float32, max_len=10)
    cache[0, 1, 0, :4] = -0.0
    cache = cache.to(dtype)
    scale = {"k_scale": 0.37} if dtype.itemsize == 1 else {}
    before = cache.clone()
    old = torch.tensor([[1, 2, 7], [3, 4, 8], [1, 5, 9]])
    new = torch.tensor([[1, 2, 3], [3, 4, 5], [1, 5, 6]])  # the first two rows of each stay
    rows = torch.tensor([1, 2, 7])
    op = torch.ops.posenc.rope_shift_kv_.default
    for _ in range(3):  # repeated: no drift
        if path == "kernel":
            rope_shift_kv(cache, old, new, rows=rows, **scale)
        else:
            k_scale = torch.tensor(scale["k_scale"]) if scale else None
            op.redispatch(COMPOSITE, cache, old, new, rows=rows, k_scale=k_scale)
    bits = torch.uint8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    kept, moved = cache.view(bits)[:, 1:3], cache.view(bits)[:, 7]
    assert torch.equal(kept, before.view(bits)[:, 1:3])
    assert not torch.equal(moved, before.view(bits)[:, 7])
