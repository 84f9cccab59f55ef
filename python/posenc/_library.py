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
        if not Path(env).is_file():  # a typo would load the packaged library in its place, unnoticed
            raise ImportError(f"posenc: POSENC_LIBRARY={env!r} is not a file (it names the libposenc to load)")
        return [Path(env)]  # that library or none
    here = Path(__file__).resolve().parent
    for folder in (here / "lib", here):
        found.extend(folder / name for name in _LIB_NAMES)
    return found


def _same_torch(built: str, running: str) -> bool:
    """A build records torch.__version__ (e.g. 2.11.0+cu130), or only the release when it was
    configured without Python."""
    return built == running or ("+" not in built and built == running.split("+")[0])


def check_torch_version(path: Path) -> None:
    """ImportError when libposenc at `path` was built against another torch than the running
    one (the build writes posenc_torch_version.txt beside the library): the ABI is torch's
    and changes between releases, so loading it would fail with undefined symbols, or run
    with mismatched data structures."""
    record = path.with_name("posenc_torch_version.txt")
    if not record.is_file():
        return  # built by hand without the record: nothing to compare
    built = record.read_text().strip()
    if built and not _same_torch(built, torch.__version__):
        raise ImportError(
            f"posenc: {path} was built against torch {built}, but this Python runs torch "
            f"{torch.__version__}; rebuild posenc for this torch (`make build`, or "
            f"`pip install --force-reinstall --no-deps .`)"
        )


def load() -> Path:
    """Load libposenc once; returns the path it was loaded from."""
    for path in _candidates():
        if path.is_file():
            check_torch_version(path)
            try:
                torch.ops.load_library(str(path))
            except OSError as e:
                raise ImportError(
                    f"posenc: could not load {path} ({e}); it may have been built against another "
                    f"torch than {torch.__version__}: rebuild it (`make build` or `pip install .`)"
                ) from e
            return path
    raise ImportError(
        "posenc: could not find the compiled library libposenc (looked in "
        + ", ".join(str(p) for p in _candidates())
        + "). Build it with `make build` or install the package with `pip install .` (torch installed first)."
    )


LIBRARY_PATH = load()
