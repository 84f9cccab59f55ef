#!/usr/bin/env bash
# Builds posenc against another torch release and runs its tests there: the library must
# build against torch 2.11 and newer, while CI runs the pinned release (requirements-dev.txt).
#   usage: scripts/check_torch.sh <torch version, e.g. 2.15.0> [work dir, default /tmp/posenc-torch-<version>]
# In the work dir: a venv with torch==<version> from PyPI (its CUDA build: about 5 GB) and the
# test requirements, a copy of the committed sources (git archive HEAD), built there with
# CMake (the CUDA kernels too where nvcc is found) and installed into the copy's python/posenc/lib;
# then the copy's ctest, C++ examples and Python suite. Peers (transformers, ...) are not installed,
# so their tests skip. Nothing in this checkout changes. About 15 minutes on 2 cores once
# torch's wheels are in pip's cache.
set -euo pipefail
version="${1:?usage: scripts/check_torch.sh <torch version> [work dir]}"
work="${2:-/tmp/posenc-torch-$version}"
root="$(cd "$(dirname "$0")/.." && pwd)"
jobs="${MAX_JOBS:-2}"

# The script deletes its own src/ and build/ there: a work dir it did not make (a marker file
# says it did) must be new or empty.
if [ -d "$work" ] && [ ! -f "$work/.check_torch" ] && [ -n "$(ls -A "$work")" ]; then
  echo "check_torch.sh: $work exists and was not made by this script; pass a new or empty work dir" >&2
  exit 2
fi
mkdir -p "$work"
work="$(cd "$work" && pwd)"  # absolute: the tests run from inside it
case "$work/" in
  "$root/"*) echo "check_torch.sh: the work dir must lie outside this checkout ($root)" >&2; exit 2 ;;
esac
touch "$work/.check_torch"
if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
fi
# The test requirements (requirements-dev.txt) with that torch instead of the pinned one; not
# the peers (requirements-peers.txt pins torchvision for the pinned torch): their tests skip.
grep -v '^torch==' "$root/requirements-dev.txt" > "$work/requirements.txt"
"$work/venv/bin/pip" install -q "torch==$version" -r "$work/requirements.txt"
"$work/venv/bin/python" -c "import torch; print('check_torch.sh: torch', torch.__version__)"

rm -rf "$work/src" "$work/build"
mkdir -p "$work/src"
git -C "$root" archive HEAD | tar -x -C "$work/src"
cmake -S "$work/src" -B "$work/build" -G Ninja -DPython3_EXECUTABLE="$work/venv/bin/python" \
  -DPOSENC_INSTALL_PYTHON_LIB=ON -DCMAKE_INSTALL_PREFIX="$work/install" > "$work/configure.log"
cmake --build "$work/build" -j "$jobs"
cmake --install "$work/build" > /dev/null
# As `make test`: ctest (GoogleTest, the CUDA kernels' resources and SASS), the C++ examples
# against the installed CMake package (run_example.sh), then the Python suite.
export PYTHONPATH="$work/src/python" MAX_JOBS="$jobs"
ctest --test-dir "$work/build" --output-on-failure
bash "$work/src/tests/cpp/run_example.sh" "$work/install" "$work/venv/bin/python"
cd "$work/src"
"$work/venv/bin/python" -m pytest tests/python -q -p no:cacheprovider -n "$jobs"
echo "check_torch.sh: posenc builds and passes its tests against torch $version"
