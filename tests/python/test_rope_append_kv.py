"""rope_append_kv (issue 25): RoPE of q and k with k and v written into a KV cache, against a
float64 reference in plain PyTorch (rope_reference.py's rotation, then index copies into
the caches): both contiguous layouts, the paged cache with -1 slots, int and tensor offsets,
positions, GQA, partial rotary, interleaved pairs, a scaling type, every dtype, strides, in
place and return_k; bad inputs (rows out of range: IndexError with the caches unchanged);
opcheck and torch.compile with the mutated caches. Every RoPE setting (each scaling type,
rotary_offset, multi-axis sections) against the formula: formula_rope."""


import pytest
import torch
from torch.library import opcheck

import posenc  # noqa: F401
from multi_axis_reference import generic_multi_axis_rope
from posenc.functional import apply_rope, rope_append_kv
from rope_reference import formula_inv_freq, rope_gptj, rope_neox

F64 = torch.float64
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.float16: dict(atol=4e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def rand(*shape, dtype=F64):
    return (torch.rand(*shape, dtype=F64) * 4 - 2).to(dtype)


def tokens_view(x, layout):
    """(batch, seq, heads, head_dim) view of q, k or v."""
    return {"bshd": x, "bhsd": x.transpose(1, 2), "thd": x.unsqueeze(0)}[layout]


def cache_view(c, layout):
    """(batch or block, row or index, heads, head_dim) view of a cache."""
    return c.transpose(1, 2) if layout == "bhsd" else c


def formula_rope(x, pos, seq_len, *, base=10000.0, interleaved=False, rotary_dim=None, rotary_offset=0,
                 scaling=None, sections=None, sections_mode="axial"):
    """x (B, S, H, D) float64 rotated: features [rotary_offset, rotary_offset + rotary_dim) by
    the frequencies of formula_inv_freq, the others passed through; with sections,
    multi_axis_reference's generic model. pos: (B or 1, S), with sections (n_axes, B or 1, S)."""
    if sections is not None:
        return generic_multi_axis_rope(x, pos, sections, sections_mode, base, interleaved)
    begin = rotary_offset
    rot = x.shape[-1] - begin if rotary_dim is None else rotary_dim
    inv, attn = formula_inv_freq(rot, base, scaling, seq_len, x.shape[-1])
    rope = rope_gptj if interleaved else rope_neox
    return torch.cat((x[..., :begin], rope(x[..., begin:], pos, inv, rot, attn)), dim=-1)


def reference(q, k, v, k_cache, v_cache, *, offset=0, positions=None, slot_mapping=None, layout="bshd",
              seq_len=None, **rope):
    """(q, k rotated, k_cache, v_cache after the write) in float64: the formula's rotation
    (formula_rope) at the positions the docstring gives (the cache rows offset + s unless
    positions are given; "thd": offset + token index; sections: on every axis), then index
    copies. seq_len (dynamic, longrope): the longest position + 1 of the call unless given."""
    qv, kv, vv = (tokens_view(t, layout).to(F64) for t in (q, k, v))
    B, S = qv.shape[:2]
    offs = offset.to(torch.int64) if isinstance(offset, torch.Tensor) else torch.full((B,), offset)
    rows = offs[:, None] + torch.arange(S)[None, :]  # (B, S)
    axes = None if rope.get("sections") is None else len(rope["sections"])
    if positions is None:
        pos = rows if axes is None else rows.expand(axes, B, S)
    elif axes is None:
        pos = positions.reshape(-1, S).expand(B, S) if layout != "thd" else positions.reshape(1, S)
    else:
        pos = positions.reshape(axes, -1, S)
    if seq_len is None:
        seq_len = int(pos.max()) + 1 if pos.numel() else 0
    q_ref, k_ref = formula_rope(qv, pos, seq_len, **rope), formula_rope(kv, pos, seq_len, **rope)
    kc, vc = k_cache.to(F64).clone(), v_cache.to(F64).clone()
    write_rows(cache_view(kc, layout), cache_view(vc, layout), k_ref, vv, rows, slot_mapping, layout)
    back = {"bshd": lambda x: x, "bhsd": lambda x: x.transpose(1, 2), "thd": lambda x: x.squeeze(0)}[layout]
    return back(q_ref), back(k_ref), kc, vc


def write_rows(kcv, vcv, k_rows, v_rows, rows, slot_mapping, layout):
    """Index copies of k_rows, v_rows ((batch, seq, heads, head_dim) views) into the cache views
    kcv, vcv (cache_view): at rows (batch, seq), or for "thd" at slot_mapping's slots >= 0."""
    if layout == "thd":
        block = kcv.shape[1]
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                kcv[slot // block, slot % block] = k_rows[0, t]
                vcv[slot // block, slot % block] = v_rows[0, t]
    else:
        for b in range(kcv.shape[0]):
            kcv[b].index_copy_(0, rows[b], k_rows[b])
            vcv[b].index_copy_(0, rows[b], v_rows[b])


def make(layout, B=3, S=5, Hq=4, Hkv=2, D=16, max_len=12, dtype=F64, Dv=None, blocks=5, block=4):
    Dv = D if Dv is None else Dv
    if layout == "thd":
        q, k, v = rand(S, Hq, D, dtype=dtype), rand(S, Hkv, D, dtype=dtype), rand(S, Hkv, Dv, dtype=dtype)
        kc, vc = rand(blocks, block, Hkv, D, dtype=dtype), rand(blocks, block, Hkv, Dv, dtype=dtype)
    elif layout == "bhsd":
        q, k, v = rand(B, Hq, S, D, dtype=dtype), rand(B, Hkv, S, D, dtype=dtype), rand(B, Hkv, S, Dv, dtype=dtype)
        kc, vc = rand(B, Hkv, max_len, D, dtype=dtype), rand(B, Hkv, max_len, Dv, dtype=dtype)
    else:
        q, k, v = rand(B, S, Hq, D, dtype=dtype), rand(B, S, Hkv, D, dtype=dtype), rand(B, S, Hkv, Dv, dtype=dtype)
        kc, vc = rand(B, max_len, Hkv, D, dtype=dtype), rand(B, max_len, Hkv, Dv, dtype=dtype)
    return q, k, v, kc, vc


def check(q, k, v, kc, vc, **kw):
    """Runs the op (return_k) on copies of the caches and compares all four results."""
    dtype = q.dtype
    kc0, vc0 = kc.clone(), vc.clone()
    q_ref, k_ref, kc_ref, vc_ref = reference(q, k, v, kc, vc, **kw)
    out_q, out_k = rope_append_kv(q, k, v, kc, vc, return_k=True, **kw)
    torch.testing.assert_close(out_q.to(F64), q_ref, **TOL[dtype])
    torch.testing.assert_close(out_k.to(F64), k_ref, **TOL[dtype])
    torch.testing.assert_close(kc.to(F64), kc_ref, **TOL[dtype])
    torch.testing.assert_close(vc.to(F64), vc_ref, atol=0, rtol=0)  # v is copied as it is
    # Rows not written keep their bits.
    for got, before, ref in ((kc, kc0, kc_ref), (vc, vc0, vc_ref)):
        untouched = ref == before.to(F64)
        assert torch.equal(got[untouched], before[untouched])
    # The same bits as apply_rope with the same RoPE keywords (half precision: rotated in
    # float32, rounded once), in q, the returned k and the k cache rows written.
    layout = kw.get("layout", "bshd")
    offset, positions = kw.get("offset", 0), kw.get("positions")
    rope = {n: x for n, x in kw.items() if n not in ("offset", "positions", "slot_mapping", "layout")}
    where = dict(offset=offset) if positions is None else dict(positions=positions)  # positions: not offset
    if layout == "thd":
        apply_q, apply_k = apply_rope(q.unsqueeze(0), k.unsqueeze(0), **where, **rope)
        apply_q, apply_k = apply_q.squeeze(0), apply_k.squeeze(0)
    else:
        apply_q, apply_k = apply_rope(q, k, layout=layout, **where, **rope)
    assert torch.equal(out_q, apply_q) and torch.equal(out_k, apply_k)
    kc_apply, vc_apply = kc0.clone(), vc0.clone()
    B, S = tokens_view(q, layout).shape[:2]
    offs = offset.to(torch.int64) if isinstance(offset, torch.Tensor) else torch.full((B,), offset)
    write_rows(cache_view(kc_apply, layout), cache_view(vc_apply, layout), tokens_view(apply_k, layout),
               tokens_view(v, layout), offs[:, None] + torch.arange(S)[None, :], kw.get("slot_mapping"), layout)
    assert torch.equal(kc, kc_apply) and torch.equal(vc, vc_apply)
    return out_q, out_k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("tensor_offset", [False, True])
def test_contiguous_cache(dtype, layout, tensor_offset):
    torch.manual_seed(0)
    q, k, v, kc, vc = make(layout, dtype=dtype)
    offset = torch.tensor([0, 7, 3]) if tensor_offset else 4
    check(q, k, v, kc, vc, offset=offset, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_cache_with_unwritten_slots(dtype):
    torch.manual_seed(1)
    q, k, v, kc, vc = make("thd", S=7, dtype=dtype)
    slots = torch.tensor([5, -1, 0, 19, 12, -1, 6])
    positions = torch.tensor([3, 9, 0, 40, 1, 2, 1000])
    check(q, k, v, kc, vc, slot_mapping=slots, positions=positions, layout="thd")
    # Default positions: offset + token index.
    q, k, v, kc, vc = make("thd", S=7, dtype=dtype)
    check(q, k, v, kc, vc, slot_mapping=slots, offset=11, layout="thd")


def test_paged_offset_beside_positions_is_refused_before_writing():
    # An int offset only shifts "thd"'s default positions: beside positions it was dropped
    # (the call rotated at positions, as without the offset).
    q, k, v, kc, vc = make("thd", S=5)
    kc0 = kc.clone()
    with pytest.raises(ValueError, match=r"expected offset=0 beside positions for layout 'thd'.*got offset=3"):
        rope_append_kv(q, k, v, kc, vc, slot_mapping=torch.arange(5), positions=torch.arange(5), offset=3,
                       layout="thd")
    assert torch.equal(kc, kc0)


def test_a_slot_written_twice_is_an_error_before_writing():
    q, k, v, kc, vc = make("thd", S=5)
    kc0, vc0 = kc.clone(), vc.clone()
    slots = torch.tensor([4, -1, 9, -1, 4])  # -1 twice is fine, 4 twice is not
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] and slot_mapping\[4\] are both 4"):
        rope_append_kv(q, k, v, kc, vc, slot_mapping=slots, layout="thd")
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    check(q, k, v, kc, vc, slot_mapping=torch.tensor([4, -1, 9, -1, 5]), layout="thd")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_rope_features(layout):
    torch.manual_seed(2)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    for kw in (dict(interleaved=True), dict(rotary_dim=6), dict(scaling=scaling, base=500.0),
               dict(positions=torch.tensor([[2, 30, 5, 6, 1]]), interleaved=True, rotary_dim=8)):
        q, k, v, kc, vc = make(layout, Hq=6, Hkv=3, D=20, dtype=torch.float32)
        check(q, k, v, kc, vc, offset=torch.tensor([1, 0, 6]), layout=layout, **kw)


def test_positions_per_row_mqa_and_v_head_dim():
    torch.manual_seed(3)
    q, k, v, kc, vc = make("bshd", Hq=8, Hkv=1, D=16, Dv=10)
    positions = torch.randint(0, 100, (3, 5))
    check(q, k, v, kc, vc, offset=2, positions=positions)


def test_multi_axis_matches_apply_rope():
    torch.manual_seed(4)
    q, k, v, kc, vc = make("bshd", dtype=torch.float32)
    positions = torch.randint(0, 50, (3, 5))  # (n_axes, seq)
    kw = dict(positions=positions, sections=[2, 2, 4], sections_mode="mrope")
    check(q, k, v, kc.clone(), vc.clone(), offset=3, **kw)  # the formula (multi_axis_reference)
    out_q, out_k = rope_append_kv(q, k, v, kc, vc, offset=3, return_k=True, **kw)
    ref_q, ref_k = apply_rope(q, k, **kw)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(kc[:, 3:8], ref_k) and torch.equal(vc[:, 3:8], v)


D_FORMULA = 20  # head_dim of test_rope_settings_against_the_formula: 10 rotary pairs
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
# Each RoPE setting rope_append_kv takes, one per case; "positions": explicit positions (else
# the cache rows / offset + token index). The calls' longest position + 1 is 11 ("bshd",
# "bhsd": offsets [1, 0, 6], 5 tokens), 18 ("thd": offset 11, 7 tokens) or 30 (positions).
FORMULA_CASES = {
    "default": dict(scaling={"rope_type": "default"}, base=500.0),
    "linear": dict(scaling={"rope_type": "linear", "factor": 2.5}, interleaved=True),
    "dynamic": dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}),
    "dynamic_unscaled": dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}),
    "dynamic_by_seq_len": dict(scaling={"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 64},
                               seq_len=200),
    "dynamic_positions": dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
                              positions=True),
    "yarn": dict(scaling=YARN, base=500.0),
    "yarn_mscale": dict(scaling={**YARN, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0,
                                 "beta_slow": 2.0, "truncate": False}, interleaved=True),
    "yarn_attention_factor": dict(scaling={**YARN, "attention_factor": 0.8}, rotary_dim=12),
    "llama3": dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8}, base=500000.0),
    "longrope_short": dict(scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(10)],
                                    "long_factor": [2.0 + i / 4 for i in range(10)], "factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "longrope_long": dict(scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(10)],
                                   "long_factor": [2.0 + i / 4 for i in range(10)], "factor": 4.0,
                                   "original_max_position_embeddings": 8}, interleaved=True),
    "longrope_long_by_seq_len": dict(scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                              "long_factor": [4.0, 5.0, 7.0, 9.0], "attention_factor": 1.3,
                                              "original_max_position_embeddings": 32}, rotary_dim=8, seq_len=33),
    "longrope_positions": dict(scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 4 for i in range(6)],
                                        "long_factor": [3.0 + i for i in range(6)], "factor": 16.0,
                                        "original_max_position_embeddings": 20}, rotary_offset=8, positions=True),
    "proportional": dict(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}),
    "rotary_offset": dict(rotary_offset=8),
    "rotary_offset_dim_scaled": dict(rotary_offset=4, rotary_dim=8, interleaved=True,
                                     scaling={"rope_type": "linear", "factor": 2.0}),
    "rotary_dim": dict(rotary_dim=6, positions=True),
    "mrope": dict(sections=[2, 3, 5], sections_mode="mrope", positions=True),
    "mrope_interleaved": dict(sections=[4, 3, 3], sections_mode="mrope_interleaved", interleaved=True,
                              positions=True),
    "axial_default_positions": dict(sections=[2, 4], sections_mode="axial", base=100.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
@pytest.mark.parametrize("case", list(FORMULA_CASES))
def test_rope_settings_against_the_formula(case, layout, dtype):
    """q, the returned k, the k cache rows and the v cache rows against formula_rope (float64,
    from the formulas: rope_reference, multi_axis_reference, transformers' longrope and
    proportional), for contiguous and paged caches."""
    torch.manual_seed(12)
    rope = dict(FORMULA_CASES[case])
    explicit = rope.pop("positions", False)
    S = 7 if layout == "thd" else 5
    q, k, v, kc, vc = make(layout, S=S, Hq=6, Hkv=3, D=D_FORMULA, Dv=12, dtype=dtype)
    if layout == "thd":
        where = dict(slot_mapping=torch.tensor([5, -1, 0, 19, 12, -1, 6]), offset=0 if explicit else 11)
    else:
        where = dict(offset=torch.tensor([1, 0, 6]))
    if explicit:
        shape = (S,) if layout == "thd" else (3, S)
        if "sections" in rope:
            shape = (len(rope["sections"]),) + shape
        positions = torch.randint(0, 30, shape)
        positions.view(-1)[1] = 29
        where["positions"] = positions
    check(q, k, v, kc, vc, layout=layout, **where, **rope)


def test_strided_inputs_and_caches():
    torch.manual_seed(5)
    B, S, H, D = 2, 3, 2, 16
    qkv = rand(B, S, 3 * H, D, dtype=torch.float32)  # a fused projection's output
    q, k, v = qkv[:, :, :H], qkv[:, :, H:2 * H], qkv[:, :, 2 * H:]
    big_k, big_v = rand(B, 9, H, 2 * D, dtype=torch.float32), rand(B, 9, H, 2 * D, dtype=torch.float32)
    kc, vc = big_k[..., ::2], big_v[..., D:]  # strided last dimension / storage offset
    check(q, k, v, kc, vc, offset=torch.tensor([0, 6]))


def test_strided_q_in_bhsd():
    torch.manual_seed(6)
    q = rand(2, 5, 4, 16, dtype=torch.float32).transpose(1, 2)  # (B, H, S, D), non-contiguous
    _, k, v, kc, vc = make("bhsd", B=2, dtype=torch.float32)
    check(q, k, v, kc, vc, offset=1, layout="bhsd")


def misaligned(x):
    """A copy of x whose data starts 2 elements past an allocation's start: not 32-byte aligned."""
    flat = torch.empty(x.numel() + 2, dtype=x.dtype)[2:]
    return flat.view(x.shape).copy_(x)


@pytest.mark.parametrize("dtype,interleaved,rotary_dim,aligned,layout", [
    (torch.float32, False, None, True, "bshd"),
    (torch.float32, True, None, True, "bhsd"),
    (torch.bfloat16, False, 96, True, "bshd"),
    (torch.bfloat16, True, None, False, "bshd"),
    (torch.float32, False, 40, True, "bhsd"),
    (torch.float32, False, None, False, "bhsd"),
])
def test_prefill_large_enough_to_stream(dtype, interleaved, rotary_dim, aligned, layout):
    """A prefill that writes 16 MiB (float32; 8 MiB in bfloat16) takes the CPU kernel's
    streaming stores (kStreamBytes, cpu/kernel.cpp) wherever a row is 32-byte
    aligned (rotary_dim 40's halves are not; nor are the misaligned caches' rows): the same
    bits as the same tokens written by eight calls small enough for plain stores, and the
    float64 reference's values."""
    torch.manual_seed(11)
    S, Hq, Hkv, D, max_len = 2048, 8, 4, 128, 2056
    q, k, v, kc, vc = make(layout, B=1, S=S, Hq=Hq, Hkv=Hkv, D=D, max_len=max_len, dtype=dtype)
    if not aligned:
        kc, vc = misaligned(kc), misaligned(vc)
    kw = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim)
    kc_small, vc_small = kc.clone(), vc.clone()
    q_ref, k_ref, kc_ref, vc_ref = reference(q, k, v, kc, vc, offset=5, **kw)
    out_q = rope_append_kv(q, k, v, kc, vc, offset=5, **kw)
    torch.testing.assert_close(out_q.to(F64), q_ref, **TOL[dtype])
    torch.testing.assert_close(kc.to(F64), kc_ref, **TOL[dtype])
    assert torch.equal(vc.to(F64), vc_ref)
    apply_q, apply_k = apply_rope(q, k, offset=5, **kw)  # the same bits (bfloat16: rotated in float32)
    assert torch.equal(out_q, apply_q)
    assert torch.equal(cache_view(kc, layout)[:, 5:5 + S], tokens_view(apply_k, layout))
    if torch.ops.posenc.cpu_capability() == "default":
        # The baseline kernels have no streaming stores: the comparison below would set plain
        # stores against plain stores (make test-python-baseline runs this file).
        pytest.skip("the baseline CPU kernels (POSENC_CPU_CAPABILITY=default) have no streaming stores")
    seq_dim = 2 if layout == "bhsd" else 1
    chunk = S // 8
    parts = []
    for start in range(0, S, chunk):
        q_part, k_part, v_part = (t.narrow(seq_dim, start, chunk) for t in (q, k, v))
        parts.append(rope_append_kv(q_part, k_part, v_part, kc_small, vc_small, offset=5 + start, **kw))
    assert torch.equal(out_q, torch.cat(parts, seq_dim))
    assert torch.equal(kc, kc_small) and torch.equal(vc, vc_small)


