#!/usr/bin/env bash
# The pip package as a user without the CUDA toolkit gets it (issue 23), in one build:
#  1. `python -m build --wheel --no-isolation` of a copy of the sources, with the toolkit hidden
#     (without_cuda_toolkit.sh: no nvcc, no /usr/local/cuda, no CUDA variables); <python> holds
#     pyproject's build requirements (requirements-dev.txt: setuptools, wheel, cmake and ninja
#     from PyPI, which setup.py runs). Before it, pip's default path, `pip install .` with
#     build isolation, up to the wheel's metadata only (`pip install --dry-run`: pip installs
#     the build requirements into its isolated environment and runs setup.py there, which
#     must find <python>'s torch; no compile): the same torch pin;
#  2. that wheel installed with pip, dependencies checked, into a fresh venv that has <python>'s
#     torch (its site-packages through a .pth file; torch/ and nvidia/ linked beside posenc as a
#     real install lays them out);
#  3. checks: with a CUDA torch the build said that it skips the CUDA kernels; METADATA
#     requires torch==<the release built against>; libposenc's RUNPATH is exactly
#     $ORIGIN/../../torch/lib and every library it needs resolves through it (ldd); the
#     installed package imports and a forward matches a float64 reference.
# With a CMake install prefix (make test's build/install), also checks that library's
# RUNPATH: the lib directory of the torch it was built against, then, only when it needs
# libcudart (CUDA kernels), the directory of that library, and nothing else.
#   usage: run_pip_install.sh <python with torch> [<cmake install prefix>]
set -euo pipefail
# As in a user's shell: not make's PYTHONPATH to this checkout's python/, which would shadow
# the installed copy under test.
unset PYTHONPATH
py="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "run_pip_install.sh: $*" >&2; exit 1; }

mkdir -p "$work/src"
# The files git knows of (committed or not), never build outputs.
git -C "$root" ls-files -z --cached --others --exclude-standard |
  tar -C "$root" --null -T - --ignore-failed-read -cf - | tar -C "$work/src" -xf -

# site: the site-packages that holds <python>'s torch (its purelib, or another directory on
# its path, such as a system or user site).
read -r torch_version torch_cuda site < <("$py" -c '
import os, torch
print(torch.__version__, torch.version.cuda or "-", os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))))')
release="${torch_version%%+*}"

# The CMake-installed library first: it needs no build.
runpath_of() { readelf -d "$1" | sed -n 's/.*(RUNPATH).*Library runpath: \[\(.*\)\]$/\1/p'; }
if [ -n "${2:-}" ]; then
  installed="$2/lib/libposenc.so"
  [ -f "$installed" ] || fail "no $installed"
  want="$site/torch/lib"
  cudart="$(readelf -d "$installed" | sed -n 's/.*(NEEDED).*\[\(libcudart\.so[^]]*\)\]$/\1/p')"
  if [ -n "$cudart" ]; then
    cudart_dir="$(tr ':' '\n' <<<"$(runpath_of "$installed")" | sed -n 2p)"
    [ -f "${cudart_dir:-/nonexistent}/$cudart" ] ||
      fail "$installed needs $cudart, which its RUNPATH's second entry [$cudart_dir] should hold"
    want="$want:$cudart_dir"
  fi
  [ "$(runpath_of "$installed")" = "$want" ] ||
    fail "$installed: RUNPATH should be exactly [$want], not [$(runpath_of "$installed")]"
  echo "the CMake-installed libposenc's RUNPATH is [$want]"
fi

# ---- 1. The wheel, built without the toolkit.
hide=(bash "$here/without_cuda_toolkit.sh")
rc=0; "${hide[@]}" true || rc=$?
if [ "$rc" -eq 125 ]; then
  echo "run_pip_install.sh: WARNING: the CUDA toolkit cannot be hidden here (no mount namespace);" \
       "building the wheel with POSENC_WITH_CUDA=0 instead" >&2
  hide=(env POSENC_WITH_CUDA=0)
  torch_cuda="-"  # no skip warning to expect
