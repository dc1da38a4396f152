// Built with -march=x86-64 (no SIMD path): see odr_unit.hpp.
#define QKV_ODR_UNIT baseline
#include "odr_unit.hpp"
