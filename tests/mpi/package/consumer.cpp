// The program of tests/mpi/package/: a causal ring attention over the ranks of MPI_COMM_WORLD (zigzag), each rank's
// rows against qkv::attention of the whole sequence in this process, in double (the reference path on both sides,
// so they agree to rounding). Prints "qkv_mpi_consumer: ok" on rank 0 and returns 0 when every rank agrees.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <qkv/mpi.hpp>
#include <vector>

int main(int argc, char** argv) {
  qkv::mpi::Environment mpi(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const qkv::Index T = 19, D = 4;
  std::vector<double> q(T * D), k(T * D), v(T * D);
  for (qkv::Index n = 0; n < T * D; ++n) {
    q[n] = std::sin(0.7 * n);
    k[n] = std::cos(0.3 * n);
    v[n] = 0.01 * n;
  }
  const auto rows = qkv::mpi::shard_rows(T, rank, size, qkv::mpi::ShardLayout::zigzag);
  std::vector<double> q_own, k_own, v_own;
  for (const auto& range : rows) {
    q_own.insert(q_own.end(), q.begin() + range.first * D, q.begin() + range.second * D);
    k_own.insert(k_own.end(), k.begin() + range.first * D, k.begin() + range.second * D);
    v_own.insert(v_own.end(), v.begin() + range.first * D, v.begin() + range.second * D);
  }
  const qkv::Index own = static_cast<qkv::Index>(q_own.size()) / D;
  std::vector<double> out(q_own.size()), lse(own), whole(q.size());
  qkv::AttentionOptions<double> options;
  options.causal = true;
  qkv::mpi::ring_attention<double>(MPI_COMM_WORLD, qkv::TensorView4<const double>(q_own.data(), {1, 1, own, D}),
                                   qkv::TensorView4<const double>(k_own.data(), {1, 1, own, D}),
                                   qkv::TensorView4<const double>(v_own.data(), {1, 1, own, D}),
                                   qkv::TensorView4<double>(out.data(), {1, 1, own, D}),
                                   qkv::TensorView3<double>(lse.data(), {1, 1, own}), options,
                                   qkv::mpi::ShardLayout::zigzag);
  qkv::attention<double>(qkv::TensorView4<const double>(q.data(), {1, 1, T, D}),
                         qkv::TensorView4<const double>(k.data(), {1, 1, T, D}),
                         qkv::TensorView4<const double>(v.data(), {1, 1, T, D}),
                         qkv::TensorView4<double>(whole.data(), {1, 1, T, D}), options);
  int ok = 1;
  qkv::Index n = 0;
  for (const auto& range : rows)
    for (qkv::Index i = range.first; i < range.second; ++i, ++n)
      for (qkv::Index d = 0; d < D; ++d)
        if (std::fabs(out[n * D + d] - whole[i * D + d]) > 1e-12) ok = 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("qkv_mpi_consumer: %s, %d ranks\n", ok ? "ok" : "MISMATCH", size);
  return ok ? 0 : 1;
}