def test_inplace_and_return_k():
    torch.manual_seed(7)
    q, k, v, kc, vc = make("bshd")
    q_ref, k_ref, kc_ref, vc_ref = reference(q, k, v, kc, vc, offset=2)
    k0 = k.clone()
    out = rope_append_kv(q, k, v, kc, vc, offset=2, inplace=True)
    assert out is q and torch.equal(k, k0)  # k is rotated in place only with return_k
    torch.testing.assert_close(q, q_ref, **TOL[F64])
    torch.testing.assert_close(kc, kc_ref, **TOL[F64])
    q, k, v, kc, vc = make("bshd")
    q_ref, k_ref, kc_ref, vc_ref = reference(q, k, v, kc, vc, offset=2)
    out_q, out_k = rope_append_kv(q, k, v, kc, vc, offset=2, inplace=True, return_k=True)
    assert out_q is q and out_k is k
    torch.testing.assert_close(k, k_ref, **TOL[F64])
    torch.testing.assert_close(kc, kc_ref, **TOL[F64])
    torch.testing.assert_close(vc, vc_ref, **TOL[F64])
    # Out of place without return_k: q alone.
    q, k, v, kc, vc = make("bshd")
    assert isinstance(rope_append_kv(q, k, v, kc, vc), torch.Tensor)


