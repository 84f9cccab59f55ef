#!/usr/bin/env bash
# The ISA translation units (CMakeLists.txt POSENC_ISA_SOURCES) are built once per CPU
# capability, from generated wrappers named <source>.<CAPABILITY>.cpp: DEFAULT (baseline
# flags) and AVX2 (-mavx2 -mfma -mf16c). A build for a capability above the baseline must
# share no weak function symbol with any other object (plain or another capability's): for
# such a symbol (an inline function not inlined, a template instantiation) the linker keeps
# one copy for the whole library, and an AVX2 copy kept for a baseline caller faults on a
# CPU without AVX2. The ISA namespace (posenc/math/host_device.h, POSENC_ISA_NAMESPACE_BEGIN)
# makes the names differ; this check proves it on the objects that were built. It also
# checks that each capability's build registered its kernels (its dispatch-stub pointers,
# csrc/ops/common/cpu/cpu_capability.h).
#   check_isa_symbols.sh "<objects:separated:by:colons>" <ISA sources> <CAPABILITY>...
set -euo pipefail
IFS=':' read -r -a objects <<< "$1"
count=$2
shift 2
capabilities=("$@")
weak_functions() { nm --defined-only -P "$@" 2>/dev/null | awk '$2 == "W" { print $1 }' | sort -u; }
report=()
for cap in "${capabilities[@]}"; do
  mine=() others=()
  for o in "${objects[@]}"; do
    if [[ "$o" =~ \.${cap}\.cpp\.o$ ]]; then mine+=("$o"); else others+=("$o"); fi
  done
  if [ ${#mine[@]} -ne "$count" ]; then
    echo "check_isa_symbols: expected $count $cap objects, found ${#mine[@]}" >&2
    exit 1
  fi
  # The stub pointers this build defines: DispatchStub<...>::<cap>, one per entry point.
  stubs=$(nm --defined-only -C "${mine[@]}" 2>/dev/null | grep -c "DispatchStub<.*>::${cap}\$" || true)
  if [ "$stubs" -eq 0 ]; then
    echo "check_isa_symbols: the $cap objects define no dispatch-stub entry point" >&2
    exit 1
  fi
  if [ "$cap" != DEFAULT ]; then
    shared=$(comm -12 <(weak_functions "${mine[@]}") <(weak_functions "${others[@]}"))
    if [ -n "$shared" ]; then
      echo "check_isa_symbols: weak functions defined both in $cap objects and in others:" >&2
      echo "$shared" | c++filt | head -40 >&2
      exit 1
    fi
  fi
  report+=("$cap: ${#mine[@]} objects, $stubs entry points, $(weak_functions "${mine[@]}" | wc -l) weak functions")
done
printf 'check_isa_symbols: %s\n' "${report[@]}"
echo "check_isa_symbols: no weak function of a build above DEFAULT is shared"
