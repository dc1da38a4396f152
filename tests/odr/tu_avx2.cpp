// Built with -march=x86-64-v3 (AVX2 + FMA): see odr_unit.hpp.
#define QKV_ODR_UNIT avx2
#include "odr_unit.hpp"
