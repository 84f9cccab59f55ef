#!/usr/bin/env bash
# One-time set-up of a fresh machine: system tools (Debian packages) that are missing, then
# a virtual environment .venv with torch and the Python tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
python3 -c "import venv, ensurepip" 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, matplotlib" 2>/dev/null ||
   [ requirements-dev.txt -nt .venv/.requirements-stamp ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  touch .venv/.requirements-stamp
fi
# The peers the integration tests run against (transformers and what its import needs),
# with --no-deps so that pip never replaces torch; without them those tests skip.
if [ requirements-peers.txt -nt .venv/.peers-stamp ]; then
  if .venv/bin/python -m pip install -q --no-deps -r requirements-peers.txt; then
    touch .venv/.peers-stamp
  else
    echo "bootstrap: the peer libraries (requirements-peers.txt) did not install; their tests skip"
  fi
fi
.venv/bin/python - <<'PY'
import torch
print(f"bootstrap: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU available: {torch.cuda.is_available()}")
PY