def test_empty():
    q, k, v, kc, vc = make("bshd", S=0)
    kc0 = kc.clone()
    out = rope_append_kv(q, k, v, kc, vc, offset=12)  # no row written: any offset <= max_len
    assert out.shape == q.shape and torch.equal(kc, kc0)
    q, k, v, kc, vc = make("thd", S=0)
    assert rope_append_kv(q, k, v, kc, vc, slot_mapping=torch.zeros(0, dtype=torch.int64), layout="thd").numel() == 0


@pytest.mark.parametrize("case", ["past_end", "negative", "one_row", "slot_high", "slot_low"])
def test_out_of_range_rows_raise_before_writing(case):
    layout = "thd" if case.startswith("slot") else "bshd"
    q, k, v, kc, vc = make(layout, S=5)
    kc0, vc0, q0 = kc.clone(), vc.clone(), q.clone()
    kw = {
        "past_end": dict(offset=8),  # rows 8 .. 12 of 12
        "negative": dict(offset=-1),
        "one_row": dict(offset=torch.tensor([0, 8, 1])),
        "slot_high": dict(slot_mapping=torch.tensor([0, 1, 20, 2, 3]), layout="thd"),
        "slot_low": dict(slot_mapping=torch.tensor([0, 1, -2, 2, 3]), layout="thd"),
    }[case]
    what = "slot_mapping" if layout == "thd" else "batch row"
    with pytest.raises(IndexError, match=what):
        rope_append_kv(q, k, v, kc, vc, inplace=True, **kw)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0) and torch.equal(q, q0)


