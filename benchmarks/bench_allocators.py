"""posenc and its eager expression under each CPU allocator a user can pick, in one run.

posenc's CPU outputs come from torch's allocator, as every ATen op's do, so the allocator a
process runs (glibc's malloc, or tcmalloc / jemalloc through LD_PRELOAD) changes posenc and
plain PyTorch alike: under glibc a fresh output of 32 MiB or more is a fresh mmap whose
thousands of page faults take longer than the kernel. Each allocator runs in a child process
of its own (LD_PRELOAD is read at process start); inside it, posenc's op, the eager
expression and clone() of the op's output bytes (the memory floor) are timed interleaved.
Printed per case: ms per allocator, and posenc / floor and eager / posenc per allocator.

Debian: apt-get install libtcmalloc-minimal4 libjemalloc2 (an allocator not found is
reported and skipped).

Usage: PYTHONPATH=python python benchmarks/bench_allocators.py [--reps 15]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ALLOCATORS = {
    "glibc": None,
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
}


def child(reps: int) -> dict:
    """The timings of this process (ms), keyed by case then variant."""
    import torch

    import posenc
    from harness import time_interleaved

    F = posenc.functional
    torch.manual_seed(0)
    out = {}
    with torch.no_grad():
        x = torch.randn(32, 512, 512)
        pe = posenc.PositionalEncoding(512, 0.1, 512).eval()
        table = pe.pe
        out["sinusoidal eval forward (32, 512, 512)"] = time_interleaved({
            "posenc": lambda: pe(x),
            "eager": lambda: x + table[:, :512],
            "floor": lambda: x.clone(),
        }, "cpu", reps)
        q, k = torch.randn(4, 1024, 16, 128), torch.randn(4, 1024, 4, 128)
        inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
        ang = torch.arange(1024, dtype=torch.float32)[:, None] * inv
        cos = torch.cat((ang, ang), -1).cos()[None, :, None]
        sin = torch.cat((ang, ang), -1).sin()[None, :, None]

        def rotate_half(t):
            return torch.cat((-t[..., 64:], t[..., :64]), -1)

        out["RoPE forward (4, 1024, 16|4, 128)"] = time_interleaved({
            "posenc": lambda: F.apply_rope(q, k),
            "eager": lambda: (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin),
            "floor": lambda: (q.clone(), k.clone()),
        }, "cpu", reps)
    learned = posenc.LearnedPositionalEncoding(512, 0.0, 512)
    xg = torch.randn(32, 512, 512, requires_grad=True)
    g = torch.randn(32, 512, 512)

    def posenc_backward():
        torch.autograd.grad(learned(xg), (xg, learned.pe), g)

    def eager_backward():
        torch.autograd.grad(xg + learned.pe[:, :512], (xg, learned.pe), g)

    out["learned backward (32, 512, 512)"] = time_interleaved({
        "posenc": posenc_backward,
        "eager": eager_backward,
        "floor": lambda: (g.clone(), learned.pe.detach().clone()),
    }, "cpu", reps)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.reps)))
        return 0
    results = {}
    for name, lib in ALLOCATORS.items():
        if lib is not None and not Path(lib).is_file():
            print(f"{name}: {lib} not found, skipped")
            continue
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        if lib is not None:
            env["LD_PRELOAD"] = lib
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-2000:]}")
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    import torch

    print(f"CPU, {torch.get_num_threads()} threads, median of {args.reps} interleaved rounds; ms")
    for case in next(iter(results.values())):
        print(f"\n{case}")
        print(f"  {'allocator':10} {'posenc':>8} {'eager':>8} {'floor':>8} {'floor/posenc':>13} {'eager/posenc':>13}")
        for name, r in results.items():
            t = r[case]
            print(f"  {name:10} {t['posenc']:8.2f} {t['eager']:8.2f} {t['floor']:8.2f} "
                  f"{t['floor'] / t['posenc']:13.2f} {t['eager'] / t['posenc']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
