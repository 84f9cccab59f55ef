#!/usr/bin/env bash
# The ISA translation units (built with -mavx2 -mfma, CMakeLists.txt POSENC_ISA_SOURCES) and
# the plain ones must share no weak function symbol: for such a symbol (an inline function
# not inlined, a template instantiation) the linker keeps one copy for the whole library,
# and an AVX2 copy kept for a plain caller faults on a CPU without AVX2. The ISA namespace
# (posenc/math/host_device.h, POSENC_ISA_NAMESPACE_BEGIN) makes the names differ; this
# check proves it on the objects that were built.
#   check_isa_symbols.sh "<objects:separated:by:colons>" <isa source basename>...
set -euo pipefail
IFS=':' read -r -a objects <<< "$1"
shift
isa_pattern=$(printf '|/%s.o$' "$@")
isa_pattern=${isa_pattern:1}
isa=() plain=()
for o in "${objects[@]}"; do
  if [[ "$o" =~ $isa_pattern ]]; then isa+=("$o"); else plain+=("$o"); fi
done
if [ ${#isa[@]} -ne $# ]; then
  echo "check_isa_symbols: expected $# ISA objects ($*), found ${#isa[@]}" >&2
  exit 1
fi
weak_functions() { nm --defined-only -P "$@" 2>/dev/null | awk '$2 == "W" { print $1 }' | sort -u; }
shared=$(comm -12 <(weak_functions "${isa[@]}") <(weak_functions "${plain[@]}"))
if [ -n "$shared" ]; then
  echo "check_isa_symbols: weak functions defined both in ISA and in plain objects:" >&2
  echo "$shared" | c++filt | head -40 >&2
  exit 1
fi
echo "check_isa_symbols: ${#isa[@]} ISA objects, ${#plain[@]} plain objects," \
  "$(weak_functions "${isa[@]}" | wc -l) weak functions in the ISA objects, none shared"
