"""Two builds of posenc side by side: timings (A/B) and bits.

A change to a CPU kernel is judged against the build before it: copy each build's Python
package tree (``cp -r python /tmp/old_py`` before the change, ``/tmp/new_py`` after), then

    python benchmarks/ab_builds.py time /tmp/old_py /tmp/new_py mla:float32 --rounds 6 --threads 1 [--cold]
    python benchmarks/ab_builds.py bits /tmp/old_py /tmp/new_py

``time`` runs one case in fresh processes, alternating the builds, and prints the minimum (and
median) of each: the host's noise moves single runs by 10-30%. ``--cold`` evicts the caches
before each call (a call whose data fits the last-level cache otherwise times a warm re-run:
this AMD host's L3 holds 32 MiB). ``bits`` computes the same
~1070 outputs under each build (every dtype; apply_rope in/out of place, backward, bhsd,
partial rotary, interleaved; apply_rope_cos_sin; qk_norm_rope and its backward;
rope_append_kv incl. QK-norm and MLA; rope_shift_kv; NaN and inf inputs) and counts those
that differ in any bit (NaN payloads aside).
"""

import argparse
import os
import subprocess
import sys
import tempfile

CASES = {
    "mla": "q (1, 2048, 16, 192): q_pe in place, latent cache [kv_c 512 | k_pe 64]",
    "rope_bshd_out": "apply_rope q (4, 1024, 16, 128), k (4, 1024, 4, 128)",
    "rope_bshd_inplace": "the same in place", "rope_bhsd_out": "bhsd", "rope_bshd_out_il": "interleaved",
    "cossin_fwd": "apply_rope_cos_sin bhsd", "cossin_bwd": "its backward", "qknorm": "qk_norm_rope forward",
    "qknorm_bwd": "its backward",
    "append": "rope_append_kv prefill (1, 2048, 32, 8, 128)", "append_fp8": "the same, FP8 e4m3 caches",
    "append_qknorm": "the same, QK-norm (float32 weights)",
    "shift": "rope_shift_kv of 2048 rows", "shift_mla": "the same of MLA's k_pe in a latent cache",
    "decode": "20 rope_append_kv decode steps (8, 1, 32, 8, 128), cache 2048", "decode_bhsd": "the same, bhsd",
    "learned_bwd": "LearnedPositionalEncoding(512, 0.1) backward of x (32, 512, 512), training",
    "learned_bwd_5000": "the same, max_len 5000 (the default), the module in x's dtype (.to(dtype))",
    "learned_bwd_pos": "the same with (32, 512) positions 2 .. 513 (RoBERTa's, padding_idx 1)",
    "learned_bwd_pad": "the same, rows right-padded to 512 from 256-512 tokens (padding at 1)",
    "table": "sinusoidal_table(arange(16384), 512)",
    "table_2d": "sinusoidal_2d_table(64, 64, 512)",
    "pe_bwd": "PositionalEncoding(512, 0.1) backward of x (32, 512, 512), training (saved mask)",
    "pe_train": "PositionalEncoding(512, 0.1) forward of x (32, 512, 512), training, no_grad",
    "pe_eval": "the same in eval mode (x + pe: no dropout)",
    "learned_train": "the same, LearnedPositionalEncoding",
}