def test_bad_arguments_name_them():
    q, k, v, kc, vc = make("bshd", dtype=torch.float32)
    with pytest.raises(TypeError, match="k_cache"):
        rope_append_kv(q, k, v, kc.half(), vc)
    with pytest.raises(TypeError, match="v_cache"):
        rope_append_kv(q, k, v, kc, vc.double())
    with pytest.raises(TypeError, match="expected v"):
        rope_append_kv(q, k, v.double(), kc, vc)
    with pytest.raises(RuntimeError, match="k_cache of shape"):
        rope_append_kv(q, k, v, kc[:, :, :1], vc)
    with pytest.raises(RuntimeError, match="v_cache of shape"):
        rope_append_kv(q, k, v, kc, vc[:2])
    with pytest.raises(RuntimeError, match="expected v of k's shape"):
        rope_append_kv(q, k, v[:, :2], kc, vc)
    with pytest.raises(RuntimeError, match="as many rows"):
        rope_append_kv(q, k, v, kc, vc[:, :5])
    with pytest.raises(ValueError, match="slot_mapping is only used"):
        rope_append_kv(q, k, v, kc, vc, slot_mapping=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expected layout 'bshd', 'bhsd' \(contiguous cache\) or 'thd' "
                                         r"\(paged cache\), got 'sbhd'"):
        rope_append_kv(q, k, v, kc, vc, layout="sbhd")
    with pytest.raises(RuntimeError, match="offsets? of shape"):
        rope_append_kv(q, k, v, kc, vc, offset=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="k_cache and v_cache in separate memory"):
        rope_append_kv(q, k, v, kc, kc)
    q, k, v, kc, vc = make("thd", dtype=torch.float32)
    with pytest.raises(ValueError, match="needs slot_mapping"):
        rope_append_kv(q, k, v, kc, vc, layout="thd")
    with pytest.raises(TypeError, match="slot_mapping"):
        rope_append_kv(q, k, v, kc, vc, layout="thd", slot_mapping=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"slot_mapping of shape \(tokens,\)"):
        rope_append_kv(q, k, v, kc, vc, layout="thd", slot_mapping=torch.zeros(4, dtype=torch.int64))


