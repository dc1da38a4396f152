// A reader of safetensors files, the format model weights ship in, for qkv's examples and tests (not part of qkv's
// public API: copy it if it serves you).
//
// The format (Hugging Face's safetensors): an 8-byte little-endian unsigned header length N, then N bytes of JSON,
//   {"linear.weight": {"dtype": "F32", "shape": [120, 360], "data_offsets": [0, 172800]}, ...,
//    "__metadata__": {"generator": "..."}}                         (__metadata__ optional, strings to strings)
// possibly padded with spaces, then the raw little-endian C-order data of every tensor. data_offsets [begin, end)
// count bytes from the first data byte; the tensors cover the data without gap or overlap.
//
// Values are widened to double: exact for F64, F32, I32, I16, I8, U8 and BOOL (0 or 1); an I64 value beyond ±2^53,
// which a double cannot hold, is an error. Other dtypes (F16, BF16, ...) are errors.
//
// Errors name the file and what is wrong (truncated file, bad header length, header not JSON, unknown dtype, offsets
// out of range, shape and size that disagree, gaps, overlaps). try_read reports them in a string and works in builds
// with -fno-exceptions; read throws std::runtime_error. The whole file is read into memory: O(file size).
//
// Needs nlohmann/json (header-only; Debian nlohmann-json3-dev, CMake target nlohmann_json::nlohmann_json).
// Written by scripts/safetensors_writer.py for the fixtures in tests/fixtures/ (see its README).
#ifndef QKV_EXAMPLES_SAFETENSORS_HPP
#define QKV_EXAMPLES_SAFETENSORS_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
#include <stdexcept>
#endif

