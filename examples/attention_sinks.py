"""Generation with attention sinks and a sliding window (StreamingLLM), the cache kept by posenc.

A tiny random one-layer decoder generates greedily with a fixed-size KV cache: the first
SINKS tokens stay (the attention sinks), the last WINDOW tokens after them slide. When the
cache is full, the DROP oldest window tokens leave: the rows after them move down with index
copies (keys and values), and rope_shift_kv re-rotates the moved keys from the positions they
were written at to their new ones (positions are cache slots, as in StreamingLLM). New tokens
are rotated and written by rope_append_kv.

The check: at the end, the cached keys equal the model's keys recomputed at their current
positions (the pre-RoPE keys, moved by the same index copies, rotated by apply_rope), within
float32 rounding, after many shifts. Run: ``python examples/attention_sinks.py``.
"""

from __future__ import annotations

import torch

from posenc.functional import apply_rope, rope_append_kv, rope_shift_kv

SINKS, WINDOW, DROP = 4, 12, 4
MAX_LEN = SINKS + WINDOW
VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 4, 2, 16
# yarn: its attention factor is in the cached keys, and must not be applied again by the shift.
SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


class TinyDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        p = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)  # noqa: E731
        self.embed = p(VOCAB, D_MODEL)
        self.wq, self.wk = p(HEADS * HEAD_DIM, D_MODEL), p(KV_HEADS * HEAD_DIM, D_MODEL)
        self.wv, self.wo = p(KV_HEADS * HEAD_DIM, D_MODEL), p(D_MODEL, HEADS * HEAD_DIM)
        self.head = p(VOCAB, D_MODEL)

    def project(self, token: int):
        """q, k, v of one token, (1, 1, heads, head_dim) ("bshd"), before RoPE."""
        x = self.embed[token]
        q = (self.wq @ x).view(1, 1, HEADS, HEAD_DIM)
        k = (self.wk @ x).view(1, 1, KV_HEADS, HEAD_DIM)
        v = (self.wv @ x).view(1, 1, KV_HEADS, HEAD_DIM)
        return q, k, v

    def attend(self, q, k_cache, v_cache, length: int) -> int:
        """The next token from q (rotated) over the first `length` cache rows."""
        k = k_cache[0, :length].repeat_interleave(HEADS // KV_HEADS, dim=1)  # (length, heads, d)
        v = v_cache[0, :length].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[0, 0], k) / HEAD_DIM**0.5
        out = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1)
        return int((self.head @ (self.wo @ out)).argmax())


@torch.inference_mode()
def generate(steps: int = 60, first_token: int = 1):
    """Greedy tokens, and the final (k_cache, recomputed keys, length, shifts)."""
    model = TinyDecoder()
    k_cache = torch.zeros(1, MAX_LEN, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros(1, MAX_LEN, KV_HEADS, HEAD_DIM)
    raw_k = torch.zeros(1, MAX_LEN, KV_HEADS, HEAD_DIM)  # the keys before RoPE, for the check
    length, shifts, token, tokens = 0, 0, first_token, []
    for _ in range(steps):
        if length == MAX_LEN:  # evict DROP window tokens after the sinks, move the rest down
            src = torch.arange(SINKS + DROP, MAX_LEN)
            dst = torch.arange(SINKS, MAX_LEN - DROP)
            for cache in (k_cache, v_cache, raw_k):
                cache[:, dst] = cache[:, src]  # index copies (a copy: src and dst overlap)
            # The moved keys were written at positions src; they now sit at positions dst.
            rope_shift_kv(k_cache, src, dst, rows=dst, scaling=SCALING)
            length -= DROP
            shifts += 1
        q, k, v = model.project(token)
        raw_k[:, length] = k[:, 0]
        # Rotate q and k at position `length` and write k, v into cache row `length`.
        q = rope_append_kv(q, k, v, k_cache, v_cache, offset=length, scaling=SCALING)
        length += 1
        token = model.attend(q, k_cache, v_cache, length)
        tokens.append(token)
    recomputed = apply_rope(raw_k[:, :length], positions=torch.arange(length), scaling=SCALING)
    return tokens, k_cache[:, :length], recomputed, length, shifts


def main() -> None:
    tokens, cached, recomputed, length, shifts = generate()
    err = (cached - recomputed).abs().max().item()
    print(f"generated {len(tokens)} tokens with {SINKS} sinks and a window of {WINDOW}: "
          f"{shifts} shifts, cache length {length}, largest key difference {err:.2e}")
    torch.testing.assert_close(cached, recomputed, atol=1e-5, rtol=1e-5)
    print("the cache holds the keys at their current positions")


if __name__ == "__main__":
    main()