def test_requires_grad_is_an_error_under_grad_mode():
    q, k, v, kc, vc = make("bshd")
    with pytest.raises(RuntimeError, match="no autograd.*got k that requires grad"):
        rope_append_kv(q, k.requires_grad_(), v, kc, vc)
    with torch.no_grad():
        rope_append_kv(q, k, v, kc, vc)  # fine without grad mode
    with pytest.raises(RuntimeError, match="no autograd.*got q that requires grad"):
        rope_append_kv(q.requires_grad_(), k.detach(), v, kc, vc, offset=1)


def test_a_tangent_is_an_error_not_dropped():
    """Forward AD (torch.func.jvp, forward_ad): the op has no forward formula (it writes a
    cache), so a tangent on any input is refused rather than silently lost."""
    from torch.autograd import forward_ad

    q, k, v, kc, vc = make("bshd")
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match="no forward-mode AD.*got q that carries a tangent"):
            rope_append_kv(dual, k, v, kc, vc)
    with pytest.raises(RuntimeError, match="got v that"):  # functorch's jvp: the same refusal
        torch.func.jvp(lambda v, kc, vc: rope_append_kv(q, k, v, kc, vc), (v, kc, vc),
                       (torch.ones_like(v), torch.zeros_like(kc), torch.zeros_like(vc)))
    # Caches the function captured: refused first, as writes into captured tensors
    # (test_func_rope.py's test of them).
    with pytest.raises(RuntimeError, match="would write k_cache in place, a tensor captured"):
        torch.func.jvp(lambda v: rope_append_kv(q, k, v, kc, vc), (v,), (torch.ones_like(v),))


