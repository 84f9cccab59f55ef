"""The CPU kernel walks "bhsd" tensors head by head over blocks of tokens (32, or up to 128 in
float32 / float64 where every thread still gets two blocks), "bshd" token by
token, and "bshd" batches that share their positions batch row by batch row over blocks of
tokens (long sequences): the same angles and the same rotation per row, so the same bits,
whatever the order (every dtype, shared and per-row positions, offsets, partial rotary, in
place, GQA)."""

import pytest
import torch

from posenc.functional import apply_rope

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def check_bhsd_equals_bshd(q, k, **kwargs):
    """apply_rope of the "bhsd" copies of q and k (out of place and in place) gives the bits
    of the "bshd" call."""
    want_q, want_k = apply_rope(q, k, **kwargs)
    qh, kh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    got_q, got_k = apply_rope(qh, kh, layout="bhsd", **kwargs)
    assert torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k)
    with torch.no_grad():
        apply_rope(qh, kh, layout="bhsd", inplace=True, **kwargs)
    assert torch.equal(qh.transpose(1, 2), want_q) and torch.equal(kh.transpose(1, 2), want_k)


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
    check_bhsd_equals_bshd(q, k, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", [{}, dict(offset=7), dict(rotary_dim=32, interleaved=True),
                                    dict(positions=torch.arange(300) * 3)])
def test_a_shared_position_batch_equals_its_rows_bit_for_bit(dtype, kwargs):
    # 300 tokens, 2 threads: the batch-row-by-row walk over blocks (2 blocks per thread at
    # least); one batch row at a time: the token walk.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(1)
        q, k = torch.randn(3, 300, 4, 64).to(dtype), torch.randn(3, 300, 2, 64).to(dtype)
        got_q, got_k = apply_rope(q, k, **kwargs)
        for b in range(3):
            want_q, want_k = apply_rope(q[b:b + 1], k[b:b + 1], **kwargs)
            assert torch.equal(got_q[b:b + 1], want_q) and torch.equal(got_k[b:b + 1], want_k)
        q2, k2 = q.clone(), k.clone()
        with torch.no_grad():
            apply_rope(q2, k2, inplace=True, **kwargs)
        assert torch.equal(q2, got_q) and torch.equal(k2, got_k)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kwargs", [{}, dict(positions=torch.randint(0, 4000, (2, 300))),
                                    dict(rotary_dim=32, interleaved=True)])
def test_bhsd_long_blocks_equal_bshd_bit_for_bit(dtype, threads, kwargs):
    # 300 tokens: float32 / float64 blocks of 64 (2 threads, shared positions: 5 blocks) or
    # 128 (1 thread, or per-row positions: twice the blocks), with a part block at the end.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(2)
        q, k = torch.randn(2, 300, 3, 64).to(dtype), torch.randn(2, 300, 1, 64).to(dtype)
        check_bhsd_equals_bshd(q, k, **kwargs)
    finally:
        torch.set_num_threads(before)
