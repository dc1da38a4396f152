#!/usr/bin/env bash
# The MPI component as a user gets it: qkv installed with QKV_MPI=ON (no GoogleTest, no -march), then a consumer
# project's find_package(qkv COMPONENTS mpi) → qkv::mpi, built and run under mpirun with 2 ranks; and the same
# find_package against a qkv installed without QKV_MPI must fail at configure time, naming the missing component.
#
#   bash tests/mpi/package.sh      # needs Open MPI (libopenmpi-dev, openmpi-bin); a mktemp -d work directory
set -euo pipefail

source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
work=$(mktemp -d "${TMPDIR:-/tmp}/qkv-mpi-package.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() {
  echo "package.sh: FAILED: $*" >&2
  exit 1
}
unset CXXFLAGS CPPFLAGS
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
common=("${generator[@]}" -DCMAKE_CXX_COMPILER="${CXX:-g++}" -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)

for mpi in ON OFF; do
  cmake -S "$source_dir" -B "$work/qkv-$mpi" "${common[@]}" -DQKV_MPI=$mpi -DQKV_BUILD_TESTS=OFF \
    -DQKV_BUILD_EXAMPLES=OFF -DQKV_BUILD_BENCH=OFF >"$work/qkv-$mpi.log" 2>&1 || { cat "$work/qkv-$mpi.log"; fail "configure QKV_MPI=$mpi"; }
  cmake --install "$work/qkv-$mpi" --prefix "$work/prefix-$mpi" >/dev/null || fail "install QKV_MPI=$mpi"
done
[[ -f $work/prefix-ON/share/cmake/qkv/qkvMpiTargets.cmake ]] || fail "QKV_MPI=ON installed no qkvMpiTargets.cmake"
[[ ! -e $work/prefix-OFF/share/cmake/qkv/qkvMpiTargets.cmake ]] || fail "QKV_MPI=OFF installed qkvMpiTargets.cmake"

consumer=$source_dir/tests/mpi/package
cmake -S "$consumer" -B "$work/consumer" "${common[@]}" -DCMAKE_PREFIX_PATH="$work/prefix-ON" >"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "find_package(qkv COMPONENTS mpi) of a QKV_MPI=ON install"; }
cmake --build "$work/consumer" -j2 || fail "build of the MPI consumer"
mpiexec -n 2 --oversubscribe --allow-run-as-root "$work/consumer/qkv_mpi_consumer" | tee "$work/run.log"
grep -q "qkv_mpi_consumer: ok, 2 ranks" "$work/run.log" || fail "the MPI consumer did not print ok"

if cmake -S "$consumer" -B "$work/consumer-off" "${common[@]}" -DCMAKE_PREFIX_PATH="$work/prefix-OFF" \
  >"$work/consumer-off.log" 2>&1; then
  fail "find_package(qkv COMPONENTS mpi) succeeded against a qkv installed without QKV_MPI"
fi
grep -q "installed without QKV_MPI=ON" "$work/consumer-off.log" || { cat "$work/consumer-off.log"; fail "no message"; }
echo "package.sh: find_package(qkv COMPONENTS mpi): qkv::mpi found and run; rejected without QKV_MPI, with its message"
