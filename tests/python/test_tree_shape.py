"""The tree against CONTRIBUTING.md's map ("Where things live"): every op family has the one
shape (each file in a role of the roles table), at most 10 library files of its own, and
every library file belongs to exactly one row of the family table, so the map cannot drift
from the tree."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
# What counts as the library: its sources in the places the project's design names
# (the built library under python/posenc/lib is not a source).
LIBRARY_GLOBS = ("csrc/**/*", "cuda/**/*", "python/posenc/**/*")
MAX_FILES_PER_FAMILY = 10


def _library_files() -> set[str]:
    files = set()
    for pattern in LIBRARY_GLOBS:
        for path in ROOT.glob(pattern):
            rel = path.relative_to(ROOT).as_posix()
            if path.is_file() and "__pycache__" not in rel and not rel.startswith("python/posenc/lib/"):
                files.add(rel)
    return files


def _table(text: str, start: str, end: str) -> list[list[str]]:
    body = text[text.index(start) + len(start): text.index(end, text.index(start))]
    rows = []
    for line in body.strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue
        rows.append(cells)
    return rows[1:]  # without the header


def _families() -> dict[str, list[str]]:
    text = CONTRIBUTING.read_text()
    rows = _table(text, "<!-- tree-shape -->", "<!-- /tree-shape -->")
    return {name.split(" (")[0]: re.findall(r"`([^`]+)`", files) for name, files in rows}


def _role_patterns() -> list[str]:
    """The file patterns of the roles table (`<family>` as a placeholder)."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Where things live"): text.index("<!-- tree-shape -->")]
    return [p for row in _table(section, "The roles:", "\n\nThe families") for p in re.findall(r"`([^`]+)`", row[1])]


FAMILIES = _families()
OPS = [name for name in FAMILIES if name not in ("shared", "helpers")]


def test_the_map_has_the_families_of_the_tree():
    folders = {p.name for p in (ROOT / "csrc/ops").iterdir() if p.is_dir() and p.name != "common"}
    assert folders == set(FAMILIES) - {"shared"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"shared"}))
def test_each_family_has_at_most_10_files_and_they_exist(family):
    files = FAMILIES[family]
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"{family}: listed in CONTRIBUTING.md but not in the tree: {missing}"
    assert len(files) <= MAX_FILES_PER_FAMILY, f"{family}: {len(files)} files: {files}"


@pytest.mark.parametrize("family", OPS)
def test_each_op_family_file_has_a_role(family):
    patterns = [p.replace("<family>", family) for p in _role_patterns()]
    assert len(patterns) >= 9, patterns
    strays = [f for f in FAMILIES[family] if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not strays, f"{family}: files outside the shape's roles: {strays}"


def test_every_library_file_belongs_to_exactly_one_row():
    files = _library_files()
    owners = {f: [name for name, patterns in FAMILIES.items() if any(fnmatch.fnmatch(f, p) for p in patterns)]
              for f in files}
    unowned = sorted(f for f, o in owners.items() if not o)
    assert not unowned, f"library files in no row of CONTRIBUTING.md's map: {unowned}"
    twice = {f: o for f, o in owners.items() if len(o) > 1}
    assert not twice, f"library files in two rows: {twice}"


# The CUDA translation units stay free of ATen's tensor and dispatcher headers (CONTRIBUTING.md,
# "Conventions"): with them nvcc spent 35-47 s on each (it parses a unit three times), without
# them 3-19 s. Every header a .cu reaches, through posenc's own headers too, is a standard or
# CUDA runtime header, c10's plain utilities, or one of ATen's light CUDA headers.
ALLOWED_SYSTEM_INCLUDES = ("c10/util/", "c10/macros/", "cuda_runtime", "cuda_fp16", "cuda_bf16",
                           "ATen/cuda/PhiloxUtils.cuh", "ATen/cuda/PhiloxCudaState.h",
                           "ATen/cuda/detail/IntegerDivider.cuh", "c10/core/ScalarType.h")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def _reached_includes(source: Path) -> dict[str, str]:
    """Every system header reached from `source` through posenc's own (quoted) headers: header -> the
    posenc file that includes it."""
    roots = [ROOT / "csrc/include", ROOT / "csrc", ROOT]
    seen_files, found, todo = set(), {}, [source]
    while todo:
        path = todo.pop()
        if path in seen_files:
            continue
        seen_files.add(path)
        for kind, name in INCLUDE.findall(path.read_text()):
            local = [p for p in [path.parent / name] + [r / name for r in roots] if p.is_file()] if kind == '"' else []
            if local:
                todo.append(local[0].resolve())
            else:
                found.setdefault(name, path.relative_to(ROOT).as_posix())
    return found


@pytest.mark.parametrize("source", sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("cuda/*/*.cu")))
def test_cuda_sources_reach_no_aten_tensor_header(source):
    heavy = {name: via for name, via in _reached_includes((ROOT / source).resolve()).items()
             if "/" in name and not name.startswith(ALLOWED_SYSTEM_INCLUDES)}
    assert not heavy, f"{source} reaches {heavy} (header: the posenc file that includes it)"


def test_the_include_check_sees_a_heavy_header():
    """The check itself: the family's ATen-side header does reach ATen's tensor headers."""
    heavy = [n for n in _reached_includes(ROOT / "csrc/ops/rope_append_kv/rope_append_kv.h")
             if "/" in n and not n.startswith(ALLOWED_SYSTEM_INCLUDES)]
    assert "ATen/ATen.h" in heavy
