"""Packaging: one version, the torch check before the library loads, typed package."""

import pathlib
import re

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


def test_one_version():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "posenc.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", posenc.__version__)
    cache = ROOT / "build" / "CMakeCache.txt"
    if cache.is_file():  # the CMake build reads the same line
        assert f"CMAKE_PROJECT_VERSION:STATIC={posenc.__version__}" in cache.read_text()
    assert (ROOT / "python" / "posenc" / "py.typed").is_file()
