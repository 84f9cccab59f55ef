"""conftest.py's collection guard: a test that needs a GPU says so with the cuda marker, or
collection fails, so no CUDA code hides from the GPU run (scripts/gpu_check.sh selects -m
cuda; CI has no GPU). Each case collects a small test file in a subprocess with this
directory's conftest loaded as a plugin."""
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(HERE, "..", "..", "python")

CASES = {
    "unmarked_branch": ("""
        import torch
        def test_x():
            if torch.cuda.is_available():
                assert torch.ones(1, device="cuda").item() == 1
        """, "tests torch.cuda.is_available() in its body but has no cuda marker"),
    "unmarked_skipif": ("""
        import pytest, torch
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        def test_x():
            pass
        """, "skips without CUDA but has no cuda marker"),
    "marked_branch": ("""
        import pytest, torch
        @pytest.mark.cuda
        def test_x():
            if torch.cuda.is_available():
                pass
        """, None),
    "plain": ("""
        def test_x():
            assert 1 + 1 == 2
        """, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_collection_guard(name, tmp_path):
    source, error = CASES[name]
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, PYTHON_DIR, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "conftest",
                        "-p", "no:cacheprovider", str(tmp_path / "test_case.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    if error is None:
        assert r.returncode == 0, out
        assert "test_case.py::test_x" in out, out
    else:
        assert r.returncode != 0, out
        assert error in out, out
