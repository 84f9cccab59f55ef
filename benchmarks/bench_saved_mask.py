"""The CPU's two ways of giving add_position's backward its dropout mask, side by side: the
(seed, offset) key, from which the backward regenerates the mask with Philox (what CUDA
does), and the saved keep mask, 1 bit per element, which the backward reads (what CPU
autograd does; add_position_forward with save_mask=True). Times the kernel ops alone,
interleaved in one process, on (32, 512, 512) by default.

Usage: THP_MEM_ALLOC_ENABLE=1 PYTHONPATH=python \\
    python benchmarks/bench_saved_mask.py [--shape B,S,D] [--dtype float32] [--reps 20]
"""

import argparse
import sys

import torch

import posenc  # noqa: F401  (loads the ops)
from harness import page_policy, time_interleaved


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="32,512,512")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    ops = torch.ops.posenc
    p = args.p

    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    table = torch.randn(shape[1], shape[2], dtype=dtype)
    grad = torch.randn(shape, dtype=dtype)
    _, key = ops.add_position_forward(x, table, None, 0, True, p)
    _, mask = ops.add_position_forward(x, table, None, 0, True, p, True)

    fns = {
        "forward, key": lambda: ops.add_position_forward(x, table, None, 0, True, p),
        "forward, saves mask": lambda: ops.add_position_forward(x, table, None, 0, True, p, True),
        "grad_x, key": lambda: ops.add_position_backward(grad, key, p),
        "grad_x, mask": lambda: ops.add_position_backward(grad, mask, p),
        "grad_x + table, key": lambda: ops.add_position_backward_with_table(
            grad, key, None, 0, True, p, shape[1], True),
        "grad_x + table, mask": lambda: ops.add_position_backward_with_table(
            grad, mask, None, 0, True, p, shape[1], True),
        "x.clone()": lambda: x.clone(),
    }
    times = time_interleaved(fns, "cpu", reps=args.reps)
    print(page_policy())
    print(f"{tuple(shape)} {args.dtype}, p={p}, {torch.get_num_threads()} threads, "
          f"mask {mask.numel() / 2**20:.2f} MiB vs x {x.nbytes / 2**20:.0f} MiB; median ms of {args.reps}:")
    for name, ms in times.items():
        print(f"  {name:22s} {ms:8.3f}")
    for what in ("forward", "grad_x", "grad_x + table"):
        a = times[f"{what}, key"]
        b = times[f"{what}, saves mask" if what == "forward" else f"{what}, mask"]
        print(f"  {what}: key / mask = {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
