"""Benchmark of rope_append_kv (RoPE of q and k, k and v written into the KV cache, one pass)
against the composition it replaces: posenc's apply_rope followed by the index copies of k and
v into the cache (eager), and torch.compile of that composition, in the same run (calls
interleaved). Decode: batch 8, 1 new token, 32 q / 8 kv heads, head_dim 128, cache 4096 rows
with per-row lengths; prefill: 1 row of 2048 tokens into the same cache. GB/s counts q, k, v
read once and q, k and v written once (what one pass must move).

Usage: python benchmarks/bench_rope_append_kv.py [--device cpu|cuda] [--dtype float32]
       [--reps N] [--no-compile]
"""

import argparse
import functools
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from harness import time_interleaved  # noqa: E402
from posenc.functional import apply_rope, rope_append_kv  # noqa: E402

CASES = {  # name: (batch, new tokens, q heads, kv heads, head_dim, cache rows)
    "decode": (8, 1, 32, 8, 128, 4096),
    "prefill": (1, 2048, 32, 8, 128, 4096),
}


def composition(q, k, v, k_cache, v_cache, lengths):
    """What a decoding loop writes without the fused op: rotate, then copy k and v into the
    rows lengths[b] .. lengths[b] + seq - 1."""
    q, k = apply_rope(q, k, offset=lengths)
    B, S = k.shape[:2]
    rows = lengths[:, None] + torch.arange(S, device=k.device)
    batch = torch.arange(B, device=k.device)[:, None]
    k_cache[batch, rows] = k
    v_cache[batch, rows] = v
    return q


def fused(q, k, v, k_cache, v_cache, lengths):
    return rope_append_kv(q, k, v, k_cache, v_cache, offset=lengths)


K_SCALE, V_SCALE = 0.05, 0.02


def composition_fp8(q, k, v, k_cache, v_cache, lengths, k_bits=None, v_bits=None):
    """The FP8-cache contract written out: rotate float32 copies, quantise (divide by the
    scale, saturate, round), copy the bits into the rows. ``k_bits`` / ``v_bits``: uint8 views
    of the caches made by the caller (default: here). Given, torch.compile writes the rows of
    its inputs in place; a view taken inside the compiled function made Inductor copy both
    whole caches out and back at every call."""
    k_bits = k_cache.view(torch.uint8) if k_bits is None else k_bits
    v_bits = v_cache.view(torch.uint8) if v_bits is None else v_bits
    q, k32 = apply_rope(q, offset=lengths), apply_rope(k.float(), offset=lengths)
    B, S = k.shape[:2]
    rows = lengths[:, None] + torch.arange(S, device=k.device)
    batch = torch.arange(B, device=k.device)[:, None]
    k_bits[batch, rows] = (k32 / K_SCALE).clamp(-448, 448).to(k_cache.dtype).view(torch.uint8)
    v_bits[batch, rows] = (v.float() / V_SCALE).clamp(-448, 448).to(v_cache.dtype).view(torch.uint8)
    return q


def fused_fp8(q, k, v, k_cache, v_cache, lengths, k_bits=None, v_bits=None):
    return rope_append_kv(q, k, v, k_cache, v_cache, offset=lengths, k_scale=K_SCALE, v_scale=V_SCALE)


def rms_norm(x, w, eps=1e-6):
    """Qwen3's RMSNorm of each head's vector (float32 statistics, as Qwen3RMSNorm)."""
    x32 = x.float()
    return (w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def composition_qk_norm(q, k, v, k_cache, v_cache, lengths, q_weight, k_weight):
    """A Qwen3 decoding step without the fused op: q_norm and k_norm, rotate, copy k and v
    into the rows."""
    return composition(rms_norm(q, q_weight), rms_norm(k, k_weight), v, k_cache, v_cache, lengths)


def fused_qk_norm(q, k, v, k_cache, v_cache, lengths, q_weight, k_weight):
    return rope_append_kv(q, k, v, k_cache, v_cache, offset=lengths, q_weight=q_weight, k_weight=k_weight)


MLA_NOPE, MLA_ROPE, MLA_LORA = 128, 64, 512  # DeepSeek-V3


def composition_mla(q, kv_c, k_pe, latent, lengths):
    """MLA's cache write without the fused op: rotate q_pe (in q, in place, as the fused call
    does) and k_pe (adjacent pairs), copy [kv_c | k_pe] into the latent rows. (Hugging Face's
    DeepSeek code builds a new q with torch.cat; that moves a third more bytes than the fused
    call's work, so it is not the composition of the same outputs.)"""
    q[..., MLA_NOPE:] = apply_rope(q[..., MLA_NOPE:], offset=lengths, interleaved=True)
    k_pe = apply_rope(k_pe, offset=lengths, interleaved=True)
    B, S = k_pe.shape[:2]
    rows = lengths[:, None] + torch.arange(S, device=k_pe.device)
    batch = torch.arange(B, device=k_pe.device)[:, None]
    latent[batch, rows] = torch.cat([kv_c, k_pe], -1)
    return q


def fused_mla(q, kv_c, k_pe, latent, lengths):
    rope_append_kv(q[..., MLA_NOPE:], k_pe, kv_c, latent[..., MLA_LORA:], latent[..., :MLA_LORA], offset=lengths,
                   interleaved=True, inplace=True)
    return q


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    print(f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}")
    print("| case | shape (B, S, Hq, Hkv, D, cache) | fused ms | GB/s | apply_rope + copies ms | "
          "compile of it ms | vs eager | vs compile |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (B, S, Hq, Hkv, D, L) in CASES.items():
        torch.manual_seed(0)
        q = torch.randn(B, S, Hq, D, device=device, dtype=dtype)
        k = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
        v = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
        k_cache = torch.zeros(B, L, Hkv, D, device=device, dtype=dtype)
        v_cache = torch.zeros(B, L, Hkv, D, device=device, dtype=dtype)
        lengths = torch.randint(0, L - S + 1, (B,), device=device)
        # Same results first (the timings compare equal work).
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        out = fused(q, k, v, k_cache, v_cache, lengths)
        ref = composition(q, k, v, kc2, vc2, lengths)
        assert torch.equal(out, ref) and torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)
        call = (q, k, v, k_cache, v_cache, lengths)
        fns = {"fused": functools.partial(fused, *call), "eager": functools.partial(composition, *call)}
        if not args.no_compile:
            fns["compile"] = functools.partial(torch.compile(composition), *call)
        ms = time_interleaved(fns, device, reps=args.reps, warmup=5)
        nbytes = 2 * (q.numel() + k.numel() + v.numel()) * q.element_size()
        gbps = nbytes / (ms["fused"] * 1e-3) / 1e9
        t, e, c = ms["fused"], ms["eager"], ms.get("compile")
        c_text = "-" if c is None else f"{c:.4f}"
        c_ratio = "-" if c is None else f"{c / t:.2f}x"
        print(f"| {name} | ({B}, {S}, {Hq}, {Hkv}, {D}, {L}) | {t:.4f} | {gbps:.3g} | {e:.4f} | {c_text} | "
              f"{e / t:.2f}x | {c_ratio} |")


if __name__ == "__main__":
    main()
