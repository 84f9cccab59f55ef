"""Smoke test of benchmarks/bench_table.py (issue 37's whole table in one run): one small row,
quick, without torch.compile, in a subprocess; the table's columns and its JSON rows."""
import json
import os
import subprocess
import sys
from pathlib import Path

import posenc

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["op", "case", "dtype", "MB", "posenc ms", "floor ms", "compute ms", "fraction", "eager ms",
           "eager/posenc", "compile ms", "compile/posenc"]


def test_bench_table_quick_row(tmp_path):
    env = dict(os.environ)
    package_root = str(Path(posenc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_table.py"), "--quick", "--small", "--no-compile",
         "--only", "sinusoidal eval forward float32", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"bench_table failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert "allocator:" in lines[0] and "threads" in lines[0] and "median of 3" in lines[0], lines[0]
    header = next(line for line in lines if line.startswith("op "))
    positions = [header.find(name) for name in COLUMNS]
    assert -1 not in positions and positions == sorted(positions), header
    rows = [line for line in lines if line.startswith("add_position ")]
    assert len(rows) == 1 and "sinusoidal eval forward" in rows[0] and "float32" in rows[0], proc.stdout
    data = json.loads(out.read_text())
    assert data["reps"] == 3 and data["threads"] >= 1 and data["allocator"]
    (row,) = data["rows"]
    assert row["op"] == "add_position" and row["dtype"] == "float32"
    assert row["bytes"] > 0 and row["posenc_ms"] > 0 and row["floor_ms"] > 0 and row["eager_ms"] > 0
    assert row["fraction"] > 0 and row["compile_ms"] is None
