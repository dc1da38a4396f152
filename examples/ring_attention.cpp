// A long causal sequence split over MPI ranks with ring attention (qkv/mpi.hpp), checked against one process.
//
//   mpirun -np 3 ./build/mpi/examples/ring_attention            # as root add --allow-run-as-root; more ranks than
//   mpirun -np 4 --oversubscribe ./build/mpi/examples/ring_attention 8192   # cores: --oversubscribe
//
// Every rank builds the same sequence (T rows, 4 heads of 64, GQA 4/2, causal) from one seed, keeps its own rows in
// the zigzag layout (qkv::mpi::shard_rows), and runs qkv::mpi::ring_attention on them; then it computes the whole
// sequence with qkv::attention in this one process and compares its rows. The comparison is only for the example:
// the point of the ring is that no rank ever needs the whole sequence. Prints, per rank, its rows, its time and its
// largest difference; exits 1 if a difference exceeds 1e-5 (float, both sides within about 1e-6 of float64 here).
// Build: cmake -DQKV_MPI=ON (target qkv::mpi), see the README, "Beyond one machine".
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "qkv/mpi.hpp"

int main(int argc, char** argv) {
  qkv::mpi::Environment mpi(&argc, &argv);  // MPI_Init_thread(MPI_THREAD_FUNNELED)
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const qkv::Index T = argc > 1 ? std::atol(argv[1]) : 2048, B = 1, Hq = 4, Hkv = 2, D = 64;

  // The whole sequence, the same on every rank: q [B, Hq, T, D], k and v [B, Hkv, T, D], N(0, 1).
  std::mt19937 rng(2023);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<std::size_t>(B * Hq * T * D)), k(static_cast<std::size_t>(B * Hkv * T * D)),
      v(k.size());
  for (auto* tensor : {&q, &k, &v})
    for (float& x : *tensor) x = normal(rng);

  // This rank's rows: two chunks of the sequence cut into 2·size, chunks rank and 2·size − 1 − rank.
  const auto layout = qkv::mpi::ShardLayout::zigzag;
  const auto rows = qkv::mpi::shard_rows(T, rank, size, layout);
  qkv::Index own = 0;
  for (const auto& range : rows) own += range.second - range.first;
  const auto take = [&](const std::vector<float>& whole, qkv::Index H) {
    std::vector<float> part;
    for (qkv::Index h = 0; h < B * H; ++h)
      for (const auto& range : rows)
        part.insert(part.end(), whole.begin() + (h * T + range.first) * D, whole.begin() + (h * T + range.second) * D);
    return part;
  };
  const std::vector<float> q_own = take(q, Hq), k_own = take(k, Hkv), v_own = take(v, Hkv);
  std::vector<float> out(static_cast<std::size_t>(B * Hq * own * D)), lse(static_cast<std::size_t>(B * Hq * own));

  qkv::AttentionOptions<float> options;
  options.causal = true;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, qkv::TensorView4<const float>(q_own.data(), {B, Hq, own, D}),
                                  qkv::TensorView4<const float>(k_own.data(), {B, Hkv, own, D}),
                                  qkv::TensorView4<const float>(v_own.data(), {B, Hkv, own, D}),
                                  qkv::TensorView4<float>(out.data(), {B, Hq, own, D}),
                                  qkv::TensorView3<float>(lse.data(), {B, Hq, own}), options, layout);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // One process, the whole sequence: this rank's rows must agree.
  std::vector<float> whole_out(q.size()), whole_lse(static_cast<std::size_t>(B * Hq * T));
  qkv::attention<float>(
      qkv::TensorView4<const float>(q.data(), {B, Hq, T, D}), qkv::TensorView4<const float>(k.data(), {B, Hkv, T, D}),
      qkv::TensorView4<const float>(v.data(), {B, Hkv, T, D}), qkv::TensorView4<float>(whole_out.data(), {B, Hq, T, D}),
      qkv::TensorView3<float>(whole_lse.data(), {B, Hq, T}), options);
  const std::vector<float> expected = take(whole_out, Hq);
  double difference = 0;
  for (std::size_t n = 0; n < out.size(); ++n)
    difference = std::max(difference, std::fabs(static_cast<double>(out[n]) - expected[n]));
  for (qkv::Index h = 0, n = 0; h < B * Hq; ++h)
    for (const auto& range : rows)
      for (qkv::Index i = range.first; i < range.second; ++i, ++n)
        difference = std::max(difference, std::fabs(static_cast<double>(lse[static_cast<std::size_t>(n)]) -
                                                    whole_lse[static_cast<std::size_t>(h * T + i)]));

  std::printf("rank %d of %d: rows [%ld, %ld) and [%ld, %ld) of %ld, ring attention %.3f s, max |difference| %.2e\n",
              rank, size, static_cast<long>(rows[0].first), static_cast<long>(rows[0].second),
              static_cast<long>(rows[1].first), static_cast<long>(rows[1].second), static_cast<long>(T), seconds,
              difference);
  int ok = difference <= 1e-5 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s\n", ok ? "every rank agrees with one process" : "MISMATCH");
  return ok ? 0 : 1;
}
