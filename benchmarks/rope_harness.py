"""Benchmark of posenc's fused RoPE (q and k in one launch) against plain PyTorch.

The reference is Hugging Face's formulation: cos/sin tables gathered at the positions, then
``q * cos + rotate_half(q) * sin`` (and the same for k), forward and autograd backward; it is
also timed under torch.compile. GB/s counts q and k read plus q and k written (the bytes one
pass must move); "copy" is q.clone() + k.clone(), the memory floor. Where Liger-Kernel is
importable (its Triton kernel, GPU only; scripts/fetch_liger_wheel.sh fetches a wheel that
scripts/gpu_check.sh puts on the path) it is timed too, in its in-place form, so posenc's
in-place op is timed beside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import posenc  # noqa: E402
from harness import time_interleaved  # noqa: E402


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def reference(q, k, cos_table, sin_table, positions):
    cos = cos_table[positions].unsqueeze(2)  # (B, S, 1, D): the gather of HF's rotary embedding
    sin = sin_table[positions].unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def liger_or_none():
    """Liger-Kernel's Triton RoPE (an autograd Function that rotates in place), or None."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction  # type: ignore
    except Exception:  # noqa: BLE001 - optional comparison
        return None
    return LigerRopeFunction


def liger_call(liger, q, k, cos_table, sin_table):
    """Liger takes Hugging Face's (batch, heads, seq, head_dim) views of (batch, seq, heads,
    head_dim) storage, and (seq, head_dim) cos/sin; returns the same views."""
    oq, ok = liger.apply(q.transpose(1, 2), k.transpose(1, 2), cos_table, sin_table)[:2]
    return oq.transpose(1, 2), ok.transpose(1, 2)


def bench(device, dtype, shape, reps, with_compile):
    B, S, Hq, Hk, D = shape
    q = torch.randn(B, S, Hq, D, device=device, dtype=dtype)
    k = torch.randn(B, S, Hk, D, device=device, dtype=dtype)
    positions = torch.arange(S, device=device).expand(B, S)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    angles = torch.arange(S, dtype=torch.float32, device=device)[:, None] * inv
    emb = torch.cat((angles, angles), dim=-1)
    cos_table, sin_table = emb.cos().to(dtype), emb.sin().to(dtype)
    rope = posenc.RotaryPositionalEncoding(D, max_len=S).to(device)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    # In-place variants work on their own copies (a rotation keeps the values' scale).
    q_own, k_own = q.clone(), k.clone()

    def ours():
        return rope(q, k)

    def ours_inplace():
        posenc.functional.apply_rope(q_own, k_own, inplace=True)

    def ref():
        return reference(q, k, cos_table, sin_table, positions)

    fns = {"posenc": ours, "in-place": ours_inplace, "eager": ref}
    if with_compile:
        compiled = torch.compile(reference)
        fns["compile"] = lambda: compiled(q, k, cos_table, sin_table, positions)
    liger = liger_or_none() if device == "cuda" else None
    if liger is not None:
        q_liger, k_liger = q.clone(), k.clone()
        # Same numbers first: a comparison is only fair between kernels that agree.
        with torch.no_grad():
            lq, _ = liger_call(liger, q.clone(), k.clone(), cos_table, sin_table)
            diff = (lq.float() - rope(q, k)[0].float()).abs().max().item()
        print(f"liger vs posenc, max |difference| of rotated q: {diff:.3g}", flush=True)
        fns["liger"] = lambda: liger_call(liger, q_liger, k_liger, cos_table, sin_table)
    rows = []
    # The floor (clone of q and k) in the same alternation, each column from a cold cache
    # (NOTES.md; bench_table.py's columns).
    fns["copy"] = lambda: (q.clone(), k.clone())
    with torch.no_grad():
        t = time_interleaved(fns, device, reps, cold=fns)
    rows.append(("forward", t))

    qg, kg = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def backward_of(fn):
        oq, ok = fn(qg, kg)
        return lambda: torch.autograd.grad((oq, ok), (qg, kg), (gq, gk), retain_graph=True)

    bfns = {"posenc": backward_of(lambda a, b: rope(a, b)),
            "eager": backward_of(lambda a, b: reference(a, b, cos_table, sin_table, positions))}
    if with_compile:
        compiled_b = torch.compile(reference)
        bfns["compile"] = backward_of(lambda a, b: compiled_b(a, b, cos_table, sin_table, positions))
    if liger is not None:
        # Liger rotates its input in place: give it a non-leaf copy (clone is free in backward).
        bfns["liger"] = backward_of(lambda a, b: liger_call(liger, a.clone(), b.clone(), cos_table, sin_table))
    bfns["copy"] = fns["copy"]
    t = time_interleaved(bfns, device, reps, cold=bfns)
    rows.append(("backward", t))
    tag = str(dtype).replace("torch.", "")
    return [dict(device=device, dtype=tag, shape=shape, case=case, bytes=nbytes,
                 **{f"{n}_ms": v for n, v in times.items()}, gbps=nbytes / (times["posenc"] * 1e-3) / 1e9)
            for case, times in rows]


def format_rows(rows):
    names = [n for n in ("posenc", "in-place", "eager", "compile", "liger", "copy")
             if any(f"{n}_ms" in r for r in rows)]
    header = f"{'device':6} {'dtype':8} {'shape (B,S,Hq,Hk,D)':>22} {'case':9} "
    header += " ".join(f"{n + ' ms':>11}" for n in names)
    header += f" {'GB/s':>7} {'%copy':>6} {'eager/posenc':>12} {'compile/posenc':>14}"
    lines = [header, "-" * len(header)]
    for r in rows:
        cells = " ".join(f"{r[f'{n}_ms']:11.3f}" if f"{n}_ms" in r else f"{'-':>11}" for n in names)
        comp = f"{r['compile_ms'] / r['posenc_ms']:14.2f}" if "compile_ms" in r else f"{'-':>14}"
        lines.append(f"{r['device']:6} {r['dtype']:8} {'x'.join(map(str, r['shape'])):>22} {r['case']:9} {cells} "
                     f"{r['gbps']:7.1f} {100 * r['copy_ms'] / r['posenc_ms']:5.0f}% "
                     f"{r['eager_ms'] / r['posenc_ms']:12.2f} {comp}")
    lines.append("GB/s: q and k read + written once; %copy: q.clone()+k.clone() time over posenc's time.")
    return "\n".join(lines)
