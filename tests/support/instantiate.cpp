// The instantiations of qkv's entry points that every test executable shares (tests/CMakeLists.txt, qkv_add_test):
// compiled once per build instead of once per suite (qkv/instantiate.hpp).
#include <qkv/instantiate.hpp>