elif [ "$rc" -ne 0 ]; then
  fail "without_cuda_toolkit.sh failed ($rc)"
fi
start=$(date +%s)
# pip's isolated build, as far as the metadata (setup.py's torch probe; seconds, no compile).
"${hide[@]}" "$py" -m pip install -q --dry-run --no-deps --ignore-installed --report "$work/pip-report.json" \
  "$work/src" > "$work/pip-dry-run.log" 2>&1 ||
  { tail -30 "$work/pip-dry-run.log"; fail "pip install --dry-run (build isolation) failed"; }
"$py" - "$work/pip-report.json" "$release" <<'PY' || fail "pip's isolated build: wrong metadata"
import json, sys
report, release = json.load(open(sys.argv[1])), sys.argv[2]
requires = report["install"][0]["metadata"].get("requires_dist", [])
assert f"torch=={release}" in requires, f"pip's isolated build requires {requires}, not torch=={release}"
PY
echo "pip's isolated build (pip install .) finds this torch: requires torch==$release"
build_start=$(date +%s)
"${hide[@]}" env MAX_JOBS="${MAX_JOBS:-2}" "$py" -m build --wheel --no-isolation --outdir "$work/dist" \
  "$work/src" > "$work/build-wheel.log" 2>&1 ||
  { tail -60 "$work/build-wheel.log"; fail "python -m build --wheel --no-isolation failed"; }
echo "python -m build --wheel --no-isolation built posenc without the CUDA toolkit" \
     "in $(( $(date +%s) - build_start )) s"
wheel=("$work"/dist/posenc-*.whl)
[ -f "${wheel[0]}" ] || fail "no wheel in $work/dist"
if [ "$torch_cuda" != "-" ]; then
  # (CMake wraps a warning's lines wherever its width falls.)
  tr -s ' \n' '  ' < "$work/build-wheel.log" | grep -q "building libposenc WITHOUT its CUDA kernels" ||
    fail "torch $torch_version is a CUDA build, but the build did not warn that it skips the CUDA kernels"
fi

# ---- 2. Installed by pip into a fresh venv that has this torch.
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
vsite="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$site" > "$vsite/with_torch_of_the_build.pth"
for dir in torch nvidia; do
  [ -e "$site/$dir" ] && ln -s "$site/$dir" "$vsite/$dir"
done
"$vpy" -m pip install -q --no-index "${wheel[0]}" > "$work/pip-install.log" 2>&1 ||
  { cat "$work/pip-install.log"; fail "pip install of the wheel failed"; }

# ---- 3. What the wheel holds.
metadata="$("$py" -c '
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
print(wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode())' "${wheel[0]}")"
grep -qx "Requires-Dist: torch==$release" <<<"$metadata" ||
  fail "METADATA should require torch==$release; it has: $(grep '^Requires-Dist' <<<"$metadata" | tr '\n' ' ')"
lib="$vsite/posenc/lib/libposenc.so"
[ -f "$lib" ] || fail "the wheel installed no $lib"
runpath="$(runpath_of "$lib")"
# shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's
[ "$runpath" = '$ORIGIN/../../torch/lib' ] ||
  fail "libposenc's RUNPATH should be exactly \$ORIGIN/../../torch/lib, not [$runpath]"
! readelf -d "$lib" | grep -q '(RPATH)' || fail "libposenc has a DT_RPATH: $(readelf -d "$lib" | grep '(RPATH)')"
missing="$("${hide[@]}" ldd "$lib" | grep 'not found' || true)"
[ -z "$missing" ] || fail "libraries that libposenc needs do not resolve through its RUNPATH: $missing"
echo "the wheel requires torch==$release; libposenc's RUNPATH is [$runpath] and resolves"

cd "$work"
"${hide[@]}" "$vpy" - "$vsite" <<'PY'
import sys
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
from posenc import _library
assert str(_library.LIBRARY_PATH).startswith(site), _library.LIBRARY_PATH
print("installed posenc imports and matches the reference:", posenc.__file__)
PY
echo "run_pip_install.sh: passed in $(( $(date +%s) - start )) s"
