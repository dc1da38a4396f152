// qkv/errors.hpp — the two exception types of qkv and the one place that raises them.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "qkv/config.hpp"

namespace qkv {

/// Thrown for every bad shape, stride or option a public function is given. The message names the function,
/// the argument, the axis and both sizes, e.g.
/// "qkv::attention: k axis 0 (B) has extent 3, expected 2 (the extent of q axis 0)".
class shape_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown when a backend is asked for explicitly where it does not exist for the scalar type (`Backend::fused`
/// with double: the fused kernel exists for float only).
class unsupported_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

/// Raises `Error` with `message`; without exceptions (-fno-exceptions) prints the message to stderr and aborts.
template <class Error>
[[noreturn]] inline void raise(const std::string& message) {
#if QKV_HAS_EXCEPTIONS
  throw Error(message);
#else
  std::fprintf(stderr, "%s\n", message.c_str());
  std::abort();
#endif
}

/// Builds a message from any streamable parts: `concat("a ", 3, " b")`.
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream stream;
  (stream << ... << parts);
  return stream.str();
}

/// A message part written only when it is streamed: `check_shape` passes its parts by reference and builds the
/// message only on failure, so a part that takes work to describe (a view's layout, two views' overlap) wraps that
/// work in a `Deferred` and costs nothing on the success path — no string, no allocation, per call.
template <class Write>
struct Deferred {
  Write write;  // void(std::ostream&)
};
template <class Write>
Deferred<Write> deferred(Write write) {
  return {std::move(write)};
}
template <class Write>
std::ostream& operator<<(std::ostream& stream, const Deferred<Write>& part) {
  part.write(stream);
  return stream;
}

/// `if (!condition) raise<shape_error>(concat(parts...))`, with the message built only on failure.
template <class... Parts>
inline void check_shape(bool condition, const Parts&... parts) {
  if (!condition) raise<shape_error>(concat(parts...));
}

}  // namespace detail
}  // namespace qkv
