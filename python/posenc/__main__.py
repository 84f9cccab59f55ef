"""`python -m posenc demo`: why position matters, a benchmark, and a heatmap of the encoding.

`python -m posenc bench` runs only the benchmark (the full sizes are in benchmarks/). The
benchmark harness is not part of the installed package: the demo times with the one in the
source checkout's benchmarks/ folder (harness.py, rope_harness.py) and, without a checkout,
says where to find it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import posenc

SENTENCES = (["dog", "bites", "man"], ["man", "bites", "dog"])


def self_attention(x: torch.Tensor, wq, wk, wv) -> torch.Tensor:
    """One head of self-attention with fixed weights: softmax(QK^T / sqrt(d)) V."""
    q, k, v = x @ wq, x @ wk, x @ wv
    weights = torch.softmax(q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1)
    return weights @ v


def why_position_matters(d: int = 16) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = {w: i for i, w in enumerate(sorted({w for s in SENTENCES for w in s}))}
    embed = torch.randn(len(vocab), d, generator=gen)
    wq, wk, wv = (torch.randn(d, d, generator=gen) / d**0.5 for _ in range(3))
    pe = posenc.PositionalEncoding(d, dropout=0.0, max_len=16).eval()

    def run(words, with_pe):
        x = embed[torch.tensor([vocab[w] for w in words])].unsqueeze(0)
        if with_pe:
            x = pe(x)
        return self_attention(x, wq, wk, wv)[0]

    print("Why position matters: one self-attention layer, fixed random weights.")
    print("Each row: a token's output vector (first 4 of", d, "values).\n")
    for with_pe in (False, True):
        a, b = run(SENTENCES[0], with_pe), run(SENTENCES[1], with_pe)
        title = "with posenc.PositionalEncoding" if with_pe else "without a positional encoding"
        print(f"--- {title} ---")
        print(f"{'dog bites man':>40}   |   {'man bites dog':<40}")
        for i in range(3):
            left = " ".join(f"{v:+.3f}" for v in a[i, :4].tolist())
            right = " ".join(f"{v:+.3f}" for v in b[i, :4].tolist())
            print(f"{SENTENCES[0][i]:>6} {left}   |   {SENTENCES[1][i]:>6} {right}")
        # "dog" is token 0 in one sentence and token 2 in the other: compare their outputs.
        same = torch.allclose(a[0], b[2], atol=1e-6) and torch.allclose(a[2], b[0], atol=1e-6)
        verdict = ("the same rows, permuted: the layer cannot tell who bites whom" if same
                   else "different: 'dog' as subject and 'dog' as object are now distinguished")
        print(f"outputs for 'dog' and 'man' across the two sentences: {verdict}\n")


def rope_depends_on_relative_position(d: int = 64) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, d, generator=gen, dtype=torch.float64)

    def score(m, n):
        rq = posenc.functional.apply_rope(q, positions=torch.tensor([m]))
        rk = posenc.functional.apply_rope(k, positions=torch.tensor([n]))
        return float((rq * rk).sum())

    print("Rotary embedding (RoPE): the attention score of a query at position m and a key at")
    print("position n depends only on m - n, however far along the sequence they are:")
    for m, n in ((5, 2), (1005, 1002), (1_000_005, 1_000_002), (5, 4)):
        print(f"  m={m:>9,}  n={n:>9,}  m-n={m - n}  score {score(m, n):+.9f}")
    print()


BENCHMARKS_DIR = Path(__file__).resolve().parent.parent.parent / "benchmarks"


def _harness():
    """benchmarks/harness.py of the source checkout, or None (installed package)."""
    if not (BENCHMARKS_DIR / "harness.py").is_file():
        return None
    if str(BENCHMARKS_DIR) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS_DIR))
    import harness

    return harness


def benchmark(quick: bool) -> None:
    if _harness() is None:
        print("Benchmark: skipped; its harness is in the benchmarks/ folder of posenc's source "
              "checkout (make bench), not in the installed package.\n")
        return
    from harness import bench_shape, format_table, page_policy
    from rope_harness import bench as bench_rope, format_rows as format_rope_rows

    print(page_policy())
    print("Benchmark: fused x + pe + dropout (posenc) vs plain PyTorch and torch.compile")
    rows = bench_shape("cpu", torch.float32, (8, 256, 512) if quick else (32, 512, 512),
                       reps=5 if quick else 15)
    if torch.cuda.is_available():
        rows += bench_shape("cuda", torch.bfloat16, (16, 2048, 2048), reps=20)
        rows += bench_shape("cuda", torch.float32, (16, 2048, 2048), reps=20)
    print(format_table(rows))
    print()
    print("Benchmark: RoPE of q and k, fused (posenc) vs Hugging Face's rotate_half and torch.compile")
    rope_rows = bench_rope("cpu", torch.float32, (2, 256, 16, 4, 128) if quick else (4, 1024, 16, 4, 128),
                           5 if quick else 15, True)
    if torch.cuda.is_available():
        rope_rows += bench_rope("cuda", torch.bfloat16, (8, 4096, 32, 8, 128), 20, True)
    print(format_rope_rows(rope_rows))
    print()


def heatmap(path: str, positions: int = 100, d: int = 128) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = posenc.functional.sinusoidal_table(torch.arange(positions), d)
    fig, ax = plt.subplots(figsize=(9, 5))
    image = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax.set_xlabel("embedding dimension (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"Sinusoidal positional encoding, first {positions} positions, d_model={d}")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)


def main(argv=None) -> int:
    """The benchmark runs under the process's own allocator (torch's, for posenc's outputs
    as for every variant's), and prints it before its tables."""
    parser = argparse.ArgumentParser(prog="python -m posenc")
    parser.add_argument("command", choices=["demo", "bench"], nargs="?", default="demo")
    parser.add_argument("--quick", action="store_true", help="smaller benchmark")
    parser.add_argument("--out", default="out", help="folder for the heatmap PNG")
    args = parser.parse_args(argv)
    if args.command == "bench":
        benchmark(args.quick)
        return 0
    why_position_matters()
    rope_depends_on_relative_position()
    benchmark(args.quick)
    os.makedirs(args.out, exist_ok=True)
    print("Heatmap of the encoding written to", heatmap(os.path.join(args.out, "posenc_heatmap.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
