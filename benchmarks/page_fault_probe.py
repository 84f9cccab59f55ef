"""Per-call CPU timings of posenc's eval forward against `x + pe` and `x.clone()`, in
alternation, printed call by call: shows how fresh-output page faults, not arithmetic, set
CPU timings of a (32, 512, 512) float32 op (see benchmarks/NOTES.md).
Usage: PYTHONPATH=python python benchmarks/page_fault_probe.py [--calls 30]
"""

import argparse
import time

import torch

import posenc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    x = torch.randn(32, 512, 512)
    pe = posenc.PositionalEncoding(512, 0.0, 5000).eval()
    fns = {"posenc": lambda: pe(x), "x + pe": lambda: x + pe.pe[:, :512], "clone": lambda: x.clone()}
    samples = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(args.calls):
            for name, fn in fns.items():
                start = time.perf_counter()
                out = fn()
                samples[name].append((time.perf_counter() - start) * 1e3)
                del out
    for name, ms in samples.items():
        ordered = sorted(ms)
        print(f"{name:7} ms per call: {' '.join(f'{m:.0f}' for m in ms)}")
        print(f"{'':7} min {ordered[0]:.1f}  median {ordered[len(ordered) // 2]:.1f}  max {ordered[-1]:.1f}")


if __name__ == "__main__":
    main()
