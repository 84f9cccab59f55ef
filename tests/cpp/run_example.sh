#!/usr/bin/env bash
# Builds examples/cpp against the *installed* posenc package (find_package(posenc)) and
# runs them: each app trains a tiny model and fails unless it learns its task. Then the
# deploy example: Python exports a model (AOTInductor package, TorchScript trace) and the
# C++ app deploy_model, which links posenc::posenc but calls none of its functions, loads
# both and checks them against Python's outputs (issue 22).
set -euo pipefail
prefix="$1"; python="$2"
root="$(cd "$(dirname "$0")/../.." && pwd)"
torch_dir="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch"
build="$root/build/example-app"
mkdir -p "$root/build"  # a fresh copy's (scripts/check_torch.sh) has none: the logs go there
# The installed package names no directory of the machine that built it: the -rpath-link to
# torch's CUDA libraries is computed from the torch the application finds (posencConfig.cmake).
! grep -n "$root\|site-packages" "$prefix"/lib/cmake/posenc/posencTargets*.cmake ||
  { echo "the installed posencTargets names this machine's paths (above)"; exit 1; }
cmake -S "$root/examples/cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -Dposenc_DIR="$prefix/lib/cmake/posenc" -DTorch_DIR="$torch_dir" > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "${MAX_JOBS:-2}"
"$build/quickstart" | grep -qx '\[2, 100, 512\] \[2, 100, 32, 128\] \[2, 100, 8, 128\]' ||
  { echo "quickstart (the README's C++ example) printed:"; "$build/quickstart"; exit 1; }
"$build/train_order"
"$build/rope_order"
"$build/kv_cache_decode"

# Linked with the default flags (GNU ld --as-needed on Debian), the app that only loads
# models must still list libposenc as NEEDED, or its ops are never registered.
readelf -d "$build/deploy_model" | grep -q 'NEEDED.*\[libposenc\.so\]' ||
  { echo "deploy_model does not list libposenc.so as NEEDED:"; readelf -d "$build/deploy_model"; exit 1; }
artefacts="$build/deploy-artefacts"
"$python" "$root/examples/deploy/export_model.py" "$artefacts"
# AOTInductor's runner logs an op's error to stderr (its exception says only "API call
# failed"): the out-of-range position must show posenc's own message there.
"$build/deploy_model" "$artefacts" 2> "$build/deploy_model.stderr" ||
  { tail -40 "$build/deploy_model.stderr"; exit 1; }
# (torch 2.15's runner prints only "API call failed": the message is checked against the
# pinned torch of requirements-dev.txt, which prints it; scripts/check_torch.sh runs others.)
pinned="$(sed -n 's/^torch==//p' "$root/requirements-dev.txt")"
running="$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')"
if ! grep -q 'posenc: expected positions in \[0, max_len=1024)' "$build/deploy_model.stderr"; then
  if [ "$running" = "$pinned" ]; then
    echo "deploy_model: posenc's IndexError message is not in the AOTInductor log:"; tail -40 "$build/deploy_model.stderr"; exit 1
  fi
  echo "deploy_model: torch $running's AOTInductor log does not show posenc's message (torch $pinned's does)"
fi

# The installed package on a machine without the CUDA toolkit (docs/install.md): the
# quickstart configured, built and run with the toolkit hidden. It links the application's own
# torch libraries (posencConfig.cmake), not the paths of the machine that built posenc (the
# exported target named this build's libnvrtc.so, which the app's build then required).
nt="$root/build/example-app-no-toolkit"
rm -rf "$nt"
bash "$root/tests/python/without_cuda_toolkit.sh" bash -c "
  cmake -S '$root/examples/cpp' -B '$nt' -G Ninja -DCMAKE_BUILD_TYPE=Release -Dposenc_DIR='$prefix/lib/cmake/posenc' \
    -DTorch_DIR='$torch_dir' > '$nt.configure.log' 2>&1 &&
  cmake --build '$nt' --target quickstart -j ${MAX_JOBS:-2} > '$nt.build.log' 2>&1" ||
  { echo "the installed package without a CUDA toolkit:"; tail -30 "$nt.configure.log" "$nt.build.log" 2>/dev/null; exit 1; }
"$nt/quickstart" | grep -qx '\[2, 100, 512\] \[2, 100, 32, 128\] \[2, 100, 8, 128\]' ||
  { echo "quickstart built without a toolkit printed:"; "$nt/quickstart"; exit 1; }

# A Torch of another release than the one posenc was built against: find_package(posenc)
# fails and says both (the C++ ABI changes between releases). The package copied with its
# recorded torch version changed stands in for an application's other torch.
other="$(mktemp -d)"
trap 'rm -rf "$other"' EXIT
cp -r "$prefix/." "$other/"
sed -i 's/^set(posenc_TORCH_VERSION "[^"]*")/set(posenc_TORCH_VERSION "1.0.0")/' "$other/lib/cmake/posenc/posencConfig.cmake"
if cmake -S "$root/examples/cpp" -B "$other/app" -G Ninja -Dposenc_DIR="$other/lib/cmake/posenc" \
     -DTorch_DIR="$torch_dir" > "$other/configure.log" 2>&1; then
  echo "find_package(posenc) accepted a Torch of another release"; exit 1
fi
grep -q "posenc was built against torch 1.0.0, but the Torch found is" "$other/configure.log" ||
  { echo "find_package(posenc) with another torch:"; tail -20 "$other/configure.log"; exit 1; }

# A CPU-only torch of the same release beside a posenc built with its CUDA kernels: refused by
# find_package, naming it (it failed at link or load time). A stand-in Torch_DIR runs the real
# TorchConfig and then forgets its CUDA library, as a CPU-only torch's config never finds it.
if grep -q "^set(posenc_WITH_CUDA ON)" "$prefix/lib/cmake/posenc/posencConfig.cmake"; then
  cpu_torch="$other/cpu-torch"
  mkdir -p "$cpu_torch"
  cp "$torch_dir/TorchConfigVersion.cmake" "$cpu_torch/"
  printf 'include("%s/TorchConfig.cmake")\nunset(C10_CUDA_LIBRARY CACHE)\nunset(C10_CUDA_LIBRARY)\n' "$torch_dir" \
    > "$cpu_torch/TorchConfig.cmake"
  if cmake -S "$root/examples/cpp" -B "$other/cpu-app" -G Ninja -Dposenc_DIR="$prefix/lib/cmake/posenc" \
       -DTorch_DIR="$cpu_torch" > "$other/cpu-configure.log" 2>&1; then
    echo "find_package(posenc) accepted a CPU-only torch for a CUDA build"; exit 1
  fi
  grep -q "has no CUDA libraries" "$other/cpu-configure.log" ||
    { echo "find_package(posenc) with a CPU-only torch:"; tail -20 "$other/cpu-configure.log"; exit 1; }
fi
echo "run_example.sh: ok"