namespace safetensors {

/// One tensor: its dtype as the file names it ("F32", "BOOL", ...), its shape (empty for a scalar) and its values in
/// C order (last index fastest), widened to double.
struct Tensor {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<double> values;
};

/// The contents of a file: tensors by name, and the optional __metadata__.
struct File {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

namespace detail {

enum class Kind { kFloat, kSigned, kUnsigned, kBool };

struct Dtype {
  const char* name;
  std::size_t bytes;
  Kind kind;
};

constexpr Dtype kDtypes[] = {{"F64", 8, Kind::kFloat},   {"F32", 4, Kind::kFloat},  {"I64", 8, Kind::kSigned},
                             {"I32", 4, Kind::kSigned},  {"I16", 2, Kind::kSigned}, {"I8", 1, Kind::kSigned},
                             {"U8", 1, Kind::kUnsigned}, {"BOOL", 1, Kind::kBool}};

/// The reference implementation's limit on the header size.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t axis = 0; axis < shape.size(); ++axis) s += (axis ? ", " : "") + std::to_string(shape[axis]);
  return s + "]";
}

/// The little-endian unsigned integer of `bytes` bytes at `p`, whatever the host's byte order.
inline std::uint64_t load_little_endian(const unsigned char* p, std::size_t bytes) {
  std::uint64_t bits = 0;
  for (std::size_t b = 0; b < bytes; ++b) bits |= static_cast<std::uint64_t>(p[b]) << (8 * b);
  return bits;
}

/// Decodes `count` elements of `dtype` at `p` into `values`; false with `error` set on a value a double cannot hold
/// exactly (I64) or a BOOL byte other than 0 and 1.
inline bool decode(const Dtype& dtype, const unsigned char* p, std::size_t count, std::vector<double>& values,
                   std::string& error) {
  values.resize(count);
  for (std::size_t i = 0; i < count; ++i, p += dtype.bytes) {
    const std::uint64_t bits = load_little_endian(p, dtype.bytes);
    if (dtype.kind == Kind::kFloat && dtype.bytes == 8) {
      double x;
      std::memcpy(&x, &bits, sizeof x);
      values[i] = x;
    } else if (dtype.kind == Kind::kFloat) {
      const auto bits32 = static_cast<std::uint32_t>(bits);
      float x;
      std::memcpy(&x, &bits32, sizeof x);
      values[i] = x;
    } else if (dtype.kind == Kind::kSigned) {
      const unsigned shift = static_cast<unsigned>(64 - 8 * dtype.bytes);  // sign-extend from the top bit
      const std::int64_t x = static_cast<std::int64_t>(bits << shift) >> shift;
      constexpr std::int64_t kExact = std::int64_t{1} << 53;
      if (x > kExact || x < -kExact) {
        error = std::string(dtype.name) + " value " + std::to_string(x) + " at element " + std::to_string(i) +
                " is beyond 2^53: a double cannot hold it exactly";
        return false;
      }
      values[i] = static_cast<double>(x);
    } else {
      if (dtype.kind == Kind::kBool && bits > 1) {
        error = "BOOL byte " + std::to_string(bits) + " at element " + std::to_string(i) + " is neither 0 nor 1";
        return false;
      }
      values[i] = static_cast<double>(bits);
    }
  }
  return true;
}

/// A non-negative JSON integer into `out`.
inline bool get_size(const nlohmann::json& j, std::uint64_t& out) {
  if (!j.is_number_unsigned()) return false;
  out = j.get<std::uint64_t>();
  return true;
}

/// Reads one header entry `name` → `tensor` against a data section of `data_size` bytes at `data`; `begin` and `end`
/// get its data_offsets. False with `error` set (without the file name) when the entry is malformed.
inline bool read_tensor(const std::string& name, const nlohmann::json& entry, const unsigned char* data,
                        std::uint64_t data_size, Tensor& tensor, std::uint64_t& begin, std::uint64_t& end,
                        std::string& error) {
  const std::string where = "tensor '" + name + "': ";
  const auto dtype_it = entry.is_object() ? entry.find("dtype") : entry.end();
  const auto shape_it = entry.is_object() ? entry.find("shape") : entry.end();
  const auto offsets_it = entry.is_object() ? entry.find("data_offsets") : entry.end();
  if (!entry.is_object() || dtype_it == entry.end() || !dtype_it->is_string() || shape_it == entry.end() ||
      !shape_it->is_array() || offsets_it == entry.end()) {
    error = where + "expected an object with dtype (a string), shape and data_offsets";
    return false;
  }
  tensor.dtype = dtype_it->get<std::string>();
  const Dtype* dtype = nullptr;
  for (const Dtype& d : kDtypes)
    if (tensor.dtype == d.name) dtype = &d;
  if (dtype == nullptr) {
    error = where + "dtype '" + tensor.dtype + "' is not supported (F64, F32, I64, I32, I16, I8, U8, BOOL)";
    return false;
  }
  // The element count, saturated at data_size + 1 so that it cannot overflow (more than data_size never fits).
  std::uint64_t count = 1;
  for (const nlohmann::json& extent : *shape_it) {
    std::uint64_t e = 0;
    if (!get_size(extent, e) || e > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      error = where + "shape must be an array of non-negative integers";
      return false;
    }
    tensor.shape.push_back(static_cast<std::int64_t>(e));
    count = e == 0 ? 0 : count > (data_size + 1) / e ? data_size + 1 : count * e;
  }
  if (!offsets_it->is_array() || offsets_it->size() != 2 || !get_size((*offsets_it)[0], begin) ||
      !get_size((*offsets_it)[1], end)) {
    error = where + "data_offsets must be two non-negative integers [begin, end]";
    return false;
  }
  const std::string offsets = "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end || end > data_size) {
    error = where + offsets + " out of range of the " + std::to_string(data_size) + "-byte data";
    return false;
  }
  if (count > data_size || count * dtype->bytes != end - begin) {
    error = where + "shape " + shape_string(tensor.shape) + " of " + tensor.dtype + " does not fill its " + offsets +
            " (" + std::to_string(end - begin) + " bytes)";
    return false;
  }
  if (!decode(*dtype, data + begin, static_cast<std::size_t>(count), tensor.values, error)) {
    error = where + error;
    return false;
  }
  return true;
}

}  // namespace detail