def test_written_tensors_move_their_version_counters():
    # As an ATen in-place op: autograd must see that a saved cache (or q, k in place) changed.
    q, k, v, kc, vc = make("bshd")
    versions = [t._version for t in (q, k, v, kc, vc)]
    rope_append_kv(q, k, v, kc, vc, offset=1)
    assert [t._version for t in (q, k, v, kc, vc)] == [versions[0], versions[1], versions[2],
                                                        versions[3] + 1, versions[4] + 1]
    rope_append_kv(q, k, v, kc, vc, offset=1, inplace=True, return_k=True)
    assert [t._version for t in (q, k, v, kc, vc)] == [versions[0] + 1, versions[1] + 1, versions[2],
                                                        versions[3] + 2, versions[4] + 2]
    w = torch.ones((), dtype=kc.dtype, requires_grad=True)
    saved = kc * w  # saves kc for the backward of w
    rope_append_kv(q, k, v, kc, vc, offset=3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_opcheck():
    q, k, v, kc, vc = make("bshd", dtype=torch.float32)
    ops = torch.ops.posenc
    opcheck(ops.rope_append_kv, (q, k, v, kc, vc), dict(offsets=torch.tensor([0, 2, 4]), return_k=True))
    opcheck(ops.rope_append_kv_.default, (q.clone(), k.clone(), v, kc, vc), dict(offset=3, return_k=True))
    # The overload without return_k reads k (its schema: Tensor k): opcheck's schema test fails
    # if the op wrote k there.
    opcheck(ops.rope_append_kv_.keep_k, (q.clone(), k.clone(), v, kc, vc), dict(offset=3))
    with pytest.raises(ValueError, match="expected return_k=False"):
        ops.rope_append_kv_.keep_k(q.clone(), k.clone(), v, kc, vc, offset=3, return_k=True)
    q, k, v, kc, vc = make("thd", dtype=torch.float32)
    opcheck(ops.rope_append_kv, (q, k, v, kc, vc),
            dict(slot_mapping=torch.tensor([3, -1, 9, 0, 1]), positions=torch.arange(5) + 2, layout="thd"))
    q, k, v, kc, vc = make("bhsd", dtype=torch.float32)
    opcheck(ops.rope_append_kv, (q, k, v, kc, vc), dict(offset=2, layout="bhsd"))


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_compile_fullgraph_mutates_the_caches(layout):
    torch._dynamo.reset()
    q, k, v, kc, vc = make(layout, dtype=torch.float32)
    kw = dict(layout="thd", slot_mapping=torch.tensor([3, -1, 9, 0, 1])) if layout == "thd" else \
        dict(offset=torch.tensor([0, 2, 4]))

    def step(q, k, v, kc, vc):
        return rope_append_kv(q, k, v, kc, vc, **kw) * 2

    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(q, k, v, kc_e, vc_e)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    kc0 = kc.clone()
    out = compiled(q, k, v, kc, vc)
    assert not torch.equal(kc, kc0)  # the compiled call wrote the caller's cache
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(kc, kc_e)
    torch.testing.assert_close(vc, vc_e)


def test_compile_inductor_decode_step():
    torch._dynamo.reset()
    q, k, v, kc, vc = make("bhsd", S=1, dtype=torch.float32)

    def step(q, k, v, kc, vc, lengths):
        return rope_append_kv(q, k, v, kc, vc, offset=lengths, layout="bhsd", inplace=True)

    lengths = torch.tensor([0, 3, 5])
    kc_e, vc_e = kc.clone(), vc.clone()
    eager = step(q.clone(), k, v, kc_e, vc_e, lengths)
    out = torch.compile(step, fullgraph=True)(q.clone(), k, v, kc, vc, lengths)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(kc, kc_e)
    torch.testing.assert_close(vc, vc_e)


PYTHON_DIR = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python")

FALLBACK_SCRIPT = r"""
import torch
from posenc.functional import rope_append_kv

g = torch.Generator().manual_seed(5)

def rand(*shape):
    return torch.randn(*shape, generator=g)

out = {}
for name, layout, kw in (
    ("bshd", "bshd", dict(offset=torch.tensor([0, 7, 3]), return_k=True)),
    ("bhsd", "bhsd", dict(offset=2, rotary_dim=8, interleaved=True)),
    ("thd", "thd", dict(slot_mapping=torch.tensor([5, -1, 0, 19, 12]), positions=torch.tensor([3, 9, 0, 40, 1]))),
):
    if layout == "thd":
        q, k, v, kc, vc = rand(5, 4, 16), rand(5, 2, 16), rand(5, 2, 16), rand(5, 4, 2, 16), rand(5, 4, 2, 16)
    elif layout == "bhsd":
        q, k, v, kc, vc = rand(3, 4, 5, 16), rand(3, 2, 5, 16), rand(3, 2, 5, 16), rand(3, 2, 12, 16), rand(3, 2, 12, 16)
    else:
        q, k, v, kc, vc = rand(3, 5, 4, 16), rand(3, 5, 2, 16), rand(3, 5, 2, 16), rand(3, 12, 2, 16), rand(3, 12, 2, 16)
    res = rope_append_kv(q, k, v, kc, vc, layout=layout, **kw)
    out[name] = (res if isinstance(res, tuple) else (res,)) + (kc, vc)
    q2 = q.clone()
    rope_append_kv(q2, k, v, kc.clone(), vc.clone(), layout=layout, inplace=True, **kw)
    out[name + "_inplace"] = (q2,)
kc = rand(3, 12, 2, 16)
before = kc.clone()
try:
    rope_append_kv(rand(3, 5, 4, 16), rand(3, 5, 2, 16), rand(3, 5, 2, 16), kc, rand(3, 12, 2, 16),
                   offset=torch.tensor([0, 8, 1]))
    out["error"] = None
except IndexError as e:
    out["error"] = (type(e).__name__, str(e).split("\n")[0], torch.equal(kc, before))
"""


def test_aten_fallback_matches_the_kernel():
    """The ATen composite (in rope_append_kv.cpp, reached through the dispatcher:
    aten_fallback_mode) writes the same rows, rotates as the kernel to float32 rounding, and
    refuses the same rows; the composite calls are counted, so it did run."""
    from aten_fallback_mode import ThroughTheFallback

    results = {}
    for forced in ("0", "1"):
        scope = {}
        if forced == "1":
            with ThroughTheFallback() as mode:
                exec(FALLBACK_SCRIPT, scope)
        else:
            exec(FALLBACK_SCRIPT, scope)
        results[forced] = scope["out"]
    assert mode.calls.get("posenc::rope_append_kv", 0) > 0 and mode.calls.get("posenc::rope_append_kv_", 0) > 0
    kernel, fallback = results["0"], results["1"]
    assert kernel.keys() == fallback.keys()
    for key in kernel:
        if key == "error":
            assert kernel[key] == fallback[key] and kernel[key][2], (kernel[key], fallback[key])
            continue
        for a, b in zip(kernel[key], fallback[key]):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_cuda_kernel_matches_the_cpu_kernel(dtype, layout):
    """The CUDA kernel (cuda/rope_append_kv/) against the CPU one: same rows written, the same
    rotation (both round as math::rope_rotate_pair), return_k and in place."""
    torch.manual_seed(8)
    q, k, v, kc, vc = make(layout, D=24, Dv=20, dtype=dtype)
    kw = dict(layout=layout, rotary_dim=16, scaling={"rope_type": "linear", "factor": 2.0})
    if layout == "thd":
        kw.update(slot_mapping=torch.tensor([5, -1, 0, 19, 12]), positions=torch.tensor([3, 9, 0, 40, 1]))
    else:
        kw.update(offset=torch.tensor([0, 7, 3]))
    cuda_kw = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    kc_gpu, vc_gpu = kc.cuda(), vc.cuda()
    want = rope_append_kv(q, k, v, kc, vc, return_k=True, **kw)
    got = rope_append_kv(q.cuda(), k.cuda(), v.cuda(), kc_gpu, vc_gpu, return_k=True, **cuda_kw)
    for g, w in zip(got + (kc_gpu, vc_gpu), want + (kc, vc)):
        torch.testing.assert_close(g.cpu(), w, **TOL[dtype])
    q_gpu = q.cuda()
    rope_append_kv(q_gpu, k.cuda(), v.cuda(), kc_gpu, vc_gpu, inplace=True, **cuda_kw)
    torch.testing.assert_close(q_gpu.cpu(), want[0], **TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["row", "slot"])
def test_cuda_out_of_range_rows_stop_the_kernel(case):
    """A row or slot outside the cache is not written: the kernel stops with a device-side
    assert (a RuntimeError at the next synchronisation), as ATen's indexing."""
    import os
    import subprocess
    import sys

    call = {
        "row": "F.rope_append_kv(q, k, k.clone(), kc, kc.clone(), offset=torch.tensor([0, 6], device='cuda'))",
        "slot": "F.rope_append_kv(q[0], k[0], k[0].clone(), kc, kc.clone(), layout='thd', "
                "slot_mapping=torch.tensor([0, 1, 99], device='cuda'))",
    }[case]
    code = f"""
import torch, posenc
F = posenc.functional
q, k = torch.randn(2, 3, 4, 8, device="cuda"), torch.randn(2, 3, 2, 8, device="cuda")
kc = torch.zeros(2, 8, 2, 8, device="cuda")
try:
    {call}
    torch.cuda.synchronize()
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
else:
    print("no error")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "device-side assert triggered" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "posenc: rope_append_kv: a cache row or slot_mapping slot out of range" in r.stdout + r.stderr
