"""Fresh 32 MiB CPU outputs under several page options, applied through ctypes madvise before
`torch.add(x, pe, out=out)` writes them, against eager `x + pe`, `x.clone()` and the same add
into a buffer written before (what reusing a freed block gives); calls in alternation, 2
threads, Linux. The options weighed for issue 28 (benchmarks/NOTES.md, "CPU output memory").
Usage: python benchmarks/page_options_probe.py [--calls 20] [--only name,name]
"""

import argparse
import ctypes
import statistics
import sys
import threading
import time

import torch

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
HUGE, PAGE = 2 << 20, 4096

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def interior(t: torch.Tensor, align: int):
    begin = t.data_ptr()
    return (begin + align - 1) & ~(align - 1), (begin + t.nbytes) & ~(align - 1)


def advise_huge(t: torch.Tensor) -> None:
    lo, hi = interior(t, HUGE)
    if hi > lo:
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)


def populate(t: torch.Tensor, parts: int) -> None:
    """MADV_POPULATE_WRITE (Linux 5.14+) over the output, split over `parts` threads (ctypes
    releases the GIL during the call)."""
    lo, hi = interior(t, PAGE)
    step = ((hi - lo) // parts + PAGE - 1) & ~(PAGE - 1)
    threads = [threading.Thread(target=libc.madvise,
                                args=(lo + i * step, min(step, hi - lo - i * step), MADV_POPULATE_WRITE))
               for i in range(parts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    print("command:", " ".join(["python", *sys.argv]))
    torch.set_num_threads(2)
    x, pe = torch.randn(32, 512, 512), torch.randn(1, 512, 512)
    warm = torch.empty_like(x)
    prepare = {
        "no advice": lambda out: None,
        "huge-page advice": advise_huge,
        "populate, 1 thread": lambda out: populate(out, 1),
        "populate, 2 threads": lambda out: populate(out, 2),
        "advice + populate, 2 threads": lambda out: (advise_huge(out), populate(out, 2)),
    }

    def fresh(step):
        def call():
            out = torch.empty_like(x)
            step(out)
            return torch.add(x, pe, out=out)
        return call

    fns = {name: fresh(step) for name, step in prepare.items()}
    fns["eager x + pe"] = lambda: x + pe
    fns["x.clone()"] = lambda: x.clone()
    fns["add into a written buffer"] = lambda: torch.add(x, pe, out=warm)
    names = args.only.split(",") if args.only else list(fns)
    samples = {name: [] for name in names}
    for name in names:
        fns[name]()
    for _ in range(args.calls):
        for name in names:
            start = time.perf_counter()
            out = fns[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
            del out
    for name in names:
        ms = sorted(samples[name])
        print(f"{name:30} ms: min {ms[0]:6.2f}  median {statistics.median(ms):6.2f}  max {ms[-1]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
