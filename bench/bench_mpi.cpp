// bench/bench_mpi.cpp — context parallelism on one machine: ring attention over MPI ranks (zigzag and contiguous)
// against one process's qkv::attention. Causal prefill, B = 1, H = 8 (multi-head), D = Dv = 128, one OpenMP thread
// per rank (run with OMP_NUM_THREADS=1), for each sequence length T given on the command line.
//
//   OMP_NUM_THREADS=1 mpirun -np 1 build/mpi-bench/bench/bench_mpi 16384 65536   # one process: qkv::attention
//   OMP_NUM_THREADS=1 mpirun -np 2 build/mpi-bench/bench/bench_mpi 16384 65536   # the ring and Ulysses
//   bash scripts/bench_mpi.sh 16384 65536                                        # both, and the speedups
//
// With one rank: qkv::attention on the whole sequence, and the time of one ring block alone (n queries × n keys,
// unmasked, n = 64 … 4096: the per-step compute the cost model scales). With more: the ring in zigzag layout for every
// T, and, for T ≤ 16384 only (to keep the run near 5 minutes on 2 cores), the ring in contiguous layout (the causal
// imbalance) and Ulysses.
// Not Google Benchmark: every configuration is a collective call that all ranks must enter the same number of times,
// and one run of it takes seconds to minutes, so each is timed once, from a barrier to the slowest rank's return.
// Printed per configuration (one `result` line, parsed by scripts/bench_mpi.sh): the time (the slowest rank's), the
// slowest rank's process CPU time (MPI's polling in waits included: on a shared machine, the time a rank would take on
// a core of its own),
// GFLOPS over the visible (query, key) pairs (2·(D + Dv) flops each, per head), and for the ring each rank's compute
// and wait seconds (MPI_Waitall after each step's computation: qkv::mpi::detail::RingTimes), its wait fraction, its
// attention calls, and the per-step compute time; then one block exchange timed alone (the shared-memory bandwidth of
// the ring's step, for docs/distributed.md's cost model). Correctness is checked outside the timed call: a few rows of
// each rank's result against qkv::attention of those rows over the whole K/V (global positions), in the same process.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "qkv/isa.hpp"
#include "qkv/mpi.hpp"

