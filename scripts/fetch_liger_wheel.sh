#!/usr/bin/env bash
# Fetches Liger-Kernel's wheel (BSD-2-Clause; pure Python + Triton) into benchmarks/wheels/
# (git-ignored), for the optional comparison of benchmarks/bench_rope.py on the GPU machine,
# which has no network: pass carry=["benchmarks/wheels"] to the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/wheels
"${PYTHON:-.venv/bin/python}" -m pip download "liger-kernel==${LIGER_VERSION:-0.8.5}" --no-deps \
  -d benchmarks/wheels -q
ls benchmarks/wheels
