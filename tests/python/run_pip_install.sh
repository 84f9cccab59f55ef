#!/usr/bin/env bash
# `pip install .` as a user with torch does it (default build isolation), from a copy of the
# sources, CPU-only to keep CI short, into a scratch directory; then the installed package,
# not python/, imports and runs an op against a float64 reference.
#   usage: run_pip_install.sh <python with torch>
set -euo pipefail
py="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/src"
# The files git knows of (committed or not), never build outputs.
git -C "$root" ls-files -z --cached --others --exclude-standard |
  tar -C "$root" --null -T - --ignore-failed-read -cf - | tar -C "$work/src" -xf -

start=$(date +%s)
POSENC_WITH_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" "$py" -m pip install -q --no-deps \
  --target "$work/site" "$work/src" > "$work/pip.log" 2>&1 || { tail -40 "$work/pip.log"; exit 1; }
echo "pip install . built and installed posenc in $(( $(date +%s) - start )) s"

cd "$work"
PYTHONPATH="$work/site" "$py" - "$work/site" <<'PY'
import math, sys
import torch
import posenc

site = sys.argv[1]
assert posenc.__file__.startswith(site), f"imported {posenc.__file__}, not the installed copy"
x = torch.randn(2, 5, 6, dtype=torch.float64)
pe = posenc.PositionalEncoding(6, 0.0, 16).eval()
pos = torch.arange(5, dtype=torch.float64)[:, None]
j = torch.arange(6)
angle = pos / 10000.0 ** ((j - j % 2) / 6)
want = x + torch.where(j % 2 == 0, torch.sin(angle), torch.cos(angle))
torch.testing.assert_close(pe(x), want, atol=1e-7, rtol=0)
print("installed posenc imports and matches the reference:", posenc.__file__)
PY