CHILD_TIME = r'''
import sys, time, torch, posenc.functional as F
torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(0)
name, dt = sys.argv[1].split(":")
dt = getattr(torch, dt)
cold = sys.argv[3] == "1"
evict = torch.empty(64 << 20, dtype=torch.uint8) if cold else None
def mn(fn, n=25):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        if cold: evict.clone()  # the caches flushed of the call's data, as bench_table's floor clone does
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts) * 1e3
with torch.no_grad():
    if name == "mla":
        q = torch.randn(1, 2048, 16, 192, dtype=dt); kv_c = torch.randn(1, 2048, 1, 512, dtype=dt)
        k_pe = torch.randn(1, 2048, 1, 64, dtype=dt); latent = torch.zeros(1, 4096, 1, 576, dtype=dt)
        lengths = torch.tensor([1000])
        fn = lambda: F.rope_append_kv(q[..., 128:], k_pe, kv_c, latent[..., 512:], latent[..., :512],
                                      offset=lengths, interleaved=True, inplace=True)
    elif name.startswith("rope"):
        parts = name.split("_"); layout, mode, il = parts[1], parts[2], len(parts) > 3
        shape = (lambda h: (4, 1024, h, 128)) if layout == "bshd" else (lambda h: (4, h, 1024, 128))
        q, k = torch.randn(shape(16), dtype=dt), torch.randn(shape(4), dtype=dt)
        fn = lambda: F.apply_rope(q, k, layout=layout, inplace=mode == "inplace", interleaved=il)
    elif name.startswith("cossin"):
        q = torch.randn(4, 16, 1024, 128, dtype=dt); k = torch.randn(4, 4, 1024, 128, dtype=dt)
        cos, sin = F.rope_cos_sin(torch.arange(1024), 128, dtype=dt)
        if name.endswith("bwd"):
            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            def fn():
                with torch.enable_grad():
                    torch.autograd.grad(F.apply_rope_cos_sin(qg, kg, cos, sin), (qg, kg), (q, k))
        else:
            fn = lambda: F.apply_rope_cos_sin(q, k, cos, sin)
    elif name in ("qknorm", "qknorm_bwd"):
        q = torch.randn(4, 1024, 16, 128, dtype=dt); k = torch.randn(4, 1024, 4, 128, dtype=dt)
        wq, wk = torch.rand(128) + 0.5, torch.rand(128) + 0.5
        fn = lambda: F.qk_norm_rope(q, k, wq, wk)
        if name == "qknorm_bwd":
            ins = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
            with torch.enable_grad():
                outs = F.qk_norm_rope(*ins)
            fn = lambda: torch.autograd.grad(outs, ins, (q, k), retain_graph=True)
    elif name in ("append", "append_fp8", "append_qknorm"):
        q = torch.randn(1, 2048, 32, 128, dtype=dt); k, v = (torch.randn(1, 2048, 8, 128, dtype=dt) for _ in "kv")
        fp8 = name == "append_fp8"
        kc, vc = (torch.zeros(1, 4096, 8, 128, dtype=torch.float8_e4m3fn if fp8 else dt) for _ in "kv")
        scales = dict(k_scale=0.05, v_scale=0.02) if fp8 else {}
        if name == "append_qknorm":
            scales = dict(q_weight=torch.rand(128) + 0.5, k_weight=torch.rand(128) + 0.5)
        fn = lambda: F.rope_append_kv(q, k, v, kc, vc, offset=torch.tensor([1000]), **scales)
    elif name.startswith("decode"):
        layout = "bhsd" if name.endswith("bhsd") else "bshd"
        shape = (lambda h, s: (8, s, h, 128)) if layout == "bshd" else (lambda h, s: (8, h, s, 128))
        q = torch.randn(shape(32, 1), dtype=dt); k, v = (torch.randn(shape(8, 1), dtype=dt) for _ in "kv")
        kc, vc = (torch.zeros(shape(8, 2048), dtype=dt) for _ in "kv")
        lengths, config = torch.randint(0, 2047, (8,)), {} if layout == "bshd" else dict(layout=layout)
        def fn():
            for _ in range(20):
                F.rope_append_kv(q, k, v, kc, vc, offset=lengths, **config)
    elif name == "shift":
        kc = torch.randn(1, 4096, 8, 128, dtype=dt); rows = torch.arange(2048, 4096)
        fn = lambda: F.rope_shift_kv(kc, rows, rows - 1024, rows=rows)
    elif name in ("learned_bwd", "learned_bwd_5000", "learned_bwd_pos", "learned_bwd_pad"):
        import posenc
        module = posenc.LearnedPositionalEncoding(512, 0.1, max_len=512)
        if name != "learned_bwd":
            module = posenc.LearnedPositionalEncoding(512, 0.1).to(dt)
        pos = torch.arange(2, 514).expand(32, 512) if name == "learned_bwd_pos" else None
        if name == "learned_bwd_pad":
            lengths = torch.randint(256, 513, (32, 1), generator=torch.Generator().manual_seed(0))
            pos = torch.where(torch.arange(512) < lengths, torch.arange(2, 514), 1)
        xg = torch.randn(32, 512, 512, dtype=dt, requires_grad=True); g = torch.randn(32, 512, 512, dtype=dt)
        with torch.enable_grad():
            out = module(xg, positions=pos)
        fn = lambda: torch.autograd.grad(out, (xg, module.pe), g, retain_graph=True)
    elif name == "table":
        positions = torch.arange(16384)
        fn = lambda: F.sinusoidal_table(positions, 512, dtype=dt)
    elif name == "table_2d":
        fn = lambda: F.sinusoidal_2d_table(64, 64, 512, dtype=dt)
    elif name == "pe_bwd":
        import posenc
        module = posenc.PositionalEncoding(512, 0.1, max_len=512, batch_first=True).to(dt)
        xg = torch.randn(32, 512, 512, dtype=dt, requires_grad=True); g = torch.randn(32, 512, 512, dtype=dt)
        with torch.enable_grad():
            out = module(xg)
        fn = lambda: torch.autograd.grad(out, xg, g, retain_graph=True)
    elif name in ("pe_train", "learned_train", "pe_eval"):
        import posenc
        cls = posenc.LearnedPositionalEncoding if name == "learned_train" else posenc.PositionalEncoding
        module = cls(512, 0.1, max_len=512, batch_first=True)
        if name == "pe_eval":
            module.eval()
        x = torch.randn(32, 512, 512, dtype=dt)
        fn = lambda: module(x)
    elif name == "shift_mla":
        latent = torch.randn(1, 4096, 1, 576, dtype=dt); rows = torch.arange(2048, 4096)
        fn = lambda: F.rope_shift_kv(latent[..., 512:], rows, rows - 1024, rows=rows)
    print(mn(fn))
'''