/// Parses the bytes of a safetensors file into `file` (replacing its contents). Returns false with `error` set to
/// what is wrong (without a file name) when the bytes are not a well-formed file.
inline bool parse(const std::string& bytes, File& file, std::string& error) {
  file = File{};
  if (bytes.size() < 8) {
    error = "truncated: " + std::to_string(bytes.size()) + " bytes, fewer than the 8 of the header length";
    return false;
  }
  const auto* begin = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::uint64_t header_size = detail::load_little_endian(begin, 8);
  if (header_size > bytes.size() - 8 || header_size > detail::kMaxHeaderBytes) {
    error = "header length " + std::to_string(header_size) + " exceeds the " + std::to_string(bytes.size() - 8) +
            " bytes after it" + (header_size > detail::kMaxHeaderBytes ? " or the 100 MB limit" : "");
    return false;
  }
  const auto header_end = bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_size);
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, header_end, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    error = "the " + std::to_string(header_size) + "-byte header is not a JSON object";
    return false;
  }
  const unsigned char* data = begin + 8 + header_size;
  const std::uint64_t data_size = bytes.size() - 8 - header_size;
  std::vector<std::pair<std::pair<std::uint64_t, std::uint64_t>, std::string>> ranges;  // ((begin, end), name)
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      const bool strings =
          item.value().is_object() && std::all_of(item.value().begin(), item.value().end(),
                                                  [](const nlohmann::json& value) { return value.is_string(); });
      if (!strings) {
        error = "__metadata__ must be an object of strings";
        return false;
      }
      for (const auto& entry : item.value().items()) file.metadata[entry.key()] = entry.value().get<std::string>();
      continue;
    }
    std::uint64_t first = 0, last = 0;
    if (!detail::read_tensor(item.key(), item.value(), data, data_size, file.tensors[item.key()], first, last, error))
      return false;
    ranges.push_back({{first, last}, item.key()});
  }
  // Every data byte belongs to exactly one tensor.
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t covered = 0;
  for (std::size_t t = 0; t < ranges.size(); ++t) {
    if (ranges[t].first.first != covered) {
      error = ranges[t].first.first > covered
                  ? "data bytes [" + std::to_string(covered) + ", " + std::to_string(ranges[t].first.first) +
                        ") belong to no tensor"
                  : "tensors '" + ranges[t - 1].second + "' and '" + ranges[t].second + "' overlap";
      return false;
    }
    covered = ranges[t].first.second;
  }
  if (covered != data_size) {
    error = "data bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) + ") belong to no tensor";
    return false;
  }
  return true;
}

/// Reads the safetensors file at `path` into `file`. Returns false with `error` = "<path>: <what is wrong>" when it
/// cannot be opened or is not a well-formed file. Usable with -fno-exceptions.
inline bool try_read(const std::string& path, File& file, std::string& error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    error = path + ": cannot open";
    return false;
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!parse(bytes, file, error)) {
    error = path + ": " + error;
    return false;
  }
  return true;
}

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
/// Reads the safetensors file at `path`. Throws std::runtime_error("<path>: <what is wrong>") when it cannot be
/// opened or is not a well-formed file.
inline File read(const std::string& path) {
  File file;
  std::string error;
  if (!try_read(path, file, error)) throw std::runtime_error(error);
  return file;
}
#endif

/// `tensor` as a dense Eigen matrix of type MatrixType (e.g. qkv::Matrix<float>): the last axis gives the columns
/// and the others, flattened in C order, the rows; a 1-D tensor becomes one row, a scalar a 1 × 1 matrix.
template <class MatrixType>
MatrixType to_matrix(const Tensor& tensor) {
  using Scalar = typename MatrixType::Scalar;
  const std::int64_t cols = tensor.shape.empty() ? 1 : tensor.shape.back();
  std::int64_t rows = 1;
  for (std::size_t axis = 0; axis + 1 < tensor.shape.size(); ++axis) rows *= tensor.shape[axis];
  MatrixType m(rows, cols);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j)
      m(i, j) = static_cast<Scalar>(tensor.values[static_cast<std::size_t>(i * cols + j)]);
  return m;
}

/// Every tensor of `file` as a MatrixType (see to_matrix), by name.
template <class MatrixType>
std::map<std::string, MatrixType> to_matrices(const File& file) {
  std::map<std::string, MatrixType> matrices;
  for (const auto& [name, tensor] : file.tensors) matrices.emplace(name, to_matrix<MatrixType>(tensor));
  return matrices;
}

}  // namespace safetensors

#endif  // QKV_EXAMPLES_SAFETENSORS_HPP
