"""Smoke test of the main job, `python -m posenc demo`, in its quick form on the CPU."""
import os
import re
import subprocess
import sys
from pathlib import Path


import posenc

# CPU only by design (CUDA_VISIBLE_DEVICES=""; the GPU benchmark sizes are not quick).
# scripts/gpu_check.sh deselects it: on the GPU machine it would repeat the CPU run and
# spend that check's time limit on compiles.

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_demo(tmp_path: Path) -> str:
    out_dir = tmp_path / "out"
    env = dict(os.environ)
    # The package as this test session imports it (a source tree or an installed copy),
    # by absolute path since the demo runs in another working directory.
    package_root = str(Path(posenc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only: the GPU benchmark sizes are not quick
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # a user's environment: torch's default pages
    env.setdefault("MPLBACKEND", "Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "posenc", "demo", "--quick", "--out", str(out_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def table_rows(text: str, header_start: str):
    """Data rows of the table whose header line starts with header_start: the lines after its
    dashed rule, up to the first blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    assert set(lines[start + 1]) == {"-"}, lines[start + 1]
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip() or not line.startswith(("cpu", "cuda")):
            break
        rows.append(line.split())
    return lines[start], rows


def test_demo_quick(tmp_path):
    out = run_demo(tmp_path)

    # Why position matters: without an encoding the two sentences' outputs are the same rows
    # permuted; with posenc they differ. The verdicts come in that order.
    without = out.index("--- without a positional encoding ---")
    with_pe = out.index("--- with posenc.PositionalEncoding ---")
    assert without < with_pe
    verdicts = re.findall(r"outputs for 'dog' and 'man' across the two sentences: (.*)", out)
    assert len(verdicts) == 2, out
    assert verdicts[0].startswith("the same rows, permuted")
    assert verdicts[1].startswith("different")
    # And the printed rows say the same: without an encoding "dog" in "dog bites man" has the
    # row of "dog" in "man bites dog"; with posenc it has not.
    def rows(section):
        table = {}
        for line in section.splitlines():
            m = re.match(r"\s*(dog|bites|man) ((?:[+-]\d\.\d{3} ?){4})\s*\|\s*(dog|bites|man) ((?:[+-]\d\.\d{3} ?){4})", line)
            if m:
                table[("left", m.group(1))] = m.group(2).split()
                table[("right", m.group(3))] = m.group(4).split()
        return table

    plain, encoded = rows(out[without:with_pe]), rows(out[with_pe:])
    assert len(plain) == 6 and len(encoded) == 6
    assert plain[("left", "dog")] == plain[("right", "dog")]
    assert plain[("left", "man")] == plain[("right", "man")]
    assert encoded[("left", "dog")] != encoded[("right", "dog")]
    assert encoded[("left", "man")] != encoded[("right", "man")]

    # The benchmark times what users get (torch's allocator as it comes, for posenc's
    # outputs as for every other variant's) and says so before its tables.
    policy = re.findall(r"^Memory \(CPU\): (.*)$", out, re.MULTILINE)
    assert len(policy) == 1, out
    assert policy[0].startswith("every variant's outputs from torch's allocator on its default pages"), policy[0]
    assert out.index("Memory (CPU)") < out.index("Benchmark: fused")

    # A benchmark table of the fused op, with numbers in its rows, and the RoPE one.
    header, bench = table_rows(out, "device dtype")
    assert "posenc ms" in header and "eager ms" in header and "compile ms" in header
    cases = {" ".join(r[4:6]) for r in bench}
    assert {"eval forward", "train forward", "train backward"} <= cases, bench
    for r in bench:
        assert r[0] == "cpu" and r[1] == "float32"
        assert float(r[6]) > 0 and float(r[9]) > 0  # posenc ms, eager ms
    rope_at = out.index("Benchmark: RoPE")
    header, rope_rows = table_rows(out[rope_at:], "device dtype")
    assert "posenc ms" in header
    assert {r[3] for r in rope_rows} >= {"forward", "backward"}
    assert all(float(r[4]) > 0 for r in rope_rows)

    # The heatmap: a PNG at the printed path, inside the output folder.
    m = re.search(r"Heatmap of the encoding written to (.+\.png)\s*$", out, re.MULTILINE)
    assert m, out
    path = Path(m.group(1).strip())
    assert path.is_absolute() and path.resolve().parent == (tmp_path / "out").resolve()
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 200 and height > 200
