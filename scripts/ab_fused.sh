#!/usr/bin/env bash
# In-process A/B of the fused kernel between two versions of include/ (bench/ab/ab_fused.cpp says how).
#
#   bash scripts/ab_fused.sh REV_A REV_B [D T rounds causal]        # speed; defaults: 128 1024 20 0
#   bash scripts/ab_fused.sh REV_A REV_B --bits [--perturb] [NAME...] # bit identity over every case (or NAME...)
#   bash scripts/ab_fused.sh REV_A REV_B --time NAME [rounds]         # speed of one case of the bit check
#   bash scripts/ab_fused.sh REV_A REV_B --list                       # the case names
#   bash scripts/ab_fused.sh REV_A REV_B --backward [T D causal rounds p] # backward speed; defaults: 4096 128 0 10 0
#   bash scripts/ab_fused.sh REV_A REV_B --backward-bits [--perturb] [NAME...]
#                                                                     # the backward's bit identity (or NAME...)
#   bash scripts/ab_fused.sh REV_A REV_B --backward-list              # the backward's case names
#   bash scripts/ab_fused.sh REV_A REV_B --decode [layout storage Skv rounds [cached] [D=N] [Hq=N]]
#                                                                     # decode speed; defaults: bshd f16 32768 16
#   bash scripts/ab_fused.sh REV_A REV_B --micro [keys rounds]       # the decoding micro-kernels; defaults 1024 100
#
# REV_A, REV_B: git revisions, or `.` for the working tree. --bits runs each case (a shape × an option preset; the list
# and the reason for each are in the driver) through both versions at 1 and 2 OpenMP threads, prints one line per
# case with the bits in which B's out and lse differ from A's, and exits 1 if any differ; --perturb flips one bit of
# B's out and lse in every case (a self-test of the check: it must then fail on every line).
# --backward times qkv::attention_backward (fused) of A and B alternately on one forward's out and lse (A's), B = 1,
# H = 8, Sq = Skv = T, D = Dv (with dropout of probability p if p > 0), and prints the median time of each, the median
# of the per-round ratios B / A and whether dQ, dK and dV are bit-identical. --backward-bits is --bits for the
# backward: its own cases (shapes × presets, dropout among them; --backward-list names them), dQ, dK and dV of B
# against A's at 1 and 2 OpenMP threads, exit 1 if any bit differs; --perturb flips one bit of B's dQ, dK and dV in
# every case.
# --decode times one decoding step of A and B alternately (B = 1, Sq = 1, Hq = 32 or N, Hkv = 8, D = Dv = 128 or N, Skv
# keys; layout bshd or bhsd; K and V stored as float, f16 or bf16, q and out float) and prints the median microseconds
# and GB/s of K and V of each and its share of a read loop over A's K and V timed in every round (the median of the
# per-round ratios read loop / call, and the ratio of the medians), the read loop's median, the median of the per-round
# ratios B / A and whether the outputs are bit-identical; each call after a read of 128 MiB (K and V from memory), or
# with `cached` after an untimed call of the same side (K and V from the cache where they fit: the micro-kernels'
# speed).
# --micro times the decoding micro-kernels of A and B alone (Q·Kᵀ and P·V of one kv head, 4 rows, D = 128, float K
# and V over `keys` keys, as unpaced and paced head-major tasks call them) and prints each one's share of the FMA loop,
# B / A and whether their results are bit-identical; the driver says more.
# Environment:
#   CXX            compiler (default clang++)
#   QKV_AB_FLAGS   compiler flags (default -O3 -march=native); e.g. "-O2 -march=x86-64" builds the scalar path,
#                  "-O3 -march=x86-64-v3" the AVX2 path (the run's first line names the ISA each side compiled).
#                  --bits and --backward-bits add -fopenmp; the speed modes are built without it, single-threaded,
#                  as the noise rule of bench/README.md was measured. A build whose instructions this CPU lacks (the
#                  compiler's ISA macros against /proc/cpuinfo; -march=x86-64-v4 on an AVX2-only CPU) is compiled, not
#                  run.
#   QKV_AB_THREADS OpenMP threads per call of the speed mode, --backward and --decode (default 1), with -fopenmp in
#                  QKV_AB_FLAGS, e.g. QKV_AB_FLAGS="-O3 -march=native -fopenmp" QKV_AB_THREADS=2
#                  OMP_WAIT_POLICY=active; the FMA loop they print stays on one thread.
#   QKV_AB_KV_OFFSET, QKV_AB_B_KV_OFFSET
#                  --decode only: K and V start this many bytes (a multiple of the element's size, below 64) past a
#                  64-byte boundary, for both sides (unset or empty: where a std::vector puts them, 16 bytes past a
#                  page with glibc); the second gives side B a copy of its own so placed, so that one run pairs two
#                  placements (REV_A = REV_B).
#   QKV_AB_DECODE_FMA
#                  --decode only: 1 runs the FMA loop before each round, as every mode did until the thirty-ninth
#                  session of bench/README.md (default: none; it slowed some decoding forms' reads from L3 more than
#                  others').
#   QKV_AB_ISAS    a list of -march values, e.g. "x86-64 x86-64-v3 x86-64-v4 native": one build per ISA (flags
#                  QKV_AB_FLAGS, default -O3, then -march=ISA), each in build/ab/isa-ISA, each run in turn (or
#                  compiled only, as above). Exit status 1 if any run fails.
# Needs Eigen 3.4 (libeigen3-dev), a compiler and, for --bits and --backward-bits with clang++, libomp-dev; nothing is
# built by CMake.
# The driver bench/ab/ab_fused.cpp is always the working tree's: a revision whose public API differs from it (names of
# attention, view_bhsd, view_bshd, TensorView, AttentionOptions, isa_name) will not compile. The backward modes also
# need attention_backward and the dropout options (116a439 on); only they compile the driver's backward code
# (-DQKV_AB_BACKWARD), so the other modes still build against revisions before it. Likewise --decode needs the 16-bit
# overloads of attention (c220239 on) and alone compiles the driver's decode code (-DQKV_AB_DECODE); --micro names
# the decoding micro-kernels (37e39c7 on) and alone compiles the driver's code for them (-DQKV_AB_MICRO).
# Examples: does the working tree beat the last commit on D = 64?   bash scripts/ab_fused.sh HEAD . 64 1024 20 0
#           are its bits those of the last commit on every ISA?    QKV_AB_ISAS="x86-64 x86-64-v3 native" \
#                                                                    bash scripts/ab_fused.sh HEAD . --bits
#           is its backward faster, causal, at D = 64?             bash scripts/ab_fused.sh HEAD . --backward 4096 64 1
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage="usage: scripts/ab_fused.sh REV_A REV_B [D T rounds causal | --bits [--perturb] [NAME...] | --time NAME [rounds]"
usage+=" | --list | --backward [T D causal rounds dropout_p] | --backward-bits [--perturb] [NAME...] | --backward-list"
usage+=" | --decode [layout storage Skv rounds [cached] [D=N] [Hq=N]] | --micro [keys rounds]]"
rev_a=${1:?$usage}
rev_b=${2:?$usage}
shift 2
args=("$@")
((${#args[@]})) || args=(128 1024 20 0)
openmp=()
[[ ${args[0]} == --bits || ${args[0]} == --backward-bits ]] && openmp=(-fopenmp)
mode_define=()  # the driver's code of the backward modes, of --decode and of --micro is compiled for them alone
[[ ${args[0]} == --backward* ]] && mode_define=(-DQKV_AB_BACKWARD)
[[ ${args[0]} == --decode ]] && mode_define=(-DQKV_AB_DECODE)
[[ ${args[0]} == --micro ]] && mode_define=(-DQKV_AB_MICRO)
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

build() {  # build OUT FLAGS...: the driver against A's and B's headers
  local out=$1 start=$SECONDS
  shift
  mkdir -p "$(dirname "$out")"
  "${CXX:-clang++}" -std=c++17 -DNDEBUG "$@" "${openmp[@]}" "${mode_define[@]}" -w -I"$work/a" -I"$work/b" -I"$work" \
    -I/usr/include/eigen3 bench/ab/ab_fused.cpp -o "$out"
  echo "built $out in $((SECONDS - start)) s"
}

# The instruction sets FLAGS enable that this CPU lacks, by the compiler's predefined macros against /proc/cpuinfo
# (empty: the build can run here).
missing_isa() {
  local macros pair missing=()
  macros=$("${CXX:-clang++}" "$@" -dM -E -x c++ /dev/null)
  for pair in AVX512F:avx512f AVX512BW:avx512bw AVX512DQ:avx512dq AVX512VL:avx512vl AVX2:avx2 FMA:fma BMI2:bmi2 \
    F16C:f16c AVX:avx SSE4_2:sse4_2; do
    if grep -qw "__${pair%%:*}__" <<<"$macros" && ! grep -qw "${pair#*:}" /proc/cpuinfo; then
      missing+=("${pair#*:}")
    fi
  done
  echo "${missing[*]}"
}

describe() { if [[ $1 == . ]]; then echo "the working tree"; else git rev-parse --short "$1"; fi; }
echo "A = $(describe "$rev_a"), B = $(describe "$rev_b")"

# check OUT FLAGS...: build, then run unless the CPU lacks what FLAGS enable; the driver's exit status (0 when skipped).
check() {
  local out=$1 lacks start status=0
  shift
  build "$out" "$@"
  lacks=$(missing_isa "$@")
  if [[ -n $lacks ]]; then
    echo "built, not run: this CPU lacks $lacks"
    return 0
  fi
  start=$SECONDS
  "$out" "${args[@]}" || status=$?
  echo "ran in $((SECONDS - start)) s"
  return "$status"
}

if [[ -z ${QKV_AB_ISAS:-} ]]; then
  read -ra flags <<<"${QKV_AB_FLAGS:--O3 -march=native}"
  check "$work/ab_fused" "${flags[@]}"
  exit
fi

failed=()
for isa in $QKV_AB_ISAS; do
  read -ra flags <<<"${QKV_AB_FLAGS:--O3}"
  flags+=("-march=$isa")
  echo
  echo "==== -march=$isa (${flags[*]})"
  check "$work/isa-$isa/ab_fused" "${flags[@]}" || failed+=("$isa")
done
echo
if ((${#failed[@]})); then
  echo "==== failed on: ${failed[*]}"
  exit 1
fi
echo "==== every ISA that runs here passed"
