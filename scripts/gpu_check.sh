#!/usr/bin/env bash
# The GPU machine's one call (the `device` tool): build posenc from source for sm_90, run
# every test (the CUDA ones run there, skip here), then the GPU benchmarks. Expected
# under 6 minutes: the library build (about a minute on 16 cores; limit 240 s), the C++
# tests when GoogleTest is carried (well under a minute), then steps limited to 120, 100,
# 70 and 90 s, each leaving its log in $OUT even when stopped (the benchmarks print each
# shape's rows as they go). Give the run tool's call 540 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}"
export PYTHONPATH="$PWD/python"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
# torch must see the GPU: otherwise every cuda test skips, the benchmarks skip their CUDA part,
# and the run would end in success having run nothing (a driver older than the wheel's CUDA
# runtime, say).
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); \
assert torch.cuda.is_available(), 'torch sees no GPU: nothing would run'" 2>&1 | tee -a "$OUT/gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check.sh: torch sees no GPU (above); stopping"; exit 1; }

echo "== build"
start=$(date +%s)
configure() {  # configure LOG [cmake arguments...]
  local log="$OUT/$1"
  shift
  cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DPOSENC_WITH_CUDA=ON -DPOSENC_INSTALL_PYTHON_LIB=ON "$@" > "$log" 2>&1
}
# The C++ tests too when GoogleTest sources were carried (scripts/fetch_gtest_source.sh).
# Only the library is fatal: a failed configure with the tests falls back to one without,
# and the tests build after the library, costing only themselves if they fail.
gtests=0
if [ -f third_party/googletest/CMakeLists.txt ]; then
  if configure configure_gtest.log -DPOSENC_BUILD_TESTS=ON \
       -DPOSENC_GTEST_SOURCE_DIR="$PWD/third_party/googletest"; then
    gtests=1
  else
    echo "configure with the C++ tests failed (configure_gtest.log); going on without them"
    rm -rf build-gpu
  fi
fi
if [ "$gtests" = 0 ]; then
  configure configure.log -DPOSENC_BUILD_TESTS=OFF || { tail -30 "$OUT/configure.log"; exit 1; }
fi
timeout -k 10 240 cmake --build build-gpu -j "$(nproc)" --target posenc > "$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
echo "library built in $(( $(date +%s) - start )) s"
if [ "$gtests" = 1 ]; then
  echo "== C++ tests"
  if timeout -k 10 120 cmake --build build-gpu -j "$(nproc)" --target posenc_tests \
       > "$OUT/build_gtest.log" 2>&1; then
    timeout -k 10 60 build-gpu/posenc_tests --gtest_brief=1 > "$OUT/gtest.log" 2>&1 || status=1
    tail -8 "$OUT/gtest.log"
  else
    echo "the C++ tests did not build (build_gtest.log):"; tail -20 "$OUT/build_gtest.log"; status=1
  fi
fi
# Registers, shared memory and spills of every kernel, for the notes.
cuobjdump --dump-resource-usage build-gpu/libposenc.so > "$OUT/resource_usage.txt" 2>&1 || true

echo "== tests (CUDA kernels: every test marked cuda but torch.compile / torch.export)"
# Order: kernel correctness first, then the benchmarks, then the compile and export tests,
# whose first (cold-cache) Triton compilations are the slowest part; each has its own limit
# so that a slow step still leaves the others' results in $OUT. Only the CUDA tests run
# here (every CUDA test carries the cuda marker, tests/python/conftest.py); the CPU
# ones are CI's, on every commit, and would only spend the device's minutes.
timeout -k 10 120 "$PY" -m pytest tests/python -q -p no:cacheprovider -rfE --durations=10 \
  -m cuda -k "not test_compile and not test_export" > "$OUT/pytest.log" 2>&1 || status=1
tail -25 "$OUT/pytest.log"

echo "== benchmark"
# --quick: the first shape per dtype (the larger ones too would not fit the 6-minute call
# with torch.compile of every reference).
timeout -k 10 100 "$PY" benchmarks/bench_add_position.py --device cuda --quick --json "$OUT/bench.json" \
  > "$OUT/bench.txt" 2>&1 || status=1
grep -v "^W[0-9]" "$OUT/bench.txt" | tail -20
# RoPE at (8, 4096, 32, 8, 128) bfloat16 (--quick: bfloat16 only). A Liger-Kernel wheel in
# benchmarks/wheels (scripts/fetch_liger_wheel.sh, carried to the device) is unpacked onto
# the path for the comparison; without one the benchmark says so and goes on.
for wheel in benchmarks/wheels/liger_kernel-*.whl; do
  [ -f "$wheel" ] || continue
  rm -rf build-gpu/wheels && mkdir -p build-gpu/wheels
  "$PY" -m zipfile -e "$wheel" build-gpu/wheels && export PYTHONPATH="$PYTHONPATH:$PWD/build-gpu/wheels"
done
timeout -k 10 70 "$PY" benchmarks/bench_rope.py --device cuda --quick --json "$OUT/bench_rope.json" \
  > "$OUT/bench_rope.txt" 2>&1 || status=1
grep -v "^W[0-9]" "$OUT/bench_rope.txt" | tail -8

echo "== tests (torch.compile / torch.export on CUDA)"
timeout -k 10 90 "$PY" -m pytest tests/python -q -p no:cacheprovider -rfE --durations=10 \
  -m cuda -k "test_compile or test_export" > "$OUT/pytest_compile.log" 2>&1 || status=1
tail -20 "$OUT/pytest_compile.log"
exit $status
