"""Benchmark of apply_rope_cos_sin (q and k rotated with given cos/sin tables, one fused op)
against transformers' apply_rotary_pos_emb formula (``q * cos + rotate_half(q) * sin``, eager)
and torch.compile of it, forward and forward + backward, in the same run. GB/s counts q and
k read and written once (the bytes one pass must move; the tables are seq * head_dim).

Usage: python benchmarks/bench_rope_cos_sin.py [--device cpu|cuda] [--dtype float32]
       [--shape B,H,S,D] [--kv-heads N] [--reps N] [--no-compile]
"""

import argparse
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from harness import grad_step, time_interleaved  # noqa: E402
from posenc.functional import apply_rope_cos_sin, rope_cos_sin  # noqa: E402


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # transformers' unsqueeze_dim=1 ("bhsd")
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="2,16,2048,128", help="B,H,S,D of q")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    B, H, S, D = map(int, args.shape.split(","))
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, device=device, dtype=dtype)
    k = torch.randn(B, args.kv_heads, S, D, device=device, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(S, device=device).expand(B, S), D, dtype=dtype)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()

    def ours(a, b):
        return apply_rope_cos_sin(a, b, cos, sin)

    def eager(a, b):
        return hf_apply(a, b, cos, sin)

    fns = {"posenc": ours, "eager": eager}
    if not args.no_compile:
        fns["compile"] = torch.compile(eager)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    with torch.no_grad():
        fwd = time_interleaved({n: (lambda f=f: f(q, k)) for n, f in fns.items()}, device, args.reps)
    both = time_interleaved({n: grad_step(f, (qg, kg), (gq, gk)) for n, f in fns.items()}, device, args.reps)
    print(f"apply_rope_cos_sin, {device} {args.dtype}, q {tuple(q.shape)}, k {tuple(k.shape)} (bhsd), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':16} {'posenc ms':>10} {'GB/s':>7} {'eager ms':>9} {'compile ms':>10} {'eager/ours':>10} "
          f"{'comp/ours':>9}")
    for case, t in (("forward", fwd), ("forward+backward", both)):
        comp = t.get("compile")
        gbs = nbytes * (1 if case == "forward" else 2) / (t["posenc"] * 1e-3) / 1e9
        print(f"{case:16} {t['posenc']:10.3f} {gbs:7.1f} {t['eager']:9.3f} "
              f"{comp if comp is not None else float('nan'):10.3f} {t['eager'] / t['posenc']:10.2f} "
              f"{(comp / t['posenc']) if comp is not None else float('nan'):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
