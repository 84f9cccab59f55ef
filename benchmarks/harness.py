"""Benchmarks of the fused add-position-plus-dropout op against plain PyTorch.

For every case the same run times: posenc, the plain-PyTorch reference
(``F.dropout(x + pe[:, :S])``, the classic forward), ``torch.compile`` of that reference, and
``x.clone()`` (the memory floor: one read and one write of x). Throughput counts the bytes a
single pass must move: x read and the output written (the table rows are S*d, negligible).
"""

from __future__ import annotations

import os

# Inductor otherwise starts a pool of compile workers in the background, which on a small
# machine steals the cores the timings run on. Must be set before inductor's config loads.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import torch
import torch.nn.functional as F

import posenc


# The page policy of a kernel-against-kernel comparison: every variant's outputs on 2 MiB
# transparent huge pages (torch's allocator serves posenc's outputs as everyone's). Not what
# users get by default: for bench_saved_mask.py and the like. Read once per process (at
# torch's first allocation), so it must be in the environment when the process starts.
FAIR_PAGE_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def _thp_setting(name: str) -> str:
    """A kernel transparent-huge-page setting ("enabled", "defrag"): its selected value
    ("always", "madvise", "never", ...), or "unknown"."""
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def allocator() -> str:
    """The CPU allocator of this process: tcmalloc or jemalloc when loaded (read from the
    process's own mappings: an LD_PRELOAD naming a missing library loads nothing), else glibc's."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc malloc"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; platform.processor() elsewhere): the tables' numbers
    belong to one CPU, and the machines of one kind differ (Intel and AMD hosts seen here)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def page_policy() -> str:
    """One line saying which memory the CPU timings' outputs get in this process: torch's
    allocator for every variant, posenc's included."""
    torch_thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    pages = "2 MiB huge pages (THP_MEM_ALLOC_ENABLE=1)" if torch_thp else "its default pages"
    return (f"Memory (CPU): every variant's outputs from torch's allocator on {pages}, over {allocator()} "
            f"(kernel THP enabled={_thp_setting('enabled')}, defrag={_thp_setting('defrag')})")


@dataclass
class Row:
    device: str
    dtype: str
    shape: tuple
    case: str
    kind: str
    ours_ms: float
    ref_ms: float
    compiled_ms: Optional[float]
    floor_ms: float
    bytes_moved: int
    copy_gbps: Optional[float] = None  # measured device copy bandwidth (GPU), for %copy

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.ours_ms * 1e-3) / 1e9

    @property
    def floor_gbps(self) -> float:
        return self.bytes_moved / (self.floor_ms * 1e-3) / 1e9

    @property
    def copy_percent(self) -> Optional[float]:
        """Achieved bandwidth as a share of the measured copy bandwidth (the GPU targets)."""
        return None if self.copy_gbps is None else 100 * self.gbps / self.copy_gbps


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


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this machine in bytes (Linux sysfs), or 32 MiB if unknown."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(root):
            with open(f"{root}/{entry}/size") as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return max(sizes, default=32 << 20)


_flush_buffer: Optional[torch.Tensor] = None


def flush_caches() -> None:
    """Reads a buffer of twice the largest cache (64 MiB at least): afterwards no earlier
    call's data is cached and none of its lines is dirty (their write-backs happened here),
    so the next call starts from the same state whatever ran before it."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.ones(max(64 << 20, 2 * last_level_cache_bytes()) // 4)
    _flush_buffer.sum()


def time_interleaved(fns: dict, device: str, reps: int, warmup: int = 3, burst: int = 1,
                     samples: Optional[dict] = None, cold: Iterable[str] = ()) -> dict:
    """Median time (ms) of each fn, measured in alternation (one sample of each per round) so
    that slow drifts of a shared machine (page reclaim, other tenants) hit all of them. Each
    round starts one fn further on (round r: fns r, r + 1, ... mod n).

    No sample may pay for the call before it. A call right after another fn pays for its
    neighbour's deferred work (the dirty lines it left, written back as the next call fills
    the cache) and finds its own data evicted: on the AMD EPYC host of 2026-12-05 a 0.17 ms
    sinusoidal_2d_table took 0.57 ms right after the torch.compile of its eager composition
    (then 0.20 and 0.17 ms), a clone of 8 MiB 0.42 ms (then 0.17, 0.12, 0.10). Rotating the
    start of each round did not spread that: the cyclic order keeps each fn's predecessor
    (posenc followed the compiled column in 3 rounds of 4, the floor followed posenc), so a
    column was charged for another's work. So a sample of a fn named in `cold` starts after
    flush_caches() (every such fn with its inputs in memory and no dirty lines: a memory
    floor, the same state for each), and a sample of any other fn right after one untimed
    call of it (the steady state of a loop of it: a decode step's, an in-cache rate).

    With burst > 1 a sample is the mean of `burst` consecutive calls (launch-bound calls).
    `samples` (a dict), if given, receives each fn's samples in round order."""
    cold = set(cold)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if samples is None:
        samples = {}
    samples.update({name: [] for name in fns})
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            if name in cold:
                flush_caches()
            else:
                fn()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(burst):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e3 / burst)
    return {name: statistics.median(v) for name, v in samples.items()}


