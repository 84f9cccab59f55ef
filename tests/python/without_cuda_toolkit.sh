#!/usr/bin/env bash
# Runs a command as on a machine without the CUDA toolkit (a laptop, a CPU server, a cloud
# image with a driver only): in a private mount namespace, an empty directory over each
# toolkit directory (/usr/local/cuda*, /opt/cuda, $CUDA_HOME, $CUDA_PATH; whatever they link
# to), /dev/null over every nvcc left on PATH (wrapper scripts), and no CUDA variables in the
# environment. The rest of the machine (torch's own CUDA libraries in site-packages, the
# network) stays as it is. Exits 125 when no mount namespace can be made (unshare refused:
# neither root nor unprivileged user namespaces).
#   usage: without_cuda_toolkit.sh <command> [args...]
set -euo pipefail

if [ "${POSENC_IN_TOOLKIT_NAMESPACE:-}" != 1 ]; then
  flags=(--mount --propagation private)
  [ "$(id -u)" -eq 0 ] || flags+=(--map-root-user)
  if ! unshare "${flags[@]}" true 2>/dev/null; then
    echo "without_cuda_toolkit.sh: cannot make a mount namespace (unshare ${flags[*]})" >&2
    exit 125
  fi
  exec unshare "${flags[@]}" env POSENC_IN_TOOLKIT_NAMESPACE=1 bash "$0" "$@"
fi

# The toolkit's directories, resolved (the /usr/local/cuda symlink, and the links into
# cuda-13.0 under /usr/local/{include,lib64,bin} then point into an empty directory).
dirs=()
for d in /usr/local/cuda /usr/local/cuda-* /opt/cuda "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
  [ -n "$d" ] && [ -d "$d" ] && dirs+=("$(readlink -f "$d")")
done
for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do
  mount -t tmpfs -o size=64k,mode=755 posenc-no-toolkit "$d"
done
# Toolkit variables, and CUDA entries of the search paths.
unset CUDA_HOME CUDA_PATH CUDACXX CUDA_TOOLKIT_ROOT CUDA_BIN_PATH CUDAToolkit_ROOT CUDA_ROOT
without_cuda() { tr ":" "\n" <<<"$1" | { grep -v -i cuda || true; } | paste -sd: -; }
PATH="$(without_cuda "$PATH")"
LIBRARY_PATH="$(without_cuda "${LIBRARY_PATH:-}")"
LD_LIBRARY_PATH="$(without_cuda "${LD_LIBRARY_PATH:-}")"
export PATH LIBRARY_PATH LD_LIBRARY_PATH
[ -n "$LIBRARY_PATH" ] || unset LIBRARY_PATH
[ -n "$LD_LIBRARY_PATH" ] || unset LD_LIBRARY_PATH
# What is left on PATH (e.g. /usr/local/bin/nvcc, a script that runs the real one).
while read -r f; do
  [ -n "$f" ] && mount --bind /dev/null "$f"
done < <(type -ap nvcc ptxas || true)

# (bash's `command -v` also names a file that is not executable, when nothing else is found.)
hash -r
if [ -x "$(command -v nvcc || true)" ] || [ -e /usr/local/cuda/bin/nvcc ]; then
  echo "without_cuda_toolkit.sh: nvcc is still visible: $(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" >&2
  exit 1
fi
exec "$@"
