#!/usr/bin/env bash
# Runs the libFuzzer targets of fuzz/ (built by the `fuzz` preset, or `fuzz-bounded` at -O0: clang++, libFuzzer + ASan +
# UBSan).
#
#   bash scripts/fuzz.sh bounded        # CI: configure, build at -O0, replay the committed corpus, fuzz 180 s (one
#                                       # process; the fuzz-bounded preset, build/fuzz-bounded)
#   bash scripts/fuzz.sh long [seconds] # the long run: one process (QKV_FUZZ_JOBS: more), default 6 hours, corpus in
#                                       # build/fuzz/corpus/attention (resumable: run it again to continue)
#   bash scripts/fuzz.sh seeds          # regenerate the seed_* files of the committed corpus fuzz/corpus/attention/
#
# The bounded run compiles at -O0: on a Zen 5 the harness took 49 s to compile against 450 s at -O1, and ran 263 inputs
# a second against 717 (180 s at -O0: 47767 inputs; 120 s at -O1: 86777; fuzz/README.md, "Long run"). The long run and
# the seeds keep -O1 (the fuzz preset, build/fuzz). Every mode grows the same corpus and writes its findings to the same
# directory, under build/fuzz, so that a long run starts from what bounded runs found.
#
# Environment: QKV_FUZZ_SECONDS overrides the bounded run's 180 s, QKV_FUZZ_CORPUS the corpus directory; for the
# long run, QKV_FUZZ_JOBS=N runs N processes sharing the corpus (logs in build/fuzz/fuzz-<i>.log) and
# QKV_FUZZ_RUNS=n stops each process after n executions. A finding
# is written to build/fuzz/artifacts/ and the script fails; reproduce it with `build/fuzz/fuzz/fuzz_attention <file>`
# (or build/fuzz-bounded/fuzz/fuzz_attention, the binary that found it in a bounded run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=${1:-bounded}
preset=fuzz
if [[ $mode == bounded ]]; then preset=fuzz-bounded; fi
binary=build/$preset/fuzz/fuzz_attention
seeds=fuzz/corpus/attention
work=${QKV_FUZZ_CORPUS:-build/fuzz/corpus/attention}  # the growing corpus (not committed)
artifacts=build/fuzz/artifacts/

build() {
  cmake --preset "$preset" >/dev/null
  cmake --build "build/$preset" --target fuzz_attention -j2
}

# The fuzzer reports leaks, aborts on the first finding and prints the stack (halt_on_error: UBSan findings too).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:print_stacktrace=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

case $mode in
  bounded)
    build
    mkdir -p "$work" "$artifacts"
    # Replay every committed seed once (each option and corruption), then fuzz from them.
    "$binary" -runs=0 "$seeds"
    "$binary" -max_total_time="${QKV_FUZZ_SECONDS:-180}" -print_final_stats=1 -artifact_prefix="$artifacts" \
      "$work" "$seeds"
    ;;
  long)
    build
    mkdir -p "$work" "$artifacts"
    extra=()
    if [[ -n ${QKV_FUZZ_RUNS:-} ]]; then extra+=(-runs="$QKV_FUZZ_RUNS"); fi
    jobs=${QKV_FUZZ_JOBS:-1}
    if ((jobs > 1)); then
      # libFuzzer's -jobs: N independent processes that reload the shared corpus directory; run from build/fuzz so
      # their fuzz-<i>.log files land there.
      work=$(realpath "$work") seeds=$(realpath "$seeds") artifacts=$(realpath "$artifacts")/ binary=$(realpath "$binary")
      cd build/fuzz
      extra+=(-jobs="$jobs" -workers="$jobs")
    fi
    "$binary" -max_total_time="${2:-21600}" -print_final_stats=1 -artifact_prefix="$artifacts" "${extra[@]}" \
      "$work" "$seeds"
    ;;
  seeds)
    build
    mkdir -p "$seeds"
    rm -f "$seeds"/seed_*  # the regression_* inputs (past findings) stay
    QKV_FUZZ_WRITE_SEEDS="$seeds" "$binary"
    ;;
  *)
    echo "usage: $0 bounded | long [seconds] | seeds" >&2
    exit 2
    ;;
esac
