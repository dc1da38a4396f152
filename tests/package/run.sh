#!/usr/bin/env bash
# qkv packaging, end to end: the three ways a user gets qkv into a CMake project, each as that user would, on a
# machine without GoogleTest (CMAKE_DISABLE_FIND_PACKAGE_GTest: any find_package(GTest) fails) and without -march.
#
#   bash tests/package/run.sh             # from anywhere; works in a mktemp -d directory, removed at the end
#   QKV_PACKAGE_KEEP=1 bash tests/package/run.sh   # keep the work directory (its path is printed)
#   CXX=clang++ bash tests/package/run.sh          # another compiler (default g++)
#   QKV_PACKAGE_BUILD_TYPE=Release bash tests/package/run.sh   # default: none (the compiler's default, -O0: the
#                                                   # consumers test packaging, and qkv's headers are long to optimize)
#
# 1. install: configure the qkv tree out of source with no option at all, on a bare machine (GTest, benchmark and
#    nlohmann_json hidden), so QKV_BUILD_TESTS/BENCH/EXAMPLES must default to OFF; cmake --install into a temporary
#    prefix; check the installed files (headers, config, both exported targets). A second configure with
#    QKV_DISPATCH=OFF must export QKV_DISPATCH=0 on both targets.
# 2. find_package: the consumer finds that prefix (and only it), builds against qkv::qkv and qkv::qkv_serial, runs.
# 3. add_subdirectory, 4. FetchContent (local source, no network): build, run, then cmake --install the consumer:
#    its prefix must hold the consumer program and no qkv file; again with -DQKV_INSTALL=ON: now qkv's headers and
#    package files must be there too.
# Each program checks its results and whether it was compiled with OpenMP (_OPENMP) as its target promises; this
# script checks the printed line again. Any failure stops the script with a message and a non-zero exit.
set -euo pipefail

