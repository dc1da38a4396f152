#!/usr/bin/env bash
# In-process A/B of the fused kernel between two versions of include/ (bench/ab/ab_fused.cpp says how).
#
#   bash scripts/ab_fused.sh REV_A REV_B [D T rounds causal]     # defaults: 128 1024 20 0
#
# REV_A, REV_B: git revisions, or `.` for the working tree. Environment: CXX (default clang++), QKV_AB_FLAGS (default
# -O3 -march=native). Needs Eigen 3.4 (libeigen3-dev) and a compiler; nothing is installed or built by CMake.
# Example: does the working tree beat the last commit on D = 64?   bash scripts/ab_fused.sh HEAD . 64 1024 20 0
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev_a=${1:?usage: scripts/ab_fused.sh REV_A REV_B [D T rounds causal]}
rev_b=${2:?usage: scripts/ab_fused.sh REV_A REV_B [D T rounds causal]}
shift 2
work=build/ab
rm -rf "$work/a" "$work/b"
mkdir -p "$work/a" "$work/b/B"

export_tree() {  # export_tree REV DIR: include/qkv of REV into DIR/qkv
  if [[ $1 == . ]]; then
    cp -r include/qkv "$2/"
  else
    git archive "$1" include/qkv | tar -x -C "$2" --strip-components=1
  fi
}
export_tree "$rev_a" "$work/a"
export_tree "$rev_b" "$work/b/B"
# B's headers include each other as "qkv/...": point them at B's copy.
grep -rl '#include "qkv/' "$work/b/B/qkv" | xargs sed -i 's|#include "qkv/|#include "B/qkv/|'
# g++ takes two headers with the same contents and modification time for one file under #pragma once (A's and B's
# copies of an unchanged header, both exported by git archive with the commit's time): give B's copies another time.
find "$work/b" -type f -exec touch -d '2000-01-01 00:00:00' {} +

# shellcheck disable=SC2086
"${CXX:-clang++}" -std=c++17 -DNDEBUG ${QKV_AB_FLAGS:--O3 -march=native} -w -I"$work/a" -I"$work/b" \
  -I/usr/include/eigen3 bench/ab/ab_fused.cpp -o "$work/ab_fused"
describe() { if [[ $1 == . ]]; then echo "the working tree"; else git rev-parse --short "$1"; fi; }
echo "A = $(describe "$rev_a"), B = $(describe "$rev_b")"
"$work/ab_fused" "${1:-128}" "${2:-1024}" "${3:-20}" "${4:-0}"
