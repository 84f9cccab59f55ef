#!/usr/bin/env python3
"""Compare the sm_90 SASS of two builds of CUDA objects, kernel by kernel, without a GPU.

A change that should leave the device code alone (moving host code, headers, launchers) can
be held to that: build the object before and after, then

    python scripts/sass_diff.py OLD.o NEW.o

(objects or libraries; cuobjdump from the CUDA toolkit or the nvidia-cuda-cuobjdump wheel on
PATH). Kernels are matched by demangled name, with at::opmath_type / posenc::cuda::opmath_t
and the anonymous namespace of a moved struct unified. What a move may change and is not
code is normalised: addresses in constant bank 4 (assert message strings, libdevice tables)
and the registers loaded with offsets into it, and assert line numbers. Exit status 1 when a
kernel differs or is missing on one side. Used for the ATen-free CUDA split (2026-12-04):
every kernel identical.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

MOVED_STRUCTS = ("TableBackwardArgs", "CudaDropoutArgs")
HEADER_LINES = ("Fatbin", "====", "arch =", "code version", "host =", "compile_size", "compressed",
                "identifier =", "ptxasOptions", "code for sm_", ".target", ".headerflags")


def demangle(name: str) -> str:
    out = subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    out = re.sub(r"at::OpMathType<([^>]*)>::type", r"ACC<\1>", out)
    out = re.sub(r"posenc::cuda::OpMath<([^>]*)>::type", r"ACC<\1>", out)
    for struct in MOVED_STRUCTS:
        out = out.replace(f"posenc::ops::(anonymous namespace)::{struct}", f"posenc::ops::{struct}")
    return out


def kernels(path: str) -> dict[str, list[str]]:
    sass = subprocess.run(["cuobjdump", "-sass", "-arch", "sm_90", path], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    # A register loaded with an offset into constant bank 4 (the __assertfail pointer's slot)
    # is layout, not code.
    for i, line in enumerate(sass):
        m = re.search(r"MOV (R\d+), 0x[0-9a-f]+ ;", line)
        if m and any(f"c[0x4][{m.group(1)}]" in later for later in sass[i + 1:i + 24]):
            sass[i] = line.replace(m.group(0), f"MOV {m.group(1)}, C4OFF ;")
    found: dict[str, list[str]] = {}
    current = None
    for line in sass:
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = demangle(m.group(1))
            found[current] = []
            continue
        if current is None:
            continue
        text = re.sub(r"/\*[0-9a-f]{4}\*/", "", line)
        text = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", text).strip()
        if not text or text.startswith(HEADER_LINES):
            continue
        text = re.sub(r"c\[0x4\]\[[^\]]+\]", "C4", text)
        text = re.sub(r"(IMAD\.MOV\.U32 R\d+, RZ, RZ, )0x[0-9a-f]+ ;", r"\1IMM ;", text)  # assert lines
        text = re.sub(r"(HFMA2\.MMA R\d+, -RZ, RZ, 0, )\S+ ;", r"\1IMM ;", text)
        text = re.sub(r"^MOV R8, 0x[0-9a-f]+ ;", "MOV R8, IMM ;", text)
        found[current].append(text)
    return found


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    same = [k for k in old if k in new and old[k] == new[k]]
    differ = [k for k in old if k in new and old[k] != new[k]]
    only_old, only_new = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    print(f"{len(old)} vs {len(new)} kernels: {len(same)} identical, {len(differ)} differ, "
          f"{len(only_old)} only in the old, {len(only_new)} only in the new")
    for k in differ:
        lines = [d for d in difflib.unified_diff(old[k], new[k], lineterm="", n=0)
                 if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        print(f"differ: {k}\n  " + "\n  ".join(lines[:10]))
    for k in only_old:
        print(f"only in the old: {k}")
    for k in only_new:
        print(f"only in the new: {k}")
    return 0 if not (differ or only_old or only_new) else 1


if __name__ == "__main__":
    sys.exit(main())