namespace {

using qkv::Index;
constexpr Index kHeads = 8, kD = 128;

/// A deterministic value in [−1, 1) for element n of tensor `which` (splitmix64): every rank makes the rows it needs
/// without the others.
float value_at(std::uint64_t which, std::uint64_t n) {
  std::uint64_t z = which * 0x9E3779B97F4A7C15ull + n + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

/// Rows `ranges` of the [1, kHeads, T, kD] tensor `which`, dense [1, kHeads, rows, kD].
std::vector<float> make_rows(std::uint64_t which, Index T, const std::vector<std::pair<Index, Index>>& ranges) {
  std::vector<float> data;
  for (Index h = 0; h < kHeads; ++h)
    for (const auto& range : ranges)
      for (Index i = range.first; i < range.second; ++i)
        for (Index d = 0; d < kD; ++d)
          data.push_back(value_at(which, static_cast<std::uint64_t>((h * T + i) * kD + d)));
  return data;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// This process's CPU time (all its threads, MPI's polling included): on a shared machine, what a rank would take on a
/// core of its own.
double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

/// GFLOPS of a causal call over T queries and keys: T·(T+1)/2 visible pairs per head.
double gflops(Index T, double seconds) {
  const double pairs = 0.5 * static_cast<double>(T) * static_cast<double>(T + 1) * kHeads;
  return pairs * 2.0 * (kD + kD) / seconds * 1e-9;
}

/// The largest |difference| of a few rows (each chunk's first and last) against qkv::attention of those rows alone over
/// the whole K/V (global positions), outside the timed call.
double spot_check(Index T, const std::vector<std::pair<Index, Index>>& rows, const std::vector<float>& out,
                  const qkv::AttentionOptions<float>& options) {
  const auto all = std::vector<std::pair<Index, Index>>{{0, T}};
  const std::vector<float> k = make_rows(1, T, all), v = make_rows(2, T, all);
  Index own = 0;
  for (const auto& range : rows) own += range.second - range.first;
  double difference = 0;
  Index offset = 0;
  for (const auto& range : rows) {
    for (Index i : {range.first, range.second - 1}) {
      if (range.second <= range.first) continue;
      const std::vector<float> q = make_rows(0, T, {{i, i + 1}});
      std::vector<float> expected(static_cast<std::size_t>(kHeads * kD));
      qkv::AttentionOptions<float> one_row = options;
      one_row.global_positions = qkv::GlobalPositions{i, 0, T, T};
      qkv::attention<float>(qkv::TensorView4<const float>(q.data(), {1, kHeads, 1, kD}),
                            qkv::TensorView4<const float>(k.data(), {1, kHeads, T, kD}),
                            qkv::TensorView4<const float>(v.data(), {1, kHeads, T, kD}),
                            qkv::TensorView4<float>(expected.data(), {1, kHeads, 1, kD}), one_row);
      const Index local = offset + (i - range.first);
      for (Index h = 0; h < kHeads; ++h)
        for (Index d = 0; d < kD; ++d)
          difference =
              std::max(difference, std::fabs(double(out[static_cast<std::size_t>((h * own + local) * kD + d)]) -
                                             expected[static_cast<std::size_t>(h * kD + d)]));
    }
    offset += range.second - range.first;
  }
  return difference;
}

/// One process: qkv::attention on the whole sequence.
void run_single(Index T) {
  const auto all = std::vector<std::pair<Index, Index>>{{0, T}};
  const std::vector<float> q = make_rows(0, T, all), k = make_rows(1, T, all), v = make_rows(2, T, all);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kHeads * T));
  qkv::AttentionOptions<float> options;
  options.causal = true;
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  qkv::attention<float>(qkv::TensorView4<const float>(q.data(), {1, kHeads, T, kD}),
                        qkv::TensorView4<const float>(k.data(), {1, kHeads, T, kD}),
                        qkv::TensorView4<const float>(v.data(), {1, kHeads, T, kD}),
                        qkv::TensorView4<float>(out.data(), {1, kHeads, T, kD}),
                        qkv::TensorView3<float>(lse.data(), {1, kHeads, T}), options);
  const double seconds = seconds_since(start), cpu = cpu_seconds() - cpu_start;
  const double check = spot_check(T, all, out, options);
  std::printf(
      "result T=%ld ranks=1 layout=single seconds=%.3f cpu_seconds=%.3f gflops=%.1f wait_fraction=0 check=%.1e\n",
      static_cast<long>(T), seconds, cpu, gflops(T, seconds), check);
}

/// The time of one unmasked block of n queries × n keys (B = 1, H = 8, D = 128), the best of a few calls: what one
/// ring step computes per (query chunk, key chunk) pair below the diagonal.
void run_blocks() {
  for (Index n : {64, 128, 256, 512, 1024, 2048, 4096}) {
    const auto rows = std::vector<std::pair<Index, Index>>{{0, n}};
    const std::vector<float> q = make_rows(0, n, rows), k = make_rows(1, n, rows), v = make_rows(2, n, rows);
    std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kHeads * n));
    qkv::AttentionOptions<float> options;
    double best = 1e30;
    const int repeats = n <= 1024 ? 5 : 2;
    for (int repeat = 0; repeat < repeats; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
      qkv::attention<float>(qkv::TensorView4<const float>(q.data(), {1, kHeads, n, kD}),
                            qkv::TensorView4<const float>(k.data(), {1, kHeads, n, kD}),
                            qkv::TensorView4<const float>(v.data(), {1, kHeads, n, kD}),
                            qkv::TensorView4<float>(out.data(), {1, kHeads, n, kD}),
                            qkv::TensorView3<float>(lse.data(), {1, kHeads, n}), options);
      best = std::min(best, seconds_since(start));
    }
    const double flops = static_cast<double>(n) * static_cast<double>(n) * kHeads * 2.0 * (kD + kD);
    std::printf("block n=%ld seconds=%.6f gflops=%.1f\n", static_cast<long>(n), best, flops / best * 1e-9);
  }
}

/// Ulysses over MPI_COMM_WORLD (contiguous shards); rank 0 prints the result.
void run_ulysses(Index T) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto rows = qkv::mpi::shard_rows(T, rank, size, qkv::mpi::ShardLayout::contiguous);
  const Index own = rows[0].second - rows[0].first;
  const std::vector<float> q = make_rows(0, T, rows), k = make_rows(1, T, rows), v = make_rows(2, T, rows);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kHeads * own));
  qkv::AttentionOptions<float> options;
  options.causal = true;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  qkv::mpi::ulysses_attention<float>(MPI_COMM_WORLD, qkv::TensorView4<const float>(q.data(), {1, kHeads, own, kD}),
                                     qkv::TensorView4<const float>(k.data(), {1, kHeads, own, kD}),
                                     qkv::TensorView4<const float>(v.data(), {1, kHeads, own, kD}),
                                     qkv::TensorView4<float>(out.data(), {1, kHeads, own, kD}),
                                     qkv::TensorView3<float>(lse.data(), {1, kHeads, own}), options);
  double slowest = seconds_since(start), cpu = cpu_seconds() - cpu_start;
  MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &cpu, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  double check = spot_check(T, rows, out, options);
  MPI_Allreduce(MPI_IN_PLACE, &check, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf(
        "result T=%ld ranks=%d layout=ulysses seconds=%.3f cpu_seconds=%.3f gflops=%.1f wait_fraction=nan check=%.1e\n",
        static_cast<long>(T), size, slowest, cpu, gflops(T, slowest), check);
  }
}

