#!/usr/bin/env bash
# The GPU machine's one call (the `device` tool): build posenc from source for sm_90, run
# every test (the CUDA ones run there, skip here), then the GPU benchmarks. Under 6 minutes:
# the build (about 1 minute on 16 cores) plus step limits of 120 + 100 + 70 + 90 s; the
# benchmarks print each shape's rows as they go, so a limit reached still leaves numbers.
# Give the run tool's call 420 s.
# Logs and the benchmark JSON go to $OUT (the device tool brings that folder back).
#   device: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONPATH="$PWD/python"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

echo "== build"
start=$(date +%s)
configure() {
  cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DPOSENC_WITH_CUDA=ON -DPOSENC_INSTALL_PYTHON_LIB=ON "$@" > "$OUT/configure.log" 2>&1
}
# The C++ tests too when GoogleTest sources were carried (scripts/fetch_gtest_source.sh);
# should that configure fail, the library and the Python tests still go ahead without them.
gtests=0
if [ -f third_party/googletest/CMakeLists.txt ] &&
   configure -DPOSENC_BUILD_TESTS=ON -DPOSENC_GTEST_SOURCE_DIR="$PWD/third_party/googletest"; then
  gtests=1
else
  rm -rf build-gpu
  configure -DPOSENC_BUILD_TESTS=OFF || { tail -30 "$OUT/configure.log"; exit 1; }
fi
cmake --build build-gpu -j "$(nproc)" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s (C++ tests: $gtests)"
if [ "$gtests" = 1 ]; then
  echo "== C++ tests"
  timeout 60 build-gpu/posenc_tests --gtest_brief=1 > "$OUT/gtest.log" 2>&1 || status=1
  tail -8 "$OUT/gtest.log"
fi
# Registers, shared memory and spills of every kernel, for the notes.
cuobjdump --dump-resource-usage build-gpu/libposenc.so > "$OUT/resource_usage.txt" 2>&1 || true

echo "== tests (kernels: everything but torch.compile / torch.export)"
# Order: kernel correctness first, then the benchmarks, then the compile and export tests,
# whose first (cold-cache) Triton compilations are the slowest part; each has its own limit
# so that a slow step still leaves the others' results in $OUT.
timeout 120 "$PY" -m pytest tests/python -q -p no:cacheprovider -rfE --durations=10 \
  -k "not test_compile and not test_export and not test_demo" > "$OUT/pytest.log" 2>&1 || status=1
tail -25 "$OUT/pytest.log"

echo "== benchmark"
# --quick: the 1 GiB shape per dtype (the 2 GiB ones too would not fit the 6-minute call
# with torch.compile of every reference).
timeout 100 "$PY" benchmarks/bench_add_position.py --device cuda --quick --json "$OUT/bench.json" \
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
timeout 70 "$PY" benchmarks/bench_rope.py --device cuda --quick --json "$OUT/bench_rope.json" \
  > "$OUT/bench_rope.txt" 2>&1 || status=1
grep -v "^W[0-9]" "$OUT/bench_rope.txt" | tail -8

echo "== tests (torch.compile / torch.export)"
timeout 90 "$PY" -m pytest tests/python -q -p no:cacheprovider -rfE --durations=10 \
  -k "test_compile or test_export" > "$OUT/pytest_compile.log" 2>&1 || status=1
tail -20 "$OUT/pytest_compile.log"
exit $status
