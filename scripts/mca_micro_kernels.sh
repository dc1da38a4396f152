#!/usr/bin/env bash
# Predicts the fused kernel's inner loops with llvm-mca: the throughput of each micro-kernel's loop body against its
# FMA-port bound, for a CPU this machine may not have (bench/README.md, "AVX-512 micro-kernels without an AVX-512 CPU").
#
#   bash scripts/mca_micro_kernels.sh [MCPU]        (default sapphirerapids; e.g. skylake-avx512, icelake-server)
#
# Compiles one translation unit that instantiates the prefill micro-kernels (qk_panel and pv_chunk, 6 rows: the
# flops of prefill) for the AVX-512 and AVX2 tags with clang++ -O3 -march=MCPU -S, cuts out each function's
# innermost loop and runs llvm-mca -mcpu=MCPU over it. (The decoding kernels are bound by memory, not by ports: their
# measure is the read loop, bench_attention.) The bound: FMAs per iteration / 2
# (two FMA ports on every x86 core that llvm-mca models here). These are the model's predictions, not measurements;
# LLVM 14 models Sapphire Rapids with Skylake-X's ports. Needs clang++ and llvm-mca (Debian: clang, llvm).
# QKV_MCA_KEEP=1 keeps the generated assembly (the temporary directory is printed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mcpu=${1:-sapphirerapids}
CXX=${CXX:-clang++}
MCA=${MCA:-llvm-mca}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[[ -n ${QKV_MCA_KEEP:-} ]] && trap - EXIT && echo "kept $work"

cat >"$work/kernels.cpp" <<'CPP'
#include "qkv/qkv.hpp"
namespace d = qkv::detail;
#define QKV_MCA_KERNELS(ns, Tag)                                                                                   \
  extern "C" __attribute__((noinline)) void ns##_qk_panel(const float* q, long ldq, const float* k, long D,     \
                                                          float* s, long lds) {                                   \
    d::ns::qk_panel<qkv::simd::Tag, 6>(q, ldq, k, D, s, lds);                                                   \
  }                                                                                                               \
  extern "C" __attribute__((noinline)) void ns##_pv_chunk(const float* p, long ldp, const float* v, long ldv,   \
                                                          long keys, float* o, long ldo) {                        \
    d::ns::pv_chunk<qkv::simd::Tag, 6>(p, ldp, v, ldv, keys, o, ldo);                                           \
  }
#if defined(QKV_KERNEL_AVX512)
QKV_MCA_KERNELS(kernel_avx512, Avx512Tag)
#endif
#if defined(QKV_KERNEL_AVX2)
QKV_MCA_KERNELS(kernel_avx2, Avx2Tag)
#endif
CPP

eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
"$CXX" -std=c++17 -O3 -DNDEBUG -march="$mcpu" -Iinclude $eigen -S -o "$work/kernels.s" "$work/kernels.cpp"

# The body of a function's first innermost loop: from the label LLVM marks "Inner Loop Header" to the branch back.
loop_of() {
  awk -v fn="$1:" '
    $1 == fn { in_fn = 1; next }
    in_fn && /^[_a-zA-Z][_a-zA-Z0-9]*:/ { exit }
    in_fn && !label && /Inner Loop Header/ { label = ($1 ~ /^#/ ? previous : $1); sub(":", "", label); next }
    label && $0 ~ ("\t" label "$") { exit }
    label && $1 !~ /^\./ && $1 !~ /^#/ { print }
    { previous = $1 }
  ' "$work/kernels.s"
}

printf '%-30s %8s %8s %8s %10s\n' "loop ($mcpu)" "FMAs" "bound" "cycles" "of bound"
for ns in kernel_avx512 kernel_avx2; do
  for kernel in qk_panel pv_chunk; do
    body=$(loop_of "${ns}_${kernel}")
    [[ -n $body ]] || continue
    printf '%s\n' "$body" >"$work/loop.s"
    fmas=$(grep -c 'vfmadd' "$work/loop.s" || true)
    report=$("$MCA" -mcpu="$mcpu" -iterations=1000 "$work/loop.s" 2>/dev/null)
    cycles=$(awk '/^Total Cycles:/ { c = $3 } /^Iterations:/ { i = $2 } END { printf "%.2f", c / i }' <<<"$report")
    awk -v name="${ns#kernel_} $kernel" -v f="$fmas" -v c="$cycles" \
      'BEGIN { printf "%-30s %8d %8.1f %8.2f %10.3f\n", name, f, f / 2, c, (f / 2) / c }'
  done
done
