// tests/support/expect_shape_error.hpp — the check behind every error test: a call throws qkv::shape_error (not another
// exception) whose message names the qkv function that threw and contains the parts a message must state (the
// argument, the axis, both sizes).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "qkv/errors.hpp"

namespace qkv_test {

/// Runs `call` and expects a qkv::shape_error whose message starts with "qkv::" and contains every one of `parts`.
template <class F>
void expect_shape_error(F&& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected qkv::shape_error";
  } catch (const qkv::shape_error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("qkv::", 0), 0u) << "the message does not start with the function's name: " << message;
    for (const auto& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

}  // namespace qkv_test
