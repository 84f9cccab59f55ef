"""Benchmark of posenc's fused RoPE against Hugging Face's rotate_half formulation (eager and
torch.compile) and, where installed, Liger-Kernel; see rope_harness.py.

CPU (default): (4, 1024, 16 q heads, 4 k heads, 128) float32, the issue's reference point.
GPU: (8, 4096, 32, 8, 128) bfloat16 and float32 against measured copy bandwidth.
Usage: python benchmarks/bench_rope.py [--device cpu|cuda|all] [--quick] [--no-compile] [--json F]
                                      [--cpu-dtypes float32,bfloat16,float16]
"""

import argparse
import json
import sys

import torch

from harness import copy_bandwidth
from rope_harness import bench, format_rows, liger_or_none


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--cpu-dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16,float16")
    args = parser.parse_args()
    rows = []

    def add(new_rows):
        # Each configuration's rows as soon as they are measured (a time limit still leaves them).
        print(format_rows(new_rows) + "\n", flush=True)
        rows.extend(new_rows)

    if args.device in ("cpu", "all"):
        shape = (2, 256, 16, 4, 128) if args.quick else (4, 1024, 16, 4, 128)
        for name in args.cpu_dtypes.split(","):
            add(bench("cpu", getattr(torch, name), shape, 5 if args.quick else 20, not args.no_compile))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}; device-to-device copy: "
              f"{copy_bandwidth('cuda'):.0f} GB/s (read + write)", flush=True)
        print("liger-kernel:", "present" if liger_or_none() else "not installed (no comparison)", flush=True)
        for dtype in (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32):
            add(bench("cuda", dtype, (8, 4096, 32, 8, 128), 20, not args.no_compile))
            torch.cuda.empty_cache()
    print("All rows:")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
