#!/usr/bin/env bash
# The runtime-dispatch speed check (docs/design.md, "Runtime dispatch"): bench/dispatch_prefill.cpp built without
# -march and with -march=native (same compiler, -O3 -DNDEBUG -fopenmp), run in turn ROUNDS times (default 5), each run
# timing 20 calls. Prints each run and, per build, the median of the runs' best times, and their ratio native /
# dispatch (1.0: dispatch costs nothing; the target is ≥ 0.9).
#
#   bash scripts/dispatch_speed.sh [ROUNDS]        CXX=clang++ to use clang
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5}
out=build/dispatch_speed
mkdir -p "$out"
flags=(-std=c++17 -O3 -DNDEBUG -fopenmp -Iinclude -isystem /usr/include/eigen3)
"${CXX:-g++}" "${flags[@]}" bench/dispatch_prefill.cpp -o "$out/dispatch"
"${CXX:-g++}" "${flags[@]}" -march=native bench/dispatch_prefill.cpp -o "$out/native"
best() { awk '{print $3}'; }
dispatch_best=() native_best=()
for ((r = 0; r < rounds; ++r)); do
  a=$("$out/dispatch") && b=$("$out/native")
  echo "dispatch: $a"
  echo "native:   $b"
  dispatch_best+=("$(best <<<"$a")") native_best+=("$(best <<<"$b")")
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
d=$(median "${dispatch_best[@]}") n=$(median "${native_best[@]}")
awk -v d="$d" -v n="$n" 'BEGIN {printf "median best: dispatch %.3f ms, native %.3f ms; speed of dispatch / native = %.3f\n", d, n, n / d}'
