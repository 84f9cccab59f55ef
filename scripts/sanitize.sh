#!/usr/bin/env bash
# `make test-sanitize`: AddressSanitizer + UndefinedBehaviorSanitizer. Builds a CPU-only
# libposenc (and the GoogleTest binary) with -fsanitize=address,undefined in build-sanitize/,
# proves that the sanitizers are live there (test-only ops with deliberate bugs must be
# reported), then runs the GoogleTest binary and the CPU pytest suite against that library.
# The first report stops the job (halt_on_error=1, -fno-sanitize-recover=all): the process
# aborts and the step fails. Leak checking is off: CPython and torch leak by design.
# Usage: scripts/sanitize.sh [PYTHON]; MAX_JOBS (default 2) build jobs, TEST_JOBS (default 2)
# pytest processes (pytest-xdist; a process that aborts is reported as a crashed worker, with
# the test it ran). CONTRIBUTING.md, "Sanitizers", says how to read a report.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
PY="${1:-$root/.venv/bin/python}"
BUILD="$root/build-sanitize"
start=$(date +%s)

echo "== sanitize: configure and build (CPU only, -O1 -g1) in build-sanitize/"
san="-fsanitize=address,undefined"
mkdir -p "$BUILD"
# -g1 (line tables: file:line in every report frame) builds in about half the time of -g;
# -O1 (the level the sanitizers' docs suggest) in about two thirds of -O2's: the sanitized
# AVX2 qk_norm_rope kernel compiled in 32 s against 56, the whole build in 200 s against
# 220-310 (2026-12-07, Zen 4), and the pytest step took the same 139 s.
# POSENC_WITH_CUDA in the environment overrides the cache (CMakeLists.txt): OFF here too.
POSENC_WITH_CUDA=OFF cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$PY" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DPOSENC_WITH_CUDA=OFF -DPOSENC_BUILD_TESTS=ON -DPOSENC_INSTALL_PYTHON_LIB=OFF \
  -DPOSENC_SANITIZER_SELFTEST=ON \
  -DCMAKE_CXX_FLAGS="$san -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  -DCMAKE_SHARED_LINKER_FLAGS="$san" -DCMAKE_MODULE_LINKER_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" \
  > "$BUILD/configure.log" 2>&1 ||
  { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" -j "${MAX_JOBS:-2}" --target posenc posenc_tests
echo "built in $(( $(date +%s) - start )) s"

# Python is not built with the sanitizers: their runtimes must be loaded first, before
# libposenc (which needs them): the compiler's own copies, as the build linked them.
cxx="$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
preload=""
for rt in libasan.so libubsan.so; do
  path="$("$cxx" -print-file-name="$rt")"
  [ -f "$path" ] || { echo "sanitize: $cxx has no $rt"; exit 1; }
  preload="${preload:+$preload:}$path"
done
# Reports go to stderr (UBSan's log_path does not work with both runtimes loaded: ASan's
# copy of the setter wins). abort_on_error=1: the process dies by SIGABRT, so pytest's
# faulthandler prints the Python stack, which names the test.
# allocator_may_return_null=1: test_bad_input_sweep asks torch for huge tensors on purpose
# and expects torch's out-of-memory error, not an AddressSanitizer abort.
# CUDA_VISIBLE_DEVICES="": the library has no CUDA kernels here, and the CUDA driver's
# mappings do not mix with AddressSanitizer's shadow memory.
san_env() {
  env ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=1" \
    UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1" \
    CUDA_VISIBLE_DEVICES="" PYTHONPATH="$root/python" POSENC_LIBRARY="$BUILD/libposenc.so" "$@"
}

echo "== sanitize: self-test (deliberate bugs must be reported)"
mkdir -p "$BUILD/selftest"
selftest() {  # selftest OP ARGUMENT EXPECTED: the op must kill Python with report EXPECTED
  local op="$1" arg="$2" expected="$3" out="$BUILD/selftest/$1.txt"
  if san_env LD_PRELOAD="$preload" "$PY" -c \
       "import torch, posenc; torch.ops.posenc_selftest.$op($arg)" > "$out" 2>&1; then
    echo "sanitize: self-test $op was NOT caught (the sanitizers are not live)"; cat "$out"; exit 1
  fi
  if ! grep -q "$expected" "$out" || ! grep -q "in $op .*selftest_ops.cpp:" "$out"; then
    echo "sanitize: self-test $op failed without the expected report ('$expected' in selftest_ops.cpp)"
    cat "$out"; exit 1
  fi
  echo "self-test $op: caught ($expected)"
}
selftest heap_overflow "torch.ones(10)" "ERROR: AddressSanitizer: heap-buffer-overflow"
selftest signed_overflow "torch.tensor([2**31 - 1, 1], dtype=torch.int32)" \
  "runtime error: signed integer overflow"

echo "== sanitize: GoogleTest"
# Not --gtest_brief: after an abort, the last "[ RUN ]" line names the test.
san_env "$BUILD/posenc_tests"

echo "== sanitize: pytest (CPU tests)"
# --capture=sys: pytest captures Python's output only, so a report (written to file
# descriptor 2) reaches the log even when the process dies.
# A fresh torch.compile cache of its own: inductor's cache does not key on our ops' schemas,
# so a graph compiled against another build of libposenc could be reused with this one.
# Left out: the tests of the peers' integrations (transformers' own models, run on the same
# posenc kernels as the rest), the docs' and examples' runs (the README, the docs' code blocks,
# the figures, examples/: the public functions the op tests call) and the 2-process distributed suite (the same kernels again,
# under DTensor): minutes under the sanitizers for no posenc code path of their own. Also
# left out: the AOTInductor packaging tests (test_*deploy.py): their time goes to g++
# compiling generated code under the preloaded sanitizer runtimes, and the package calls the
# same kernels through the same dispatcher entry as the eager tests here. And the
# torch.compile tests (-k "not compile": 90 tests, a third of the suite's time without the
# sanitizers): a compiled graph calls the same kernels, and the Meta kernels they trace
# through stay covered by the opcheck tests, which run here. And the demo's smoke test
# (test_demo.py: `python -m posenc demo --quick` in a child process, 55 s without the
# sanitizers, most of it torch.compile and the benchmark loops over the same kernels), the
# training runs (-k "not learns": hundreds of steps of kernels the gradient tests run once,
# 62 s under the sanitizers), the benchmark harness's row (test_bench_table.py) and the
# conftest's own guards (test_conftest_guards.py: pytest in child processes, no posenc op).
# --durations: the slowest tests, for the next trim.
rm -rf "$BUILD/inductor-cache"
san_env LD_PRELOAD="$preload" TORCHINDUCTOR_CACHE_DIR="$BUILD/inductor-cache" \
  "$PY" -m pytest tests/python -q -p no:cacheprovider --capture=sys -n "${TEST_JOBS:-2}" -m "not cuda" -k "not compile and not learns" \
  --ignore-glob="tests/python/test_integrations_*.py" --ignore=tests/python/test_qk_norm_rope_transformers.py \
  --ignore-glob="tests/python/test_docs*.py" --ignore=tests/python/test_readme.py \
  --ignore-glob="tests/python/test_example*.py" --ignore=tests/python/test_distributed.py \
  --ignore=tests/python/test_deploy.py --ignore=tests/python/test_rope_append_kv_deploy.py \
  --ignore=tests/python/test_demo.py --ignore=tests/python/test_bench_table.py \
  --ignore=tests/python/test_conftest_guards.py --durations=15
echo "sanitize: clean, $(( $(date +%s) - start )) s in all"