/// The ring with `layout` over MPI_COMM_WORLD; rank 0 prints the result and every rank's times.
void run_ring(Index T, qkv::mpi::ShardLayout layout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto rows = qkv::mpi::shard_rows(T, rank, size, layout);
  Index own = 0;
  for (const auto& range : rows) own += range.second - range.first;
  const std::vector<float> q = make_rows(0, T, rows), k = make_rows(1, T, rows), v = make_rows(2, T, rows);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kHeads * own));
  qkv::AttentionOptions<float> options;
  options.causal = true;
  qkv::mpi::detail::RingTimes times;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  qkv::detail::ring_attention_impl<float>(MPI_COMM_WORLD, qkv::TensorView4<const float>(q.data(), {1, kHeads, own, kD}),
                                          qkv::TensorView4<const float>(k.data(), {1, kHeads, own, kD}),
                                          qkv::TensorView4<const float>(v.data(), {1, kHeads, own, kD}),
                                          qkv::TensorView4<float>(out.data(), {1, kHeads, own, kD}),
                                          qkv::TensorView3<float>(lse.data(), {1, kHeads, own}), options, layout,
                                          &times);
  const double mine = seconds_since(start);
  double slowest = mine, cpu = cpu_seconds() - cpu_start;
  MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &cpu, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const double check = spot_check(T, rows, out, options);
  double worst_check = check;
  MPI_Allreduce(MPI_IN_PLACE, &worst_check, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

  // Every rank's times, gathered to rank 0: total, compute, wait, calls, then per step compute and wait.
  std::vector<double> mine_times = {mine, times.compute_seconds, times.wait_seconds, double(times.blocks_computed)};
  for (std::size_t s = 0; s < times.step_compute_seconds.size(); ++s) {
    mine_times.push_back(times.step_compute_seconds[s]);
    mine_times.push_back(times.step_wait_seconds[s]);
  }
  std::vector<double> all_times(mine_times.size() * static_cast<std::size_t>(size));
  MPI_Gather(mine_times.data(), static_cast<int>(mine_times.size()), MPI_DOUBLE, all_times.data(),
             static_cast<int>(mine_times.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    double wait = 0, busy = 0;
    for (int r = 0; r < size; ++r) {
      wait += all_times[static_cast<std::size_t>(r) * mine_times.size() + 2];
      busy += all_times[static_cast<std::size_t>(r) * mine_times.size() + 1];
    }
    const char* name = layout == qkv::mpi::ShardLayout::zigzag ? "zigzag" : "contiguous";
    std::printf(
        "result T=%ld ranks=%d layout=%s seconds=%.3f cpu_seconds=%.3f gflops=%.1f wait_fraction=%.4f check=%.1e\n",
        static_cast<long>(T), size, name, slowest, cpu, gflops(T, slowest), wait / (wait + busy), worst_check);
    for (int r = 0; r < size; ++r) {
      const double* t = &all_times[static_cast<std::size_t>(r) * mine_times.size()];
      std::printf(
          "  rank %d: %.3f s, compute %.3f s, wait %.3f s (%.1f %%), %d attention calls; steps (compute/wait s):", r,
          t[0], t[1], t[2], 100.0 * t[2] / (t[1] + t[2]), static_cast<int>(t[3]));
      for (std::size_t s = 0; s < times.step_compute_seconds.size(); ++s)
        std::printf(" %.3f/%.3f", t[4 + 2 * s], t[5 + 2 * s]);
      std::printf("\n");
    }
  }

  // One ring step's exchange alone (send a block to the next rank, receive one from the previous): the bandwidth the
  // cost model of docs/distributed.md starts from.
  if (size > 1) {
    const std::size_t block = static_cast<std::size_t>(2 * kHeads * own * kD);
    std::vector<float> send(block, 1.0f), receive(block);
    double best = 1e30;
    for (int repeat = 0; repeat < 3; ++repeat) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto exchange = std::chrono::steady_clock::now();
      MPI_Sendrecv(send.data(), static_cast<int>(block), MPI_FLOAT, (rank + 1) % size, 7, receive.data(),
                   static_cast<int>(block), MPI_FLOAT, (rank + size - 1) % size, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      double elapsed = seconds_since(exchange);
      MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      best = std::min(best, elapsed);
    }
    if (rank == 0) {
      std::printf("  one step's exchange alone: %.1f MiB per rank in %.4f s = %.2f GB/s per rank\n",
                  double(block * sizeof(float)) / (1 << 20), best, double(block * sizeof(float)) / best * 1e-9);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  qkv::mpi::Environment mpi(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<Index> lengths;
  for (int a = 1; a < argc; ++a) lengths.push_back(std::atol(argv[a]));
  if (lengths.empty()) lengths = {16384};
  if (rank == 0) {
    std::printf("bench_mpi: %d rank(s), kernel %s, B = 1, H = %ld, D = Dv = %ld, causal, MPI thread level %d\n", size,
                qkv::isa_name(), static_cast<long>(kHeads), static_cast<long>(kD), mpi.thread_level());
  }
  if (size == 1) run_blocks();
  for (Index T : lengths) {
    if (size == 1) {
      run_single(T);
    } else {
      run_ring(T, qkv::mpi::ShardLayout::zigzag);
      if (T <= 16384) {
        run_ring(T, qkv::mpi::ShardLayout::contiguous);
        run_ulysses(T);
      }
    }
    std::fflush(stdout);
  }
  return 0;
}
