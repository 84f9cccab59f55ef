"""Packaging: one version, the torch check before the library loads, typed package."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import posenc
from posenc import _library

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_loaded_library_records_the_running_torch():
    record = _library.LIBRARY_PATH.with_name("posenc_torch_version.txt")
    assert record.read_text().strip() == torch.__version__


def test_a_library_built_for_another_torch_is_refused(tmp_path):
    lib = tmp_path / "libposenc.so"
    lib.write_bytes(b"")
    (tmp_path / "posenc_torch_version.txt").write_text("2.9.1+cu128\n")
    with pytest.raises(ImportError, match=r"built against torch 2\.9\.1\+cu128, but this Python runs torch "
                                          + re.escape(torch.__version__)):
        _library.check_torch_version(lib)
    # The same release recorded without its local part (configured without Python) is fine.
    (tmp_path / "posenc_torch_version.txt").write_text(torch.__version__.split("+")[0])
    _library.check_torch_version(lib)


def test_posenc_library_naming_no_file_is_refused(tmp_path, monkeypatch):
    """POSENC_LIBRARY (the sanitizer runs' library) naming no file: an ImportError naming it
    (the packaged library was loaded in its place, so a typo tested the wrong library)."""
    monkeypatch.setenv("POSENC_LIBRARY", str(tmp_path / "libposenc-typo.so"))
    with pytest.raises(ImportError, match=r"POSENC_LIBRARY=.*libposenc-typo\.so' is not a file"):
        _library._candidates()
    lib = tmp_path / "libposenc.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("POSENC_LIBRARY", str(lib))
    assert _library._candidates() == [lib]


def test_one_version():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "posenc.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", posenc.__version__)
    cache = ROOT / "build" / "CMakeCache.txt"
    if cache.is_file():  # the CMake build reads the same line
        assert f"CMAKE_PROJECT_VERSION:STATIC={posenc.__version__}" in cache.read_text()
    assert (ROOT / "python" / "posenc" / "py.typed").is_file()


def test_the_loaded_library_has_a_clean_runpath():
    """Issue 23: each RUNPATH entry of the library this Python loaded (make's copy in
    python/posenc/lib, or an installed one) is an existing directory, absolute or under
    $ORIGIN: no empty entry (the loader reads it as the working directory, where a planted
    libc10.so would be loaded), no relative one, and none of the link line's absent
    directories (CMake's build RPATH had torch's /lib/intel64 and an empty entry)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    lib = _library.LIBRARY_PATH
    dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    runpaths = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dynamic)
    for entry in ":".join(runpaths).split(":") if runpaths else []:
        assert entry.startswith(("/", "$ORIGIN")), f"{lib}: RUNPATH entry {entry!r} in {runpaths}"
        where = entry.replace("$ORIGIN", str(lib.parent), 1)
        assert os.path.isdir(where), f"{lib}: RUNPATH entry {entry!r} is not a directory (in {runpaths})"
