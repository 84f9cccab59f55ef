#!/usr/bin/env python3
"""Static checks of the compiled CUDA kernels, no GPU needed (ctest `cuda_kernel_resources`).

For every kernel of libposenc's sm_90 code:
- ptxas's resource lines (`ptxas -v` on the PTX embedded in the library, with the options
  nvcc used, which cuobjdump prints): registers, stack frame, spill stores/loads;
- cross-checked against the SASS in the library (`cuobjdump -res-usage`), so the numbers
  describe the code that runs;
- the SASS (`cuobjdump -sass`): how many 128-bit global loads and stores it has.

The hot kernels (the fast paths that move the bytes) must keep their register budget (the
occupancy each was designed for, stated below with the reason), spill nothing, and keep
their 16-byte loads and stores. The table printed at the end (registers, resident blocks
and threads per SM, bytes in flight) is the one in benchmarks/NOTES.md.

Usage: check_cuda_kernels.py LIBRARY [--ptxas PTXAS] [--cuobjdump CUOBJDUMP]
cuobjdump and nvdisasm come from the pip packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm (requirements-dev.txt) when the CUDA toolkit here lacks them.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

ARCH = "sm_90"
# H200 (sm_90) per SM: 64K registers, 2048 threads, 32 blocks, 228 KiB shared memory (227
# usable per block, 1 KiB reserved per block).
SM_REGISTERS = 65536
SM_THREADS = 2048
SM_BLOCKS = 32
SM_SHARED = 228 * 1024


@dataclass
class Rule:
    """A hot kernel: demangled-name pattern, threads per block, register budget (why),
    and the least number of 128-bit global loads / stores its SASS must have (why)."""

    pattern: str
    threads: int
    max_registers: int
    why: str
    min_ldg128: int = 0
    min_stg128: int = 0
    bytes_in_flight: str = ""  # per thread, for the table


def rules() -> list[Rule]:
    """The hot kernels: the 16-byte paths in the dtypes models train and serve in (bfloat16,
    float16, float32). float64 paths (gradcheck, references) are reported, not checked."""
    out = []
    for dtype, packs in (("BFloat16", 1), ("Half", 1), ("float", 2)):
        # add_position forward/backward fast paths: __launch_bounds__(256, 4) -> <= 64
        # registers, 4 blocks (1024 threads) per SM; a step loads two 16-byte words of x per
        # thread (two 8-element groups of a 16-bit type, one group of float32) and stores
        # them the same way.
        for index in ("unsigned int", "unsigned long"):
            for kernel in (f"add_position_forward_kernel<(c10::)?{dtype}, [^,]+, {index}, true>",
                           f"add_position_backward_kernel<(c10::)?{dtype}, {index}, true>"):
                out.append(Rule(kernel, 256, 64, "4 blocks/SM (launch bounds); 32 B a thread in flight",
                                min_ldg128=2, min_stg128=2, bytes_in_flight="32 B of x or grad"))
        # Learned-table backward (positions per s): (tile x batch slices) blocks, 4 per SM
        # (64 registers), two rows' grad loads in flight, grad_x stored 16 bytes at a time
        # (the two-row loop and the odd last row: 3 rows' stores).
        out.append(Rule(
            rf"add_position_backward_table_kernel<(c10::)?{dtype}, true>", 256, 64,
            "4 blocks/SM (launch bounds); 2 rows a thread in flight",
            min_ldg128=3 * packs, min_stg128=3 * packs, bytes_in_flight=f"{2 * 16 * packs} B"))
        # (batch, seq) positions, pass 1: sort-bound path, no launch bounds; budget 80 keeps 3
        # blocks per SM. grad_x stored 16 bytes at a time.
        out.append(Rule(
            rf"add_position_backward_table_sorted_kernel<(c10::)?{dtype}, true>", 256, 80,
            "3 blocks/SM; the path is bound by the sort before it",
            min_ldg128=packs, min_stg128=packs, bytes_in_flight=f"{16 * packs} B"))
    # RoPE 16-byte paths: __launch_bounds__(256, 3) -> <= 80 registers (3 blocks, 768
    # threads per SM); a head's two 16-byte loads and stores (the two layouts may share the
    # instructions) and the 16-byte pass-through copy: 3 of each at least.
    # apply_rope_cos_sin (rope_cos_sin_kernel, given tables): the same split, budget and
    # accesses; its tables are staged in shared memory per step.
    for dtype, p in (("BFloat16", 8), ("Half", 8), ("float", 4)):
        for kernel in ("rope_kernel", "rope_cos_sin_kernel"):
            out.append(Rule(rf"{kernel}<(c10::)?{dtype}, {p}, true>", 256, 80,
                            "3 blocks/SM (launch bounds); a head's 2 loads in flight",
                            min_ldg128=3, min_stg128=3, bytes_in_flight="32 B"))
    return out


@dataclass
class Kernel:
    mangled: str
    name: str = ""
    registers: int = -1
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0
    sass_registers: int = -1
    ops: dict = field(default_factory=dict)


def find_tool(name: str, given: str | None) -> str:
    if given:
        return given
    found = shutil.which(name)
    if found:
        return found
    import site

    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for cand in glob.glob(os.path.join(base, "nvidia", "cu*", "bin", name)):
            return cand
    for cand in glob.glob(os.path.join(os.path.dirname(sys.executable), "..", "lib", "python*",
                                       "site-packages", "nvidia", "cu*", "bin", name)):
        return cand
    sys.exit(f"check_cuda_kernels: {name} not found: install nvidia-cuda-cuobjdump "
             f"(requirements-dev.txt) or put {name} on PATH")


def run(cmd: list[str], cwd: str | None = None) -> str:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"check_cuda_kernels: {' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    return res.stdout + res.stderr


def demangle(names: list[str]) -> dict[str, str]:
    out = run(["c++filt"] + names) if names else ""
    pretty = {}
    for mangled, line in zip(names, out.splitlines()):
        line = re.sub(r"posenc::ops::\(anonymous namespace\)::", "", line)
        pretty[mangled] = line.replace("posenc::ops::", "")
    return pretty


def ptxas_resources(lib: str, cuobjdump: str, ptxas: str) -> dict[str, Kernel]:
    kernels: dict[str, Kernel] = {}
    with tempfile.TemporaryDirectory() as tmp:
        listing = run([cuobjdump, "-xptx", "all", lib], cwd=tmp)
        # "Extracting PTX file and ptxas options    1: rope_cuda.sm_90.ptx -arch=sm_90 ..."
        jobs = re.findall(r"Extracting PTX file and ptxas options\s+\d+:\s+(\S+)\s+(.*)", listing)
        jobs = [(f, opts.split()) for f, opts in jobs if f".{ARCH}." in f]
        if not jobs:
            sys.exit(f"check_cuda_kernels: no {ARCH} PTX in {lib}: build with "
                     "TORCH_CUDA_ARCH_LIST=9.0+PTX (the default and CI's setting)")
        for ptx, opts in jobs:
            text = run([ptxas] + opts + ["-v", os.path.join(tmp, ptx), "-o", os.devnull])
            current = None
            # ptxas prints "Function properties for <name>" before each function's stack and
            # spill line, the kernel's and those of device functions it calls (e.g.
            # __internal_trig_reduction_slowpathd, after the kernel's): only the kernel's own
            # line is the kernel's.
            props_of_current = False
            for line in text.splitlines():
                m = re.search(r"Compiling entry function '(\S+)'", line)
                if m:
                    current = kernels.setdefault(m.group(1), Kernel(m.group(1)))
                    props_of_current = False
                    continue
                m = re.search(r"Function properties for (\S+)", line)
                if m:
                    props_of_current = current is not None and m.group(1) == current.name
                    continue
                m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                              r"(\d+) bytes spill loads", line)
                if m and current is not None and props_of_current:
                    current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
                    continue
                m = re.search(r"Used (\d+) registers", line)
                if m and current is not None:
                    current.registers = int(m.group(1))
                    m2 = re.search(r"(\d+) bytes smem", line)
                    current.shared = int(m2.group(1)) if m2 else 0
    return kernels


def sass_facts(lib: str, cuobjdump: str, kernels: dict[str, Kernel]) -> None:
    usage = run([cuobjdump, "-res-usage", "-arch", ARCH, lib])
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+)", usage):
        if m.group(1) in kernels:
            kernels[m.group(1)].sass_registers = int(m.group(2))
    sass = run([cuobjdump, "-sass", "-arch", ARCH, lib])
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        mangled = chunk.split("\n", 1)[0].strip()
        if mangled not in kernels:
            continue
        ops = {}
        for op in re.findall(r"\b((?:LDG|STG)(?:\.[A-Z0-9_]+)*)\s", chunk):
            ops[op] = ops.get(op, 0) + 1
        kernels[mangled].ops = ops


def count(ops: dict, kind: str) -> int:
    """128-bit global accesses: LDG.E.128[.CONSTANT...] / STG.E.128[...]."""
    return sum(n for op, n in ops.items() if op.startswith(kind) and ".128" in op)


def occupancy(k: Kernel, threads: int) -> tuple[int, int]:
    regs = max(k.registers, 1)
    per_warp = ((regs * 32 + 255) // 256) * 256  # allocated per warp in 256-register units
    warps = threads // 32
    by_regs = (SM_REGISTERS // per_warp) // warps
    by_shared = SM_SHARED // (k.shared + 1024) if k.shared else SM_BLOCKS
    blocks = min(by_regs, SM_THREADS // threads, SM_BLOCKS, by_shared)
    return blocks, blocks * threads


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("library")
    ap.add_argument("--ptxas")
    ap.add_argument("--cuobjdump")
    args = ap.parse_args()
    cuobjdump = find_tool("cuobjdump", args.cuobjdump)
    # cuobjdump -sass runs nvdisasm: the one beside cuobjdump, or on PATH.
    nvdisasm = os.path.join(os.path.dirname(cuobjdump), "nvdisasm")
    if not os.path.exists(nvdisasm):
        nvdisasm = find_tool("nvdisasm", None)
    os.environ["NVDISASM_PATH"] = os.path.dirname(nvdisasm)
    ptxas = find_tool("ptxas", args.ptxas)
    args.library = os.path.abspath(args.library)
    kernels = ptxas_resources(args.library, cuobjdump, ptxas)
    sass_facts(args.library, cuobjdump, kernels)
    names = demangle(list(kernels))
    for mangled, k in kernels.items():
        k.name = names[mangled]

    failures = []
    for k in kernels.values():
        if k.sass_registers != k.registers:
            failures.append(f"{k.name}: ptxas on the embedded PTX gives {k.registers} registers, "
                            f"the library's SASS {k.sass_registers}: the PTX is not the code "
                            "that runs")
    rows = []
    for rule in rules():
        matched = [k for k in kernels.values() if re.search(rule.pattern, k.name.split("(")[0])]
        if not matched:
            failures.append(f"no kernel matches {rule.pattern!r}: renamed or no longer built")
            continue
        for k in matched:
            blocks, threads = occupancy(k, rule.threads)
            ldg, stg = count(k.ops, "LDG"), count(k.ops, "STG")
            rows.append((k.name.split("(")[0], k.registers, rule.max_registers, blocks, threads,
                         k.spill_stores + k.spill_loads, ldg, stg, rule.bytes_in_flight))
            if k.registers > rule.max_registers:
                failures.append(f"{k.name}: {k.registers} registers > budget "
                                f"{rule.max_registers} ({rule.why})")
            if k.spill_stores or k.spill_loads:
                failures.append(f"{k.name}: spills ({k.spill_stores} bytes stored, "
                                f"{k.spill_loads} loaded)")
            if ldg < rule.min_ldg128:
                failures.append(f"{k.name}: {ldg} 128-bit global loads, expected at least "
                                f"{rule.min_ldg128}")
            if stg < rule.min_stg128:
                failures.append(f"{k.name}: {stg} 128-bit global stores, expected at least "
                                f"{rule.min_stg128}")

    print(f"{'kernel (' + ARCH + ')':<92} {'regs':>4} {'budget':>6} {'blk/SM':>6} "
          f"{'thr/SM':>6} {'spill':>5} {'LDG128':>6} {'STG128':>6}  in flight/thread")
    for r in rows:
        print(f"{r[0]:<92} {r[1]:>4} {r[2]:>6} {r[3]:>6} {r[4]:>6} {r[5]:>5} {r[6]:>6} "
              f"{r[7]:>6}  {r[8]}")
    others = [k for k in kernels.values()
              if not any(re.search(rule.pattern, k.name.split("(")[0]) for rule in rules())]
    print("\nother kernels (fallback paths; reported, not checked):")
    for k in sorted(others, key=lambda k: k.name):
        print(f"  {k.name.split('(')[0]:<90} {k.registers:>4} regs, stack {k.stack}, "
              f"spill {k.spill_stores + k.spill_loads}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"\nok: {len(rows)} hot kernels within budget, no spills, 128-bit accesses kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
