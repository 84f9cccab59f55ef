#!/usr/bin/env bash
# Builds examples/cpp against the *installed* posenc package (find_package(posenc)) and
# runs them: each app trains a tiny model and fails unless it learns its task.
set -euo pipefail
prefix="$1"; python="$2"
root="$(cd "$(dirname "$0")/../.." && pwd)"
torch_dir="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch"
build="$root/build/example-app"
cmake -S "$root/examples/cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -Dposenc_DIR="$prefix/lib/cmake/posenc" -DTorch_DIR="$torch_dir" > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "${MAX_JOBS:-2}"
"$build/train_order"
"$build/rope_order"
