"""The CPU kernel walks "bhsd" tensors head by head over blocks of tokens and "bshd" token by
token: the same angles and the same rotation per row, so the same bits, whatever the order
(every dtype, shared and per-row positions, offsets, partial rotary, in place, GQA)."""

import pytest
import torch

from posenc.functional import apply_rope

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", [
    {}, dict(positions=torch.randint(0, 4000, (3, 70))), dict(offset=torch.tensor([0, 5, 900])),
    dict(rotary_dim=32, interleaved=True), dict(scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
])
def test_bhsd_equals_bshd_bit_for_bit(dtype, kwargs):
    torch.manual_seed(0)
    q = torch.randn(3, 70, 4, 64).to(dtype)  # 70 tokens: two full blocks of 32 and a part
    k = torch.randn(3, 70, 2, 64).to(dtype)
    want_q, want_k = apply_rope(q, k, **kwargs)
    qh, kh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    got_q, got_k = apply_rope(qh, kh, layout="bhsd", **kwargs)
    assert torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k)
    with torch.no_grad():
        apply_rope(qh, kh, layout="bhsd", inplace=True, **kwargs)
    assert torch.equal(qh.transpose(1, 2), want_q) and torch.equal(kh.transpose(1, 2), want_k)