CHILD_BITS = r'''
import sys, torch, posenc.functional as F
torch.manual_seed(0)
outs = []
def add(t):
    if isinstance(t, (tuple, list)):
        for x in t: add(x)
    elif t is not None: outs.append(t.detach().clone())
shapes = [(2, 37, 4, 2, 64, None), (1, 5, 3, 1, 128, 64), (3, 17, 2, 2, 48, None), (1, 9, 2, 1, 192, 64),
          (2, 33, 4, 4, 32, 16), (1, 8, 1, 1, 6, None), (1, 4, 2, 2, 10, None), (3, 300, 4, 2, 64, None)]
for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    for (B, S, H, Hk, D, rd) in shapes:
        for il in (True, False):
            q = torch.randn(B, S, H, D, dtype=dt); k = torch.randn(B, S, Hk, D, dtype=dt)
            q[0, 0, 0, 0] = float("nan"); q[0, -1, 0, 1] = float("inf")
            kw = dict(interleaved=il, rotary_dim=rd)
            with torch.no_grad():
                add(F.apply_rope(q, k, **kw))
                q2, k2 = q.clone(), k.clone(); F.apply_rope(q2, k2, inplace=True, **kw); add((q2, k2))
                add(F.apply_rope(q, k, inverse=True, **kw))
                add(F.apply_rope(q.transpose(1, 2), k.transpose(1, 2), layout="bhsd", **kw))
            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            o = F.apply_rope(qg, kg, **kw)
            add(torch.autograd.grad(o, (qg, kg), (torch.randn_like(o[0]), torch.randn_like(o[1]))))
            kc, vc = torch.zeros(B, S + 5, Hk, D, dtype=dt), torch.zeros(B, S + 5, Hk, D, dtype=dt)
            with torch.no_grad():
                v = torch.randn(B, S, Hk, D, dtype=dt)
                add(F.rope_append_kv(q, k, v, kc, vc, offset=torch.arange(B) % 3, **kw))
                add((kc, vc))
                kc2 = torch.randn(B, S + 5, Hk, D, dtype=dt); rows = torch.arange(2, S + 5)
                F.rope_shift_kv(kc2, rows, rows - 2, rows=rows, **kw); add(kc2)
    for (B, S, H, Hk, D, rd) in shapes[:2] + [(1, 300, 16, 4, 128, None), (2, 1024, 16, 4, 128, None)]:
        for il in (False, True):
            cos, sin = F.rope_cos_sin(torch.arange(S), rd or D, dtype=dt)  # any tables will do
            q = torch.randn(B, H, S, D, dtype=dt); k = torch.randn(B, Hk, S, D, dtype=dt); q[0, 0, 0, 0] = float("nan")
            with torch.no_grad():
                add(F.apply_rope_cos_sin(q, k, cos, sin, interleaved=il))
                add(F.apply_rope_cos_sin(q.transpose(1, 2), k.transpose(1, 2), cos, sin, layout="bshd", interleaved=il))
            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            o = F.apply_rope_cos_sin(qg, kg, cos, sin, interleaved=il)
            add(torch.autograd.grad(o, (qg, kg), (torch.randn_like(o[0]), torch.randn_like(o[1]))))
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for (S, H, Hk, D, norm, il) in [(37, 4, 2, 64, "head", False), (9, 3, 1, 128, "hidden", False),
                                   (17, 2, 2, 48, "head", True), (300, 16, 4, 128, "head", False)]:
        q = torch.randn(2, S, H, D, dtype=dt); k = torch.randn(2, S, Hk, D, dtype=dt); q[0, 0, 0, 0] = float("nan")
        wq, wk = (torch.rand(D * (n if norm == "hidden" else 1)) + 0.5 for n in (H, Hk))
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        o = F.qk_norm_rope(qg, kg, wq, wk, norm=norm, interleaved=il)
        add(o)
        add(torch.autograd.grad(o, (qg, kg), (torch.randn_like(o[0]), torch.randn_like(o[1]))))
        kc, vc = torch.zeros(2, S + 3, Hk, D, dtype=dt), torch.zeros(2, S + 3, Hk, D, dtype=dt)
        with torch.no_grad():
            add(F.rope_append_kv(q, k, k, kc, vc, offset=torch.tensor([0, 3]), q_weight=wq, k_weight=wk, norm=norm,
                                 interleaved=il))
        add((kc, vc))
    q = torch.randn(2, 19, 4, 192, dtype=dt); kv_c = torch.randn(2, 19, 1, 512, dtype=dt)
    k_pe = torch.randn(2, 19, 1, 64, dtype=dt); lat = torch.zeros(2, 40, 1, 576, dtype=dt)
    with torch.no_grad():
        F.rope_append_kv(q[..., 128:], k_pe, kv_c, lat[..., 512:], lat[..., :512], offset=torch.tensor([3, 7]),
                         interleaved=True, inplace=True)
    add((q, lat))
import posenc
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # add_position's backward, dropout
    for (B, S, d, batch_first, pos) in [(3, 37, 50, True, None), (2, 300, 512, True, None), (4, 19, 96, False, None),
                                        (2, 33, 128, True, "s"), (3, 21, 64, True, "bs")]:
        torch.manual_seed(1)
        module = posenc.LearnedPositionalEncoding(d, 0.3, max_len=S + 5, batch_first=batch_first)
        x = torch.randn(*((B, S) if batch_first else (S, B)), d, dtype=dt, requires_grad=True)
        positions = {None: None, "s": torch.randint(0, S + 5, (S,)), "bs": torch.randint(0, S + 5, (B, S))}[pos]
        out = module(x, positions=positions)
        add(out)
        add(torch.autograd.grad(out, (x, module.pe), torch.randn_like(out)))
    if dt != torch.float64:  # the train forward without a saved mask; a float32 table; the regenerated mask
        torch.manual_seed(2)
        x = torch.randn(3, 300, 520, dtype=dt); x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
        with torch.no_grad():
            add(posenc.PositionalEncoding(520, 0.3, max_len=400, batch_first=True).to(dt)(x))
            add(posenc.PositionalEncoding(520, 0.3, max_len=400, batch_first=True)(x))
        add(torch.ops.posenc.add_position_backward(x, torch.tensor([0x1234_5678_9ABC_DEF, 40]), 0.3))
torch.save(outs, sys.argv[1])
'''


