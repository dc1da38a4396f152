#!/usr/bin/env bash
# Ring attention on this machine: one process against 2 ranks (zigzag and contiguous), causal, B = 1, H = 8,
# D = 128, one OpenMP thread per rank; prints bench/bench_mpi.cpp's lines and a table of speedups over one process, by
# wall time and by the slowest rank's CPU time (what each rank would take on a core of its own: the machine is shared).
# Ends with the cost model's predictions from the measured blocks (scripts/distributed_model.py).
#
#   bash scripts/bench_mpi.sh [T ...]                # default: 16384 65536 (8.5 minutes on the shared 2-core Zen 3)
#   QKV_BENCH_MPI_RANKS=4 bash scripts/bench_mpi.sh  # more ranks (needs that many cores to mean anything)
#
# Builds bench_mpi in build/mpi-bench (g++ -O3 -DNDEBUG -march=native, QKV_MPI=ON, QKV_DISPATCH=OFF) first.
# Needs Open MPI (libopenmpi-dev, openmpi-bin). Numbers and their reading: docs/distributed.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
lengths=("$@")
((${#lengths[@]})) || lengths=(16384 65536)
ranks=${QKV_BENCH_MPI_RANKS:-2}
build=build/mpi-bench
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=g++ -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE="-O3 -DNDEBUG" -DQKV_ARCH=native -DQKV_DISPATCH=OFF -DQKV_MPI=ON -DQKV_BUILD_TESTS=OFF \
    -DQKV_BUILD_EXAMPLES=OFF -DQKV_BUILD_BENCH=ON >/dev/null
fi
cmake --build "$build" -j2 --target bench_mpi
launcher=(mpiexec --allow-run-as-root --oversubscribe --bind-to none)
export OMP_NUM_THREADS=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"${launcher[@]}" -n 1 "$build/bench/bench_mpi" "${lengths[@]}" | tee -a "$log"
"${launcher[@]}" -n "$ranks" "$build/bench/bench_mpi" "${lengths[@]}" | tee -a "$log"
echo
echo "T       layout      ranks  seconds  speedup   cpu_seconds  speedup by CPU time  wait fraction"
awk '/^result/ {
  for (i = 2; i <= NF; ++i) { split($i, kv, "="); f[kv[1]] = kv[2] }
  if (f["layout"] == "single") { single[f["T"]] = f["seconds"]; single_cpu[f["T"]] = f["cpu_seconds"] }
  row[++n] = f["T"] " " f["layout"] " " f["ranks"] " " f["seconds"] " " f["cpu_seconds"] " " f["wait_fraction"]
}
END {
  for (r = 1; r <= n; ++r) {
    split(row[r], c, " ")
    wait = c[6] == "nan" ? "-" : sprintf("%.3f", c[6])
    printf "%-7s %-11s %5s  %7.2f  %6.2f  %11.2f  %6.2f               %s\n", c[1], c[2], c[3], c[4], single[c[1]] / c[4],
           c[5], single_cpu[c[1]] / c[5], wait
  }
}' "$log"
echo
python3 scripts/distributed_model.py "$log"
