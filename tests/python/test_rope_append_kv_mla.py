"""MLA's latent cache through rope_append_kv (issue 39, item 4): DeepSeek's cache row is
``[kv_c | k_pe]``, the compressed latent as it is, then the rotated shared key part. One call
writes both halves: ``v`` is kv_c (its own head_dim, kv_lora_rank), ``k`` is k_pe, and the caches
are the two slices of one latent cache; q's trailing q_pe part (a view of q) is rotated in place.
Against float64 references of the formulas, every cache kind (paged and contiguous, float32,
bfloat16, FP8 with one scale), torch.compile."""

import pytest
import torch

import posenc  # noqa: F401
from posenc.functional import apply_rope, rope_append_kv

NOPE, ROPE, LORA = 128, 64, 512  # DeepSeek-V3: qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def append_mla(q, kv_c, k_pe, latent, **kw):
    """The recipe of docs/guide/kv_cache.md: q_pe rotated in place in q, [kv_c | k_pe] written."""
    return rope_append_kv(q[..., NOPE:], k_pe, kv_c, latent[..., LORA:], latent[..., :LORA], inplace=True,
                          interleaved=True, **kw)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("paged", [True, False])
def test_latent_cache_rows_and_q_pe(cache_dtype, paged):
    g = torch.Generator().manual_seed(int(paged))
    dtype = torch.float32 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    H = 4
    fp8 = cache_dtype in FP8_MAX
    scale = dict(k_scale=0.02, v_scale=0.02) if fp8 else {}
    if paged:
        T = 6
        q = torch.randn(T, H, NOPE + ROPE, generator=g).to(dtype)
        kv_c, k_pe = torch.randn(T, 1, LORA, generator=g).to(dtype), torch.randn(T, 1, ROPE, generator=g).to(dtype)
        latent = torch.zeros(4, 4, 1, LORA + ROPE, dtype=cache_dtype)
        slots, pos = torch.tensor([0, 5, 6, -1, 11, 15]), torch.tensor([0, 1, 2, 3, 4, 5])
        kw = dict(positions=pos, slot_mapping=slots, layout="thd")
        rows = [(s // 4, s % 4, t) for t, s in enumerate(slots.tolist()) if s >= 0]
        pos_of = pos[None]
    else:
        B, S, L = 2, 3, 8
        q = torch.randn(B, S, H, NOPE + ROPE, generator=g).to(dtype)
        kv_c, k_pe = torch.randn(B, S, 1, LORA, generator=g).to(dtype), torch.randn(B, S, 1, ROPE, generator=g).to(dtype)
        latent = torch.zeros(B, L, 1, LORA + ROPE, dtype=cache_dtype)
        lengths = torch.tensor([2, 5])
        kw = dict(offset=lengths)
        rows = [(b, int(lengths[b]) + s, (b, s)) for b in range(B) for s in range(S)]
        pos_of = lengths[:, None] + torch.arange(S)
    q0 = q.clone()
    append_mla(q, kv_c, k_pe, latent, **kw, **scale)
    # q: the nope part untouched, q_pe rotated in adjacent pairs at its position.
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE])
    as_bshd = (lambda x: x.unsqueeze(0)) if paged else (lambda x: x)
    want_q = apply_rope(as_bshd(q0[..., NOPE:]).double(), positions=pos_of, interleaved=True)
    torch.testing.assert_close(as_bshd(q[..., NOPE:]).double(), want_q, atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    # The latent rows: [kv_c | rotated k_pe]; FP8: the float32 values quantised with the scale.
    k_rot = apply_rope(as_bshd(k_pe).float(), positions=pos_of, interleaved=True)
    k_rot = k_rot.squeeze(0) if paged else k_rot
    written = 0
    for outer, inner, token in rows:
        row = latent[outer, inner, 0]
        want = torch.cat([kv_c[token][0].float(), k_rot[token][0]])
        if fp8:
            want = (want / torch.tensor(0.02)).clamp(-448, 448).to(cache_dtype)
            assert torch.equal(row.view(torch.uint8), want.view(torch.uint8))
        else:
            torch.testing.assert_close(row.float(), want, atol=1e-2 if dtype == torch.bfloat16 else 0,
                                       rtol=1e-2 if dtype == torch.bfloat16 else 0)
        written += 1
    assert int((latent.float().abs().sum(-1) != 0).sum()) == written  # nothing else written


def test_latent_cache_under_compile():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 4, NOPE + ROPE, generator=g)
    kv_c, k_pe = torch.randn(1, 1, 1, LORA, generator=g), torch.randn(1, 1, 1, ROPE, generator=g)
    lengths = torch.tensor([3])

    def step(q, kv_c, k_pe, latent, lengths):
        append_mla(q, kv_c, k_pe, latent, offset=lengths)
        return q

    want_latent, got_latent = torch.zeros(1, 8, 1, LORA + ROPE), torch.zeros(1, 8, 1, LORA + ROPE)
    want = step(q.clone(), kv_c, k_pe, want_latent, lengths)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q.clone(), kv_c, k_pe, got_latent, lengths)
    assert torch.equal(got, want) and torch.equal(got_latent, want_latent)