source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
work=$(mktemp -d "${TMPDIR:-/tmp}/qkv-package.XXXXXX")
cleanup() {
  if [[ ${QKV_PACKAGE_KEEP:-0} == 1 ]]; then
    echo "run.sh: work directory kept: $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

fail() {
  echo "run.sh: FAILED: $*" >&2
  exit 1
}
step() { printf '\n== package: %s\n' "$*"; }

# The consumers must see no -march and no GoogleTest, whatever the caller's environment says.
unset CXXFLAGS CPPFLAGS
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
common=("${generator[@]}" -DCMAKE_CXX_COMPILER="${CXX:-g++}" -DCMAKE_BUILD_TYPE="${QKV_PACKAGE_BUILD_TYPE:-}"
        -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)

configure() {  # configure <source> <build> [-D...]: cmake configure, output kept in <build>.log and shown on failure
  local source=$1 build=$2
  shift 2
  if ! cmake -S "$source" -B "$build" "${common[@]}" "$@" >"$build.log" 2>&1; then
    cat "$build.log"
    fail "configure of $source"
  fi
  grep -E '^-- qkv' "$build.log" || true
}

build() {  # build <build dir>: build -j1, then check no compile command carries -march
  cmake --build "$1" -j1 || fail "build of $1"
  if grep -q -- '-march' "$1/compile_commands.json"; then
    fail "a compile command in $1 carries -march"
  fi
}

run_consumer() {  # run_consumer <program> <expected _OPENMP text>: run, check its verdict and its OpenMP line
  local output
  output=$("$1") || { echo "$output"; fail "$1 exited non-zero"; }
  echo "$output"
  [[ $output == *": ok, "* ]] || fail "$1 did not print ok"
  [[ $output == *"; $2" ]] || fail "$1: expected '$2'"
}

need_file() { [[ -f $1 ]] || fail "missing: $1"; }

check_prefix() {  # check_prefix <prefix> <program> with|without: the consumer's install prefix, with or without qkv
  local prefix=$1 program=$2 qkv=$3
  need_file "$prefix/bin/$program"
  if [[ $qkv == with ]]; then
    need_file "$prefix/include/qkv/qkv.hpp"
    need_file "$prefix/share/cmake/qkv/qkvConfig.cmake"
    need_file "$prefix/share/cmake/qkv/qkvTargets.cmake"
    echo "$prefix: $program and qkv's headers and package files (QKV_INSTALL=ON)"
  else
    if [[ -e $prefix/include/qkv || -e $prefix/share/cmake/qkv ]]; then
      find "$prefix" -type f -path "*qkv*" | sed -n "1,5s/^/  /p"
      fail "cmake --install of a consumer installed qkv's files with QKV_INSTALL at its default"
    fi
    echo "$prefix: $program only, no qkv file (QKV_INSTALL default: OFF)"
  fi
}

openmp_expected="_OPENMP defined"  # what qkv::qkv gives; qkv::qkv_serial always gives "_OPENMP not defined"

# ---- 1. install ----------------------------------------------------------------------------------------------------
step "install qkv without GoogleTest (no options; GTest, benchmark, nlohmann_json hidden)"
configure "$source_dir" "$work/qkv-build" -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
for option in QKV_BUILD_TESTS QKV_BUILD_BENCH QKV_BUILD_EXAMPLES; do
  grep -q "^$option:BOOL=OFF$" "$work/qkv-build/CMakeCache.txt" || fail "$option did not default to OFF"
done
grep -q '^QKV_INSTALL:BOOL=ON$' "$work/qkv-build/CMakeCache.txt" || fail "QKV_INSTALL is not ON at top level"
if grep -q 'qkv::qkv with OpenMP OFF' "$work/qkv-build.log"; then
  openmp_expected="_OPENMP not defined"
  echo "OpenMP not found for ${CXX:-g++}: qkv::qkv is serial too"
fi
cmake --install "$work/qkv-build" --prefix "$work/prefix" >"$work/install.log" || fail "cmake --install of qkv"
need_file "$work/prefix/include/qkv/qkv.hpp"
need_file "$work/prefix/share/cmake/qkv/qkvConfig.cmake"
need_file "$work/prefix/share/cmake/qkv/qkvConfigVersion.cmake"
targets=$work/prefix/share/cmake/qkv/qkvTargets.cmake
need_file "$targets"
grep -q 'add_library(qkv::qkv INTERFACE IMPORTED)' "$targets" || fail "qkv::qkv is not exported"
grep -q 'add_library(qkv::qkv_serial INTERFACE IMPORTED)' "$targets" || fail "qkv::qkv_serial is not exported"
if grep -q 'QKV_DISPATCH' "$targets"; then fail "QKV_DISPATCH is defined although QKV_DISPATCH is ON"; fi
echo "installed $(find "$work/prefix" -type f | wc -l) files into $work/prefix"

configure "$source_dir" "$work/qkv-build-nodispatch" -DQKV_BUILD_TESTS=OFF -DQKV_BUILD_BENCH=OFF \
  -DQKV_BUILD_EXAMPLES=OFF -DQKV_DISPATCH=OFF
cmake --install "$work/qkv-build-nodispatch" --prefix "$work/prefix-nodispatch" >/dev/null || fail "install (dispatch OFF)"
count=$(grep -c 'INTERFACE_COMPILE_DEFINITIONS "QKV_DISPATCH=0"' "$work/prefix-nodispatch/share/cmake/qkv/qkvTargets.cmake" || true)
[[ $count == 2 ]] || fail "QKV_DISPATCH=OFF: expected QKV_DISPATCH=0 on both exported targets, found $count"
echo "QKV_DISPATCH=OFF exports QKV_DISPATCH=0 on qkv::qkv and qkv::qkv_serial"

# ---- 2. find_package -----------------------------------------------------------------------------------------------
step "find_package(qkv) from the installed prefix: qkv::qkv and qkv::qkv_serial"
configure "$source_dir/tests/package/find_package" "$work/find_package" -DCMAKE_PREFIX_PATH="$work/prefix"
grep -q "^qkv_DIR:PATH=$work/prefix/share/cmake/qkv$" "$work/find_package/CMakeCache.txt" ||
  fail "find_package(qkv) did not find the temporary prefix: $(grep '^qkv_DIR' "$work/find_package/CMakeCache.txt")"
build "$work/find_package"
run_consumer "$work/find_package/qkv_find_package_consumer" "$openmp_expected"
run_consumer "$work/find_package/qkv_find_package_consumer_serial" "_OPENMP not defined"

# ---- 3. add_subdirectory, 4. FetchContent --------------------------------------------------------------------------
subproject() {  # subproject <name> <program> <configure args>...: qkv as a subproject of the consumer <name>
  local name=$1 program=$2
  shift 2
  step "$name: build, run, cmake --install without and with QKV_INSTALL"
  configure "$source_dir/tests/package/$name" "$work/$name" "$@"
  build "$work/$name"
  run_consumer "$work/$name/$program" "$openmp_expected"
  cmake --install "$work/$name" --prefix "$work/$name-prefix" >/dev/null || fail "cmake --install of the $name consumer"
  check_prefix "$work/$name-prefix" "$program" without
  configure "$source_dir/tests/package/$name" "$work/$name" -DQKV_INSTALL=ON
  build "$work/$name"
  cmake --install "$work/$name" --prefix "$work/$name-prefix-qkv" >/dev/null || fail "cmake --install, QKV_INSTALL=ON"
  check_prefix "$work/$name-prefix-qkv" "$program" with
}

subproject add_subdirectory qkv_add_subdirectory_consumer -DQKV_SOURCE_DIR="$source_dir"
subproject fetch_content qkv_fetch_content_consumer \
  -DFETCHCONTENT_SOURCE_DIR_QKV="$source_dir" -DFETCHCONTENT_FULLY_DISCONNECTED=ON

printf '\n== package: all passed (install without GoogleTest, find_package, add_subdirectory, FetchContent)\n'
