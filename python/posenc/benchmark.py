"""Benchmarks of the fused add-position-plus-dropout op against plain PyTorch.

For every case the same run times: posenc, the plain-PyTorch reference
(``F.dropout(x + pe[:, :S])``, the classic forward), ``torch.compile`` of that reference, and
``x.clone()`` (the memory floor: one read and one write of x). Throughput counts the bytes a
single pass must move: x read and the output written (the table rows are S*d, negligible).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import torch
import torch.nn.functional as F

import posenc


@dataclass
class Row:
    device: str
    dtype: str
    shape: tuple
    case: str
    ours_ms: float
    ref_ms: float
    compiled_ms: Optional[float]
    floor_ms: float
    bytes_moved: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.ours_ms * 1e-3) / 1e9

    @property
    def floor_gbps(self) -> float:
        return self.bytes_moved / (self.floor_ms * 1e-3) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, reps: int, warmup: int = 3) -> float:
    """Median wall time of fn in milliseconds (device events on CUDA)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    if device.startswith("cuda"):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _reference(pe: torch.Tensor, p: float, training: bool):
    def forward(x):
        return F.dropout(x + pe[:, : x.size(1)], p, training)
    return forward


def bench_shape(device: str, dtype: torch.dtype, shape: tuple, p: float = 0.1, reps: int = 20,
                with_compile: bool = True) -> List[Row]:
    B, S, d = shape
    module = posenc.PositionalEncoding(d, p, max_len=max(S, 1)).to(device)
    table = module.pe.to(dtype) if dtype != torch.float32 else module.pe
    if dtype != torch.float32:
        module.pe = table  # keep the reference and posenc on the same table dtype
    x = torch.randn(shape, device=device, dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size()
    floor = time_ms(lambda: x.clone(), device, reps)
    rows = []

    for training in (False, True):
        module.train(training)
        ref = _reference(table, p, training)
        compiled = torch.compile(ref) if with_compile else None
        with torch.no_grad():
            ours_ms = time_ms(lambda: module(x), device, reps)
            ref_ms = time_ms(lambda: ref(x), device, reps)
            comp_ms = time_ms(lambda: compiled(x), device, reps) if compiled else None
        rows.append(Row(device, str(dtype).replace("torch.", ""), shape,
                        "train forward" if training else "eval forward",
                        ours_ms, ref_ms, comp_ms, floor, nbytes))

    # Backward in training mode: the gradient of x only (posenc regenerates the mask,
    # the reference multiplies by its stored mask).
    module.train(True)
    ref = _reference(table, p, True)
    compiled = torch.compile(ref) if with_compile else None
    xg = x.detach().requires_grad_(True)
    grad = torch.randn_like(x)

    def backward_of(fn):
        y = fn(xg)
        return lambda: torch.autograd.grad(y, xg, grad, retain_graph=True)

    ours_ms = time_ms(backward_of(module), device, reps)
    ref_ms = time_ms(backward_of(ref), device, reps)
    comp_ms = time_ms(backward_of(compiled), device, reps) if compiled else None
    rows.append(Row(device, str(dtype).replace("torch.", ""), shape, "train backward",
                    ours_ms, ref_ms, comp_ms, floor, nbytes))
    return rows


def format_table(rows: Iterable[Row]) -> str:
    header = (f"{'device':6} {'dtype':8} {'shape':>16} {'case':15} {'posenc ms':>10} {'GB/s':>8} "
              f"{'%floor':>7} {'eager ms':>9} {'compile ms':>10} {'eager/ours':>10} {'comp/ours':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        comp = f"{r.compiled_ms:10.3f}" if r.compiled_ms is not None else f"{'-':>10}"
        comp_ratio = f"{r.compiled_ms / r.ours_ms:9.2f}" if r.compiled_ms is not None else f"{'-':>9}"
        shape = "x".join(str(s) for s in r.shape)
        lines.append(
            f"{r.device:6} {r.dtype:8} {shape:>16} {r.case:15} {r.ours_ms:10.3f} {r.gbps:8.1f} "
            f"{100 * r.floor_ms / r.ours_ms:6.0f}% {r.ref_ms:9.3f} {comp} {r.ref_ms / r.ours_ms:10.2f} {comp_ratio}"
        )
    lines.append("%floor: time of x.clone() (one read + one write of x) over posenc's time; "
                 "GB/s counts x read + output written.")
    return "\n".join(lines)
