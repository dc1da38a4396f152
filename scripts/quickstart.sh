#!/usr/bin/env bash
# qkv quick start, on Debian 12 / Ubuntu 24.04 (or any machine that already has the tools).
#
#   bash scripts/quickstart.sh example   build and run examples/worked_example (seed 000, example 2.4.1)
#   bash scripts/quickstart.sh test      build and run the default test suite (ctest --preset dev: label quick)
#
# Missing packages are installed with apt-get when run as root; otherwise the one apt-get line to run is printed.
set -euo pipefail

mode=${1:-}
if [[ $mode != example && $mode != test ]]; then
  echo "usage: bash scripts/quickstart.sh example|test" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---- packages: the tools by command, the libraries by dpkg ----------------------------------------------------------
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
dpkg -s libeigen3-dev >/dev/null 2>&1 || missing+=(libeigen3-dev)
dpkg -s nlohmann-json3-dev >/dev/null 2>&1 || missing+=(nlohmann-json3-dev)  # examples/safetensors.hpp (fixtures)
have_gtest=ON
dpkg -s libgtest-dev >/dev/null 2>&1 || have_gtest=OFF
if [[ $mode == test && $have_gtest == OFF ]]; then
  missing+=(libgtest-dev)
fi

if ((${#missing[@]})); then
  if ((EUID == 0)) && command -v apt-get >/dev/null; then
    echo "== installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  else
    echo "qkv needs: ${missing[*]}. Run this, then this script again:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi

# ---- configure, build, run ------------------------------------------------------------------------------------------
jobs=${QKV_JOBS:-$(nproc)}
if [[ $mode == example ]]; then
  # The example needs no GoogleTest: the tests are configured only where it is already installed.
  cmake --preset dev -DQKV_BUILD_TESTS="$have_gtest" -DQKV_BUILD_EXAMPLES=ON
  cmake --build --preset dev -j "$jobs" --target worked_example
  ./build/dev/examples/worked_example
else
  cmake --preset dev -DQKV_BUILD_TESTS=ON -DQKV_BUILD_EXAMPLES=ON
  cmake --build --preset dev -j "$jobs"
  ctest --preset dev
fi
