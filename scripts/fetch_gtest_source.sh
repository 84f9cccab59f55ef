#!/usr/bin/env bash
# Copies this machine's GoogleTest sources (Debian's libgtest-dev, /usr/src/googletest) to
# third_party/googletest (git-ignored), for the GPU machine, which has no GoogleTest: give
# the device call carry=["third_party/googletest", ...] and scripts/gpu_check.sh builds and
# runs the C++ tests (their CUDA cases included) there too.
set -euo pipefail
cd "$(dirname "$0")/.."
src=/usr/src/googletest
[ -f "$src/CMakeLists.txt" ] || { echo "no GoogleTest sources at $src (apt-get install libgtest-dev)"; exit 1; }
rm -rf third_party/googletest
mkdir -p third_party
cp -r "$src" third_party/googletest
echo "copied $(du -sh third_party/googletest | cut -f1) of GoogleTest sources to third_party/googletest"
