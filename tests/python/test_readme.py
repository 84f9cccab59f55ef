"""The README is a guide of at most 200 lines whose every code block runs: its Python example
is executed here and its numbers checked against float64 references written from the formulas;
its C++ example is examples/cpp/quickstart.cpp (built against the installed package and run by
`make test`, tests/cpp/run_example.sh), its CMake lines are that app's, its make targets exist,
and every link it holds points at a file of the repository. The longer examples live in docs/
(tests/python/test_docs.py runs them)."""

import math
import pathlib
import re

import torch

from rope_reference import reference_inv_freq, reference_rope

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_is_a_short_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the guide keeps to 200 (details go to docs/)"
    # On the first screen: the install command and the Python example.
    first_screen = "\n".join(lines[:60])
    assert "pip install" in first_screen and "```python" in first_screen


def test_readme_python_example_runs_and_gives_the_formulas_numbers():
    (block,) = blocks("python")
    *head, last = block.rstrip("\n").split("\n")
    assert last.startswith("q, k = rope(q, k)")
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile("\n".join(head), "README.md (Python example)", "exec"), ns)
    x, y, q0, k0 = ns["x"], ns["y"], ns["q"].clone(), ns["k"].clone()
    exec(compile(last, "README.md (Python example, last line)", "exec"), ns)
    # The sinusoidal table, from the formula in float64: pe[p, 2i] = sin(p / 10000^(2i/d)), pe[p, 2i+1] = cos.
    d, seq = 512, x.shape[1]
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pe = torch.stack((angle.sin(), angle.cos()), -1).flatten(-2)
    want = (x.double() + pe) / 0.9  # a module a user just built trains: dropout p = 0.1 is on
    kept = y != 0
    assert 0.85 < kept.double().mean().item() < 0.95
    torch.testing.assert_close(y[kept].double(), want[kept], atol=1e-5, rtol=1e-6)
    # RoPE with llama3 scaling, against the float64 reference of Hugging Face's formulas.
    inv_freq, attn = reference_inv_freq(128, 500000.0, ns["llama3"])
    positions = torch.arange(seq).expand(2, seq)
    torch.testing.assert_close(ns["q"].double(), reference_rope(q0, "bshd", positions, inv_freq, 128, False, attn),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ns["k"].double(), reference_rope(k0, "bshd", positions, inv_freq, 128, False, attn),
                               atol=1e-5, rtol=1e-5)
    assert math.isclose(attn, 1.0)


def test_readme_cpp_example_is_the_app_make_test_runs():
    (cpp,) = blocks("cpp")
    assert (ROOT / "examples/cpp/quickstart.cpp").read_text() == cpp
    (cmake,) = blocks("cmake")
    app_cmake = (ROOT / "examples/cpp/CMakeLists.txt").read_text()
    for line in cmake.splitlines():
        code = line.split("#")[0].strip()
        assert code in app_cmake, f"README's CMake line {code!r} is not in examples/cpp/CMakeLists.txt"
    assert '"$build/quickstart"' in (ROOT / "tests/cpp/run_example.sh").read_text()


def test_readme_make_targets_and_links_exist():
    makefile = (ROOT / "Makefile").read_text()
    for block in blocks("bash"):
        for target in re.findall(r"^make (\S+)", block, flags=re.M):
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no make target {target!r}"
    for link in re.findall(r"\]\(([^)#][^)]*)\)", README.read_text()):
        if "://" not in link:
            assert (ROOT / link.split("#")[0]).exists(), f"README links to {link}, which does not exist"
