"""The cost of one small call (decode sizes, where per-call overhead dominates), CPU.

PositionalEncoding(512) on x (1, 1, 512) with offset=100, eval and train, against the eager
expression ``x + pe[:, 100:101]`` (and its dropout) and, in eval, the classic module it
replaces (buffer + nn.Dropout child); RotaryPositionalEncoding(128) on q
(1, 1, 32, 128), k (1, 1, 8, 128) with offset=100 against apply_rope, the raw op and Hugging
Face's rotate_half in eager, and the same with position_ids (1, 1) (the module's range check
reads their bounds with the op rope_position_bounds). Each variant: warm-up, then 2000 calls in 10 blocks of 200, the
blocks of all variants of a group interleaved; printed: the median over blocks of the mean
us per call. Grad mode on, inputs without requires_grad (an inference call as users write it).
The modules take one road (forward -> posenc.functional -> torch.ops.posenc), timed beside
the function and the raw op.

Usage: PYTHONPATH=python python benchmarks/bench_small_call.py [--calls 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import posenc


def time_us(fns: dict, calls: int, blocks: int = 10, setup: dict | None = None) -> dict:
    """Median over blocks of the mean microseconds per call, blocks interleaved. setup[name],
    when given, runs (untimed) before each of that variant's blocks and of its warm-up."""
    setup = setup or {}
    per_block = max(calls // blocks, 1)
    for name, fn in fns.items():
        setup.get(name, lambda: None)()
        for _ in range(200):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            setup.get(name, lambda: None)()
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            samples[name].append((time.perf_counter() - start) * 1e6 / per_block)
    return {name: statistics.median(v) for name, v in samples.items()}


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class ClassicPositionalEncoding(torch.nn.Module):
    """The classic module posenc replaces, with the decode step's offset: a buffer and an
    nn.Dropout child, forward ``dropout(x + pe[:, offset:offset + S])``."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(p=dropout)
        self.register_buffer("pe", posenc.functional.sinusoidal_table(torch.arange(max_len), d_model).unsqueeze(0))

    def forward(self, x, offset: int = 0):
        return self.dropout(x + self.pe[:, offset:offset + x.size(1)])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command:", " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"torch threads: {torch.get_num_threads()}")

    x = torch.randn(1, 1, 512)
    pe_mod = posenc.PositionalEncoding(512, 0.1)
    pe = pe_mod.pe
    add_position = torch.ops.posenc.add_position.default
    results = []
    pe_mod.eval()
    classic = ClassicPositionalEncoding(512, 0.1).eval()
    eval_fns = {
        "PositionalEncoding eval": lambda: pe_mod(x, offset=100),
        "functional.add_position": lambda: posenc.functional.add_position(x, pe, offset=100, training=False),
        "classic module (what it replaces)": lambda: classic(x, 100),
        "eager x + pe[:, 100:101]": lambda: x + pe[:, 100:101],
        "x.clone()": lambda: x.clone(),
        "raw op add_position": lambda: add_position(x, pe, None, 100, True, 0.0),
    }
    t = time_us(eval_fns, args.calls)
    results.append(("add-position eval, (1, 1, 512), offset=100", t))
    ratio = t["PositionalEncoding eval"] / t["eager x + pe[:, 100:101]"]
    t["module / eager expression (ratio)"] = ratio
    pe_mod.train()
    t = time_us({
        "PositionalEncoding train": lambda: pe_mod(x, offset=100),
        "eager dropout(x + pe[:, 100:101])": lambda: F.dropout(x + pe[:, 100:101], 0.1, True),
        "raw op add_position": lambda: add_position(x, pe, None, 100, True, 0.1),
    }, args.calls)
    results.append(("add-position train, p=0.1", t))

    q, k = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128)
    rope = posenc.RotaryPositionalEncoding(128)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv
    cos_table, sin_table = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    position_ids = torch.tensor([[100]])
    rope_op = torch.ops.posenc.rope.default

    def hf():
        cos, sin = cos_table[position_ids].unsqueeze(2), sin_table[position_ids].unsqueeze(2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    rope_fns = {
        "RotaryPositionalEncoding": lambda: rope(q, k, offset=100),
        "functional.apply_rope": lambda: posenc.functional.apply_rope(q, k, offset=100),
        "raw op rope": lambda: rope_op(q, k, offset=100),
        "eager HF rotate_half": hf,
    }
    t = time_us(rope_fns, args.calls)
    t["module - raw op (us)"] = t["RotaryPositionalEncoding"] - t["raw op rope"]
    results.append(("RoPE q (1, 1, 32, 128), k (1, 1, 8, 128), offset=100", t))

    # Hugging Face's position_ids (a (1, 1) tensor): the module also reads the positions' bounds
    # for its max_len check (the op rope_position_bounds, timed alone), where an int offset is
    # checked on the host.
    bounds_op = torch.ops.posenc.rope_position_bounds.default
    t = time_us({
        "RotaryPositionalEncoding": lambda: rope(q, k, positions=position_ids),
        "functional.apply_rope": lambda: posenc.functional.apply_rope(q, k, positions=position_ids),
        "raw op rope": lambda: rope_op(q, k, positions=position_ids),
        "raw op rope_position_bounds": lambda: bounds_op(q, positions=position_ids),
        "eager HF rotate_half": hf,
    }, args.calls)
    t["module - raw op (us)"] = t["RotaryPositionalEncoding"] - t["raw op rope"]
    results.append(("RoPE q (1, 1, 32, 128), k (1, 1, 8, 128), positions (1, 1)", t))

    for title, times in results:
        print(f"\n{title}")
        for name, us in times.items():
            print(f"  {name:44} {us:7.2f}" + ("" if "ratio" in name or "(us)" in name else " us"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
