"""The distribution of posenc's CPU speedups over plain PyTorch under each output-memory
configuration (POSENC_CPU_OUTPUTS: reuse = the default, fresh, huge = the former default).

The configuration is read once per process, so each run of each configuration is its own
subprocess, and the runs alternate (run 1 of every configuration, then run 2, ...) so that
slow drifts of the host hit them all. Each subprocess times, interleaved in one process, the
issue's cases on the existing harnesses: add-position (sinusoidal, learned; (32, 512, 512)
float32, p = 0.1) eval forward, train forward and train backward against
``F.dropout(x + pe[:, :S])`` (harness.bench_shape), and RoPE forward and backward of q and k
((4, 1024, 16, 4, 128) float32) against Hugging Face's rotate_half (rope_harness.bench).
Printed: min / median / max over the runs of eager ms / posenc ms (above 1: posenc faster).

Usage: PYTHONPATH=python python benchmarks/bench_cpu_outputs.py [--runs 5] [--reps 15]
       [--configs reuse,fresh,huge] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What each configuration puts in the environment (the rest of it is stripped of these).
CONFIGS = {
    "reuse": {},  # the default: nothing set
    "fresh": {"POSENC_CPU_OUTPUTS": "fresh"},
    "huge": {"POSENC_CPU_OUTPUTS": "huge"},
}
PAGE_VARIABLES = ("POSENC_CPU_OUTPUTS", "POSENC_NO_HUGE_PAGES", "THP_MEM_ALLOC_ENABLE")


def measure(reps: int, quick: bool) -> dict:
    """{case: eager ms / posenc ms} for every case, in this process."""
    sys.path.insert(0, str(HERE))
    import torch

    from harness import bench_shape
    from rope_harness import bench as bench_rope

    torch.set_num_threads(min(2, torch.get_num_threads()))
    ratios = {}
    shape = (8, 256, 512) if quick else (32, 512, 512)
    for kind in ("sinusoidal", "learned"):
        for row in bench_shape("cpu", torch.float32, shape, reps=reps, with_compile=False, kind=kind):
            ratios[f"{kind} {row.case}"] = row.ref_ms / row.ours_ms
    rope_shape = (2, 256, 16, 4, 128) if quick else (4, 1024, 16, 4, 128)
    for row in bench_rope("cpu", torch.float32, rope_shape, reps, False):
        ratios[f"rope {row['case']}"] = row["eager_ms"] / row["posenc_ms"]
    return ratios


def thp_settings() -> str:
    parts = []
    for name in ("enabled", "defrag"):
        try:
            parts.append(f"{name}: {Path('/sys/kernel/mm/transparent_hugepage', name).read_text().strip()}")
        except OSError:
            parts.append(f"{name}: unknown")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reps", type=int, default=15, help="interleaved calls per case in each run")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test, not a measurement)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.reps, args.quick)))
        return 0

    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; expected some of {', '.join(CONFIGS)}")
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    print("kernel THP settings:", thp_settings())
    base_env = {k: v for k, v in os.environ.items() if k not in PAGE_VARIABLES}
    results = {c: [] for c in configs}
    for run in range(args.runs):
        for config in configs:
            worker = [sys.executable, __file__, "--worker", "--reps", str(args.reps)]
            worker += ["--quick"] if args.quick else []
            start = time.perf_counter()
            proc = subprocess.run(worker, env=dict(base_env, **CONFIGS[config]), capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return proc.returncode
            ratios = json.loads(proc.stdout.strip().splitlines()[-1])
            results[config].append(ratios)
            print(f"run {run + 1} {config:6} ({time.perf_counter() - start:4.0f} s): "
                  + " ".join(f"{case}={r:.2f}" for case, r in ratios.items()), flush=True)

    cases = list(results[configs[0]][0])
    print(f"\neager ms / posenc ms (above 1: posenc faster), min / median / max over {args.runs} runs")
    header = f"| case | {' | '.join(configs)} |"
    print(header)
    print("|---" * (len(configs) + 1) + "|")
    for case in cases:
        cells = []
        for config in configs:
            values = [r[case] for r in results[config]]
            cells.append(f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}")
        print(f"| {case} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
