"""Benchmark of posenc's fused QK-norm + RoPE (issue 24), forward + backward, against the
composition users run today: Hugging Face's RMSNorm modules (Qwen3RMSNorm when transformers
is installed, else the same formula written out) followed by posenc's apply_rope, in eager
mode and under torch.compile.

Default: (1, 4096, 32 q heads, 8 kv heads, 128), float32 and bfloat16, on the CPU.
Bytes counted: the forward reads q, k and writes them once (2x), the backward reads x and the
incoming gradient and writes dx (3x): 5 * (q + k) bytes per forward + backward.
Then inference (no_grad, forward only, 2 * (q + k) bytes): inplace=True (the in-place op
qk_norm_rope_), out of place, the former inplace=True (out of place, then copied into q and
k), and the eager composition.
Usage: python benchmarks/bench_qk_norm_rope.py [--device cpu|cuda] [--dtypes float32,bfloat16]
                                               [--shape B,S,Hq,Hk,D] [--iters N] [--no-compile]
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import argparse
import statistics
import sys
import time

import torch

import posenc
from posenc.functional import apply_rope, qk_norm_rope

try:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as RMSNorm
except ImportError:  # the same formula (transformers' Qwen3RMSNorm / LlamaRMSNorm)
    class RMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)


def timeit(fn, iters, sync):
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_dtype(name, args, B, S, Hq, Hk, D, dev, sync):
    dtype = getattr(torch, name)
    q = torch.randn(B, S, Hq, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dtype, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qn, kn = RMSNorm(D).to(dev, dtype), RMSNorm(D).to(dev, dtype)
    theta = 1_000_000.0

    def composed(q, k):
        return apply_rope(qn(q), kn(k), base=theta)

    def fused(q, k):
        return qk_norm_rope(q, k, qn.weight, kn.weight, base=theta)

    variants = [("posenc qk_norm_rope", fused), ("eager RMSNorm+apply_rope", composed)]
    if not args.no_compile:
        variants.append(("compile(RMSNorm+rope)", torch.compile(composed, fullgraph=True)))

    def step(f):
        def run():
            for t in (q, k, qn.weight, kn.weight):
                t.grad = None
            oq, ok = f(q, k)
            torch.autograd.backward((oq, ok), (gq, gk))
        return run

    nbytes = 5 * (q.numel() + k.numel()) * q.element_size()
    base_ms = None
    for label, f in variants:
        ms = timeit(step(f), args.iters, sync) * 1e3
        base_ms = base_ms or ms
        print(f"{name:<9} {label:<22} {ms:8.2f} {nbytes / ms / 1e6:7.1f} {ms / base_ms:8.2f}x", flush=True)


def bench_inference(name, args, B, S, Hq, Hk, D, dev, sync):
    dtype = getattr(torch, name)
    q = torch.randn(B, S, Hq, D, device=dev, dtype=dtype)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dtype)
    qn, kn = RMSNorm(D).to(dev, dtype), RMSNorm(D).to(dev, dtype)
    wq, wk = qn.weight.detach(), kn.weight.detach()

    def copied():  # what inplace=True did before qk_norm_rope_: out of place, then copied
        oq, ok = qk_norm_rope(q, k, wq, wk)
        q.copy_(oq)
        k.copy_(ok)

    variants = [("posenc inplace=True", lambda: qk_norm_rope(q, k, wq, wk, inplace=True)),
                ("posenc out of place", lambda: qk_norm_rope(q, k, wq, wk)),
                ("out of place + copy_", copied),
                ("eager RMSNorm+apply_rope", lambda: apply_rope(qn(q), kn(k)))]
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    base_ms = None
    with torch.no_grad():
        for label, f in variants:
            ms = timeit(f, args.iters, sync) * 1e3
            base_ms = base_ms or ms
            print(f"{name:<9} {label:<24} {ms:8.2f} {nbytes / ms / 1e6:7.1f} {ms / base_ms:8.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shape", default="1,4096,32,8,128")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    B, S, Hq, Hk, D = (int(v) for v in args.shape.split(","))
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"posenc {posenc.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"RMSNorm: {RMSNorm.__module__}.{RMSNorm.__name__}")
    print(f"{'dtype':<9} {'variant':<22} {'ms':>8} {'GB/s':>7} {'vs posenc':>9}")
    for name in args.dtypes.split(","):
        bench_dtype(name, args, B, S, Hq, Hk, D, dev, sync)
    print(f"\ninference (no_grad, forward only)\n{'dtype':<9} {'variant':<24} {'ms':>8} {'GB/s':>7} {'vs inplace':>9}")
    for name in args.dtypes.split(","):
        bench_inference(name, args, B, S, Hq, Hk, D, dev, sync)
    return 0


if __name__ == "__main__":
    sys.exit(main())
