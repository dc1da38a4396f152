// tests/support/npy.hpp — a reader of NumPy .npy files of little-endian float32 in C order (format versions 1-3), for
// the fixtures tests/fixtures/*.npy (tests/fixtures/README.md). Throws std::runtime_error naming the file on anything
// else (another dtype, Fortran order, a truncated file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace qkv_test {

/// A float32 array: its shape and its values in C order (last index fastest).
struct NpyArray {
  std::vector<long> shape;
  std::vector<float> values;
};

/// Reads `path`, a .npy file of little-endian float32 in C order. The host must be little-endian (x86-64 and
/// AArch64 are), since the values are copied as stored.
inline NpyArray read_npy_float32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  char magic[8];
  in.read(magic, 8);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) throw std::runtime_error(path + ": not a .npy file");
  unsigned char length_bytes[4] = {0, 0, 0, 0};
  in.read(reinterpret_cast<char*>(length_bytes), magic[6] == 1 ? 2 : 4);  // version 1: u16, versions 2 and 3: u32
  const std::uint32_t header_length = length_bytes[0] | length_bytes[1] << 8 | length_bytes[2] << 16 |
                                      static_cast<std::uint32_t>(length_bytes[3]) << 24;
  std::string header(header_length, ' ');
  in.read(&header[0], static_cast<std::streamsize>(header_length));
  if (!in || header.find("'descr': '<f4'") == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos) {
    throw std::runtime_error(path + ": expected little-endian float32 in C order, header " + header);
  }
  NpyArray array;
  const std::size_t open = header.find('(', header.find("'shape'")), close = header.find(')', open);
  std::istringstream shape(header.substr(open + 1, close - open - 1));
  std::size_t count = 1;
  for (std::string part; std::getline(shape, part, ',');) {
    if (part.find_first_not_of(' ') == std::string::npos) continue;
    array.shape.push_back(std::stol(part));
    count *= static_cast<std::size_t>(array.shape.back());
  }
  array.values.resize(count);
  in.read(reinterpret_cast<char*>(array.values.data()), static_cast<std::streamsize>(count * sizeof(float)));
  if (!in) throw std::runtime_error(path + ": truncated");
  return array;
}

}  // namespace qkv_test