def run(tree, code, *args):
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("time", "bits"))
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("cases", nargs="*", help="name:dtype, name one of " + ", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cold", action="store_true",
                        help="clone 64 MiB before each timed call: the call's data out of the caches")
    args = parser.parse_args()
    if args.mode == "bits":
        import torch
        with tempfile.TemporaryDirectory() as tmp:
            paths = [os.path.join(tmp, f"{i}.pt") for i in (0, 1)]
            for tree, path in zip((args.old, args.new), paths):
                run(tree, CHILD_BITS, path)
            old, new = (torch.load(p) for p in paths)
        differ = 0
        for a, b in zip(old, new):
            width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
            both_nan = torch.isnan(a) & torch.isnan(b)
            differ += int(a.shape != b.shape or bool(((a.view(width) != b.view(width)) & ~both_nan).any()))
        print(f"{len(old)} outputs; {differ} differ in bits (NaN payloads aside)")
        return int(differ > 0)
    for case in args.cases:
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            for name, tree in (("old", args.old), ("new", args.new)):
                out = run(tree, CHILD_TIME, case, str(args.threads), "1" if args.cold else "0")
                times[name].append(float(out.split()[-1]))
        o, n = min(times["old"]), min(times["new"])
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{case:28} old {o:.3f} ms  new {n:.3f} ms  new/old {n / o:.2f}  "
              f"(medians {med['old']:.3f} {med['new']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
