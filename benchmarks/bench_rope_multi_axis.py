"""Benchmark of posenc's multi-axis RoPE (Qwen2-VL M-RoPE) against plain PyTorch.

The reference is transformers' Qwen2-VL formulation: cos/sin of every axis at its positions,
the sections picked out of each axis (mrope_section * 2 along head_dim), then
``x * cos + rotate_half(x) * sin`` for q and k. "eager" builds cos/sin in the call (as the
model does once per forward); "eager, tables given" gets them precomputed and only rotates:
the stricter comparison. Both are timed forward and forward + backward (autograd), and the
rotation under torch.compile, in one interleaved run.

Default: (1, 4096, 16 heads, 128) for q and k, sections [16, 24, 24], float32, CPU.
Usage: python benchmarks/bench_rope_multi_axis.py [--device cpu|cuda] [--dtype float32] [--reps N]
                                                   [--no-compile]
"""

import argparse
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from harness import grad_step, time_interleaved  # noqa: E402
from posenc.functional import apply_rope  # noqa: E402

SECTIONS = [16, 24, 24]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def mrope_tables(positions, head_dim, sections, base, dtype):
    """(cos, sin) of shape (B, S, 1, D) as Qwen2-VL builds them from (3, B, S) positions."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv  # (3, B, S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (3, B, S, D)
    parts = emb.split(sections * 2, dim=-1)
    cos = torch.cat([p[i % 3].cos() for i, p in enumerate(parts)], dim=-1)
    sin = torch.cat([p[i % 3].sin() for i, p in enumerate(parts)], dim=-1)
    return cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def rotate(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--shape", default="1,4096,16,128", help="B,S,H,D (q and k alike)")
    args = parser.parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    B, S, H, D = map(int, args.shape.split(","))
    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, device=device, dtype=dtype)
    k = torch.randn(B, S, H, D, device=device, dtype=dtype)
    # A vision block in the middle of text: (t, h, w) differ there, agree elsewhere.
    pos = torch.arange(S, device=device).expand(3, B, S).clone()
    lo, side = S // 4, 32
    grid = torch.arange(side * side, device=device)
    pos[1, :, lo : lo + side * side] = lo + grid // side
    pos[2, :, lo : lo + side * side] = lo + grid % side
    base = 1e6
    cos, sin = mrope_tables(pos, D, SECTIONS, base, dtype)

    def ours(a, b):
        return apply_rope(a, b, positions=pos, sections=SECTIONS, sections_mode="mrope", base=base)

    def eager(a, b):
        c, s = mrope_tables(pos, D, SECTIONS, base, dtype)
        return rotate(a, b, c, s)

    def eager_tables(a, b):
        return rotate(a, b, cos, sin)

    # Same numbers first.
    with torch.no_grad():
        diff = max((x.double() - y.double()).abs().max().item() for x, y in zip(ours(q, k), eager(q, k)))
    print(f"posenc vs reference, max |difference|: {diff:.3g}")
    forms = {"posenc": ours, "eager": eager, "eager, tables given": eager_tables}
    if not args.no_compile:
        compiled = torch.compile(rotate)
        forms["compile, tables given"] = lambda a, b: compiled(a, b, cos, sin)

    with torch.no_grad():
        fwd = time_interleaved({n: (lambda f=f: f(q, k)) for n, f in forms.items()}, device, args.reps)
    qg, kg = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    fb = time_interleaved({n: grad_step(f, (qg, kg), (gq, gk)) for n, f in forms.items()}, device, args.reps)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    print(f"{device} {args.dtype} q, k ({B}, {S}, {H}, {D}) sections {SECTIONS}, {torch.get_num_threads()} threads")
    print(f"{'form':24} {'forward ms':>11} {'ratio':>6} {'fwd+bwd ms':>11} {'ratio':>6}")
    for n in forms:
        print(f"{n:24} {fwd[n]:11.3f} {fwd[n] / fwd['posenc']:6.2f} {fb[n]:11.3f} {fb[n] / fb['posenc']:6.2f}")
    print(f"posenc forward: {nbytes / (fwd['posenc'] * 1e-3) / 1e9:.1f} GB/s (q and k read + written); "
          "ratio: the form's time over posenc's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
