"""Loads libposenc, the one compiled library that also serves LibTorch apps.

The library registers the ``torch.ops.posenc`` operators (schemas, CPU/CUDA/Meta kernels
and autograd, all in C++) when it is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAMES = ("libposenc.so", "libposenc.dylib", "posenc.dll")


def _candidates() -> list[Path]:
    found = []
    env = os.environ.get("POSENC_LIBRARY")
    if env:
        found.append(Path(env))
    here = Path(__file__).resolve().parent
    for folder in (here / "lib", here):
        found.extend(folder / name for name in _LIB_NAMES)
    return found


def load() -> Path:
    """Load libposenc once; returns the path it was loaded from."""
    for path in _candidates():
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    raise ImportError(
        "posenc: could not find the compiled library libposenc (looked in "
        + ", ".join(str(p) for p in _candidates())
        + "). Build it with `make build` or install the package with `pip install .` (torch installed first)."
    )


LIBRARY_PATH = load()
