"""Benchmark of posenc's fused add + dropout against plain PyTorch and torch.compile.

CPU: (32, 512, 512) float32, the issue's reference point. GPU (when present): tensors of
1 GiB and more in bfloat16 and float32, plus the device-to-device copy bandwidth they are
measured against. Usage: python benchmarks/bench_add_position.py [--quick] [--no-compile]
[--device cpu|cuda|all] [--cpu-dtypes float32,bfloat16,float16] [--json F]
"""

import argparse
import json
import sys

import torch

from harness import bench_shape, copy_bandwidth, format_table, page_policy


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--cpu-dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16,float16")
    args = parser.parse_args()

    rows = []

    def add(new_rows):
        # Each shape's rows as soon as they are measured (a time limit still leaves them).
        print(format_table(new_rows) + "\n", flush=True)
        rows.extend(new_rows)

    if args.device in ("cpu", "all"):
        print(page_policy(), flush=True)
        shape = (8, 256, 512) if args.quick else (32, 512, 512)
        for name in args.cpu_dtypes.split(","):
            for kind in ("sinusoidal", "learned"):
                add(bench_shape("cpu", getattr(torch, name), shape, reps=5 if args.quick else 20,
                                with_compile=not args.no_compile, kind=kind))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
        copy = copy_bandwidth("cuda")
        print(f"device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
        shapes = {torch.bfloat16: [(64, 4096, 2048), (16, 8192, 4096)],
                  torch.float32: [(32, 4096, 2048), (8, 8192, 4096)]}
        for dtype, dtype_shapes in shapes.items():
            for shape in dtype_shapes[:1] if args.quick else dtype_shapes:
                for kind in ("sinusoidal", "learned"):
                    add(bench_shape("cuda", dtype, shape, reps=20,
                                    with_compile=not args.no_compile, kind=kind, copy_gbps=copy))
                torch.cuda.empty_cache()
    print("All rows:")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ | {"gbps": r.gbps} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