def grad_step(fn: Callable, inputs: tuple, grads: tuple) -> Callable[[], None]:
    """A timed training step: fn(*inputs) forward, then the gradients of its outputs
    (weighted by grads) with respect to inputs (leaves with requires_grad)."""

    def step() -> None:
        outputs = fn(*inputs)
        torch.autograd.grad(outputs, inputs, grads)

    return step


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written), the ceiling that
    memory-bound kernels are compared against."""
    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _reference(pe: torch.Tensor, p: float, training: bool):
    def forward(x):
        # The table in x's dtype, as a user would write it (a float32 learned table would
        # otherwise promote a bfloat16 x to a float32 output: twice the bytes written).
        return F.dropout(x + pe[:, : x.size(1)].to(x.dtype), p, training)
    return forward


def bench_shape(device: str, dtype: torch.dtype, shape: tuple, p: float = 0.1, reps: int = 20,
                with_compile: bool = True, kind: str = "sinusoidal",
                copy_gbps: Optional[float] = None) -> List[Row]:
    """Rows for one shape. kind="sinusoidal": PositionalEncoding (fixed table, gradient of x
    only); kind="learned": LearnedPositionalEncoding (float32 table, backward computes the
    gradients of x and of the table)."""
    B, S, d = shape
    if kind == "learned":
        module = posenc.LearnedPositionalEncoding(d, p, max_len=max(S, 1)).to(device)
        table = module.pe
    else:
        module = posenc.PositionalEncoding(d, p, max_len=max(S, 1)).to(device)
        table = module.pe.to(dtype) if dtype != torch.float32 else module.pe
        if dtype != torch.float32:
            module.pe = table  # keep the reference and posenc on the same table dtype
    x = torch.randn(shape, device=device, dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size()
    rows = []
    tag = str(dtype).replace("torch.", "")

    def clone():
        return x.clone()

    for training in (False, True):
        module.train(training)
        ref = _reference(table, p, training)
        fns = {"ours": lambda: module(x), "ref": lambda ref=ref: ref(x)}
        if with_compile:
            fns["compiled"] = torch.compile(ref)
            fns["compiled"] = (lambda c: (lambda: c(x)))(fns["compiled"])
        # The floor in the same alternation (NOTES.md: the memory floor is clone() of the same
        # bytes, interleaved with the op), each column from a cold cache as bench_table's.
        fns["floor"] = clone
        with torch.no_grad():
            t = time_interleaved(fns, device, reps, cold=fns)
        rows.append(Row(device, tag, shape, "train forward" if training else "eval forward", kind,
                        t["ours"], t["ref"], t.get("compiled"), t["floor"], nbytes, copy_gbps))

    # Backward in training mode (posenc reads the keep mask its CPU forward saved, 1 bit per
    # element, and regenerates it on CUDA; the reference multiplies by its stored one): the
    # gradient of x, and of the table too for the learned encoding.
    module.train(True)
    ref = _reference(table, p, True)
    xg = x.detach().requires_grad_(True)
    grad = torch.randn_like(x)
    inputs = [xg, table] if kind == "learned" else [xg]

    def backward_of(fn):
        y = fn(xg)
        return lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True)

    fns = {"ours": backward_of(module), "ref": backward_of(ref)}
    if with_compile:
        fns["compiled"] = backward_of(torch.compile(ref))
    # The bytes backward must move: grad read, grad_x written, the saved keep mask read (1 bit
    # per element; CUDA regenerates it), and for the learned table its float32 gradient
    # written; the floor clones as many bytes.
    backward_bytes = nbytes + (x.numel() // 8 if device == "cpu" else 0)
    if kind == "learned":
        backward_bytes += S * d * 4
    back_src = torch.empty(backward_bytes // 2, dtype=torch.uint8, device=device)
    fns["floor"] = back_src.clone
    t = time_interleaved(fns, device, reps, cold=fns)
    rows.append(Row(device, tag, shape, "train backward", kind, t["ours"], t["ref"],
                    t.get("compiled"), t["floor"], backward_bytes, copy_gbps))
    return rows


def format_table(rows: Iterable[Row]) -> str:
    rows = list(rows)
    with_copy = any(r.copy_gbps is not None for r in rows)
    header = (f"{'device':6} {'dtype':8} {'shape':>16} {'encoding':10} {'case':15} {'posenc ms':>10} {'GB/s':>8} "
              + (f"{'%copy':>6} " if with_copy else "")
              + f"{'%floor':>7} {'eager ms':>9} {'compile ms':>10} {'eager/ours':>10} {'comp/ours':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        comp = f"{r.compiled_ms:10.3f}" if r.compiled_ms is not None else f"{'-':>10}"
        comp_ratio = f"{r.compiled_ms / r.ours_ms:9.2f}" if r.compiled_ms is not None else f"{'-':>9}"
        copy = ""
        if with_copy:
            copy = f"{r.copy_percent:5.0f}% " if r.copy_percent is not None else f"{'-':>6} "
        shape = "x".join(str(s) for s in r.shape)
        lines.append(
            f"{r.device:6} {r.dtype:8} {shape:>16} {r.kind:10} {r.case:15} {r.ours_ms:10.3f} {r.gbps:8.1f} "
            f"{copy}{100 * r.floor_ms / r.ours_ms:6.0f}% {r.ref_ms:9.3f} {comp} "
            f"{r.ref_ms / r.ours_ms:10.2f} {comp_ratio}"
        )
    lines.append("%floor: time of a clone() of the bytes the row moves (forward: x read + output written; "
                 "backward: grad read + grad_x written + the CPU's saved mask bits + the learned table's "
                 "float32 gradient), interleaved, over posenc's time; GB/s counts those bytes"
                 + ("; %copy: GB/s over the measured device-to-device copy bandwidth "
                    "(targets: eval >= 85%, training >= 80%)." if with_copy else "."))
    return "\n".join(lines)
