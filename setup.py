"""pip install for users who already have torch: `pip install .`

The Python package ships the same CMake-built libposenc that LibTorch apps link; this
file only drives CMake (CUDA kernels when nvcc and a CUDA torch are present, see
POSENC_WITH_CUDA and TORCH_CUDA_ARCH_LIST in the README; without nvcc a CPU-only library,
also with a CUDA torch) and builds the library straight into posenc/lib. The library must
be built against the torch it will run with, the one installed beside this Python: pip's
build isolation hides it (an overlay on PYTHONPATH), so CMake runs this same interpreter
without the overlay. `--no-build-isolation` works too, and so does `python -m build --wheel
--no-isolation`; `python -m build`'s own isolation cannot (a separate venv, without torch).
The package requires exactly that torch release (torch==X.Y.Z), as torchvision's does: the
library uses torch's C++ ABI.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeLibrary(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def torch_environment() -> dict:
    """The environment in which this interpreter imports the user's torch: the current one,
    or, inside pip's isolated build (whose PYTHONPATH overlay hides site-packages), the
    current one without the overlay."""
    probe = [sys.executable, "-c", "import torch"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return dict(os.environ)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    if subprocess.run(probe, env=env, capture_output=True).returncode == 0:
        return env
    raise RuntimeError(
        f"posenc builds against the installed torch, which {sys.executable} cannot import: "
        "install torch first (then `pip install .`, or `pip install --no-build-isolation .`); "
        "`python -m build` needs --no-isolation (its isolated build runs in a venv of its own, "
        "which has no torch)"
    )


def torch_version(env: dict) -> str:
    """The release of the torch the library is built against, without its local part
    (2.11.0 for 2.11.0+cu130): pip knows PyPI's torch by the release only."""
    probe = [sys.executable, "-c", "import torch; print(torch.__version__)"]
    version = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
    return version.strip().split("+")[0]


def build_tool(module: str, attribute: str, name: str) -> str:
    """cmake and ninja from their PyPI packages (pyproject's build requirements, which pip
    installs into the isolated build environment) by the path of the binary itself: their
    `cmake`/`ninja` scripts import the package, which the build without the overlay (see
    torch_environment) cannot. Without the package (--no-build-isolation), the one on PATH."""
    try:
        package = __import__(module)
        binary = Path(getattr(package, attribute)) / name
        if binary.is_file():
            return str(binary)
    except ImportError:
        pass
    return shutil.which(name) or name


class BuildWithCMake(build_ext):
    def build_extension(self, ext: Extension) -> None:
        env = torch_environment()
        lib_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = build_tool("cmake", "CMAKE_BIN_DIR", "cmake")
        ninja = build_tool("ninja", "BIN_DIR", "ninja")
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DPOSENC_BUILD_TESTS=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            # Built in place with the installed RUNPATH: site-packages/posenc/lib finds
            # site-packages/torch/lib, wherever site-packages is; no build-machine path.
            "-DPOSENC_RELATIVE_RPATH=ON",
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        ]
        if Path(ninja).is_file():
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        subprocess.check_call(configure, env=env)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call([cmake, "--build", str(build_dir), "--target", "posenc", "-j", jobs],
                              env=env)


# Metadata (name, version) lives in pyproject.toml; this file adds the CMake-built library
# and the torch it requires (pyproject's `dependencies` is dynamic for that).
setup(
    install_requires=[f"torch=={torch_version(torch_environment())}"],
    ext_modules=[CMakeLibrary("posenc.lib.libposenc")],
    cmdclass={"build_ext": BuildWithCMake},
)
