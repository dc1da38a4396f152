#!/usr/bin/env bash
# The runtime-dispatch speed check (docs/design.md, "Runtime dispatch"): bench/dispatch_prefill.cpp built without
# -march and with -march=native (same compiler, -O3 -DNDEBUG -fopenmp), run in turn ROUNDS times (default 9), each run
# timing 30 calls. Prints each pair of runs, the best time of each build over all runs, and the median over the pairs
# of native best / dispatch best: the speed of dispatch relative to -march=native (1.0: dispatch costs nothing; the
# target is ≥ 0.9). On a shared machine single pairs scatter by ±25 %: quote the median and the overall bests.
#
#   bash scripts/dispatch_speed.sh [ROUNDS]        CXX=clang++ to use clang
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-9}
out=build/dispatch_speed
mkdir -p "$out"
flags=(-std=c++17 -O3 -DNDEBUG -fopenmp -Iinclude -isystem /usr/include/eigen3)
"${CXX:-g++}" "${flags[@]}" bench/dispatch_prefill.cpp -o "$out/dispatch"
"${CXX:-g++}" "${flags[@]}" -march=native bench/dispatch_prefill.cpp -o "$out/native"
best() { awk '{print $3}'; }
ratios=() dispatch_best=() native_best=()
for ((r = 0; r < rounds; ++r)); do
  a=$("$out/dispatch" 30) && b=$("$out/native" 30)
  da=$(best <<<"$a") nb=$(best <<<"$b")
  ratio=$(awk -v d="$da" -v n="$nb" 'BEGIN {printf "%.3f", n / d}')
  echo "dispatch: $a | native: $b | native/dispatch $ratio"
  ratios+=("$ratio") dispatch_best+=("$da") native_best+=("$nb")
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
minimum() { printf '%s\n' "$@" | sort -g | head -1; }
echo "best over all runs: dispatch $(minimum "${dispatch_best[@]}") ms, native $(minimum "${native_best[@]}") ms"
echo "speed of dispatch relative to -march=native, median of $rounds pairs: $(median "${ratios[@]}")"
