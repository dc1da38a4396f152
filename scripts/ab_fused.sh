#!/usr/bin/env bash
# In-process A/B of the fused kernel between two versions of include/ (bench/ab/ab_fused.cpp says how).
#
#   bash scripts/ab_fused.sh REV_A REV_B [D T rounds causal]     # defaults: 128 1024 20 0
#
# REV_A, REV_B: git revisions, or `.` for the working tree. Environment: CXX (default clang++), QKV_AB_FLAGS (default
# -O3 -march=native). Needs Eigen 3.4 (libeigen3-dev) and a compiler; nothing is installed or built by CMake.
# The driver bench/ab/ab_fused.cpp is always the working tree's: a revision whose public API differs from it (names of
# attention, view_bhsd, AttentionOptions) will not compile.
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
grep -rl '#include "qkv/' "$work/b/B/qkv" | xargs -r sed -i 's|#include "qkv/|#include "B/qkv/|'
if grep -rnE '#[[:space:]]*include[[:space:]]*[<"]qkv/' "$work/b/B/qkv"; then
  echo "scripts/ab_fused.sh: an include of B's headers above was not rewritten to B/qkv/ (B would use A's file)" >&2
  exit 1
fi
# g++ takes two headers with the same contents (and modification time) for one file under #pragma once: every copy
# of B gets a first line of its own, so that no header of B is skipped as A's.
find "$work/b/B" -type f -name '*.hpp' -exec sed -i '1i // the B copy of scripts/ab_fused.sh' {} +
# Macros of A's headers would reach B's (an #ifndef-guarded one would keep A's value): the driver undefines each
# QKV_ macro A defines between the two includes.
grep -rhoE '^[[:space:]]*#[[:space:]]*define[[:space:]]+QKV_[A-Za-z0-9_]+' "$work/a/qkv" |
  sed -E 's/.*define[[:space:]]+//' | sort -u | sed 's/^/#undef /' >"$work/undef_a.hpp"

# shellcheck disable=SC2086
"${CXX:-clang++}" -std=c++17 -DNDEBUG ${QKV_AB_FLAGS:--O3 -march=native} -w -I"$work/a" -I"$work/b" -I"$work" \
  -I/usr/include/eigen3 bench/ab/ab_fused.cpp -o "$work/ab_fused"
describe() { if [[ $1 == . ]]; then echo "the working tree"; else git rev-parse --short "$1"; fi; }
echo "A = $(describe "$rev_a"), B = $(describe "$rev_b")"
"$work/ab_fused" "${1:-128}" "${2:-1024}" "${3:-20}" "${4:-0}"
