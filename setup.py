"""pip install for users who already have torch: `pip install --no-build-isolation .`

The Python package ships the same CMake-built libposenc that LibTorch apps link; this
file only drives CMake (CUDA kernels when nvcc and a CUDA torch are present, see
POSENC_WITH_CUDA and TORCH_CUDA_ARCH_LIST in the README) and copies the library into
posenc/lib. --no-build-isolation lets the build see the torch it must match.
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


class BuildWithCMake(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            import torch  # noqa: F401
        except ImportError as exc:  # pragma: no cover - a set-up error, explained
            raise RuntimeError(
                "posenc builds against the installed torch: install torch first, then "
                "`pip install --no-build-isolation .`"
            ) from exc
        lib_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DPOSENC_BUILD_TESTS=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "posenc", "-j", jobs])


setup(
    name="posenc",
    version="0.1.0",
    description="Positional encodings for Transformers as fused LibTorch ops (CPU and CUDA)",
    package_dir={"": "python"},
    packages=["posenc"],
    ext_modules=[CMakeLibrary("posenc.lib.libposenc")],
    cmdclass={"build_ext": BuildWithCMake},
    python_requires=">=3.9",
    install_requires=["torch>=2.11"],
    extras_require={"demo": ["matplotlib"]},
    zip_safe=False,
)
