// Tests of examples/safetensors.hpp, the reader of the fixtures in tests/fixtures/: well-formed files byte by byte
// (written here, little-endian by construction), every error it reports, and the two committed fixtures.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "qkv/config.hpp"
#include "safetensors.hpp"

namespace {

/// The little-endian bytes of `value`, `bytes` wide.
std::string little_endian(std::uint64_t value, std::size_t bytes) {
  std::string s;
  for (std::size_t b = 0; b < bytes; ++b) s += static_cast<char>((value >> (8 * b)) & 0xff);
  return s;
}

std::string f64(double x) {
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof x);
  return little_endian(bits, 8);
}

std::string f32(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof x);
  return little_endian(bits, 4);
}

/// A safetensors file: the 8-byte header length, `header`, then `data`.
std::string file_bytes(const std::string& header, const std::string& data) {
  return little_endian(header.size(), 8) + header + data;
}

/// Parses `bytes`; expects failure with an error that contains `part`.
void expect_error(const std::string& bytes, const std::string& part) {
  safetensors::File file;
  std::string error;
  EXPECT_FALSE(safetensors::parse(bytes, file, error));
  EXPECT_NE(error.find(part), std::string::npos) << "'" << part << "' not in: " << error;
}

std::string fixture_path(const std::string& name) { return std::string(QKV_TEST_FIXTURES_DIR) + "/" + name; }

TEST(Safetensors, ReadsEveryDtypeShapeAndMetadata) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F64","shape":[2,2],"data_offsets":[0,32]},)"
      R"("b":{"dtype":"F32","shape":[3],"data_offsets":[32,44]},)"
      R"("c":{"dtype":"I64","shape":[],"data_offsets":[44,52]},)"
      R"("d":{"dtype":"I32","shape":[1,1],"data_offsets":[52,56]},)"
      R"("e":{"dtype":"I16","shape":[1],"data_offsets":[56,58]},)"
      R"("f":{"dtype":"I8","shape":[1],"data_offsets":[58,59]},)"
      R"("g":{"dtype":"U8","shape":[1],"data_offsets":[59,60]},)"
      R"("h":{"dtype":"BOOL","shape":[2],"data_offsets":[60,62]},)"
      R"("empty":{"dtype":"F64","shape":[0,3],"data_offsets":[62,62]}}   )";  // padded with spaces, as writers do
  const std::string data = f64(1.5) + f64(-2) + f64(1e-300) + f64(std::numeric_limits<double>::infinity()) + f32(0.1f) +
                           f32(-0.0f) + f32(3e38f) + little_endian(static_cast<std::uint64_t>(-7), 8) +
                           little_endian(static_cast<std::uint32_t>(-123456), 4) +
                           little_endian(static_cast<std::uint16_t>(-300), 2) + little_endian(0x80, 1) +
                           little_endian(0xff, 1) + little_endian(1, 1) + little_endian(0, 1);
  safetensors::File file;
  std::string error;
  ASSERT_TRUE(safetensors::parse(file_bytes(header, data), file, error)) << error;
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.tensors.size(), 9u);
  const auto& t = file.tensors;
  EXPECT_EQ(t.at("a").dtype, "F64");
  EXPECT_EQ(t.at("a").shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(t.at("a").values, (std::vector<double>{1.5, -2, 1e-300, std::numeric_limits<double>::infinity()}));
  EXPECT_EQ(t.at("b").values, (std::vector<double>{0.1f, -0.0f, 3e38f}));  // exactly the floats, widened
  EXPECT_TRUE(std::signbit(t.at("b").values[1]));
  EXPECT_TRUE(t.at("c").shape.empty());
  EXPECT_EQ(t.at("c").values, (std::vector<double>{-7}));
  EXPECT_EQ(t.at("d").values, (std::vector<double>{-123456}));
  EXPECT_EQ(t.at("e").values, (std::vector<double>{-300}));
  EXPECT_EQ(t.at("f").values, (std::vector<double>{-128}));
  EXPECT_EQ(t.at("g").values, (std::vector<double>{255}));
  EXPECT_EQ(t.at("h").values, (std::vector<double>{1, 0}));
  EXPECT_EQ(t.at("empty").shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(t.at("empty").values.empty());
}

TEST(Safetensors, ToMatrixFlattensLeadingAxesIntoRows) {
  safetensors::Tensor tensor{"F64", {2, 1, 3}, {1, 2, 3, 4, 5, 6}};
  const qkv::Matrix<float> m = safetensors::to_matrix<qkv::Matrix<float>>(tensor);
  ASSERT_EQ(m.rows(), 2);
  ASSERT_EQ(m.cols(), 3);
  EXPECT_EQ(m(1, 0), 4.0f);
  EXPECT_EQ(m(0, 2), 3.0f);
  const auto column_major = safetensors::to_matrix<Eigen::MatrixXd>(safetensors::Tensor{"F64", {3}, {7, 8, 9}});
  EXPECT_EQ(column_major.rows(), 1);
  EXPECT_EQ(column_major(0, 2), 9);
  const auto scalar = safetensors::to_matrix<Eigen::MatrixXd>(safetensors::Tensor{"F64", {}, {5}});
  EXPECT_EQ(scalar.size(), 1);
  EXPECT_EQ(scalar(0, 0), 5);
}

TEST(Safetensors, TruncatedOrBadHeaderLength) {
  expect_error("", "truncated: 0 bytes, fewer than the 8 of the header length");
  expect_error(std::string("\x02\x00\x00", 3), "truncated: 3 bytes");
  expect_error(little_endian(100, 8) + "{}", "header length 100 exceeds the 2 bytes after it");
  expect_error(little_endian(std::numeric_limits<std::uint64_t>::max(), 8) + "{}", "exceeds the 2 bytes after it");
  const std::string whole = file_bytes(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", f64(1));
  expect_error(whole.substr(0, whole.size() - 3), "data_offsets [0, 8] out of range of the 5-byte data");
}

// One malformed file per row: its header, its data and a part of the error it must give.
TEST(Safetensors, MalformedFilesSayWhatIsWrong) {
  const std::string eight_bytes = f64(1);
  const struct {
    std::string header, data, error;
  } cases[] = {
      // the header itself
      {R"({"x": )", "", "the 6-byte header is not a JSON object"},
      {"[1, 2]", "", "is not a JSON object"},
      {R"({"x": 1})", "", "tensor 'x': expected an object with dtype (a string), shape and data_offsets"},
      {R"({"x":{"dtype":"F64","shape":[1]}})", eight_bytes, "tensor 'x': expected an object"},
      {R"({"__metadata__":{"n":1}})", "", "__metadata__ must be an object of strings"},
      // dtype
      {R"({"half":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}})", "ab",
       "tensor 'half': dtype 'F16' is not supported (F64, F32, I64, I32, I16, I8, U8, BOOL)"},
      // shape and offsets
      {R"({"x":{"dtype":"F64","shape":[-1],"data_offsets":[0,8]}})", eight_bytes,
       "tensor 'x': shape must be an array of non-negative integers"},
      {R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0]}})", eight_bytes,
       "data_offsets must be two non-negative integers"},
      {R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[8,0]}})", eight_bytes,
       "data_offsets [8, 0] out of range of the 8-byte data"},
      {R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,16]}})", eight_bytes, "data_offsets [0, 16] out of range"},
      {R"({"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", std::string(20, '\0'),
       "tensor 'x': shape [2, 3] of F32 does not fill its data_offsets [0, 20] (20 bytes)"},
      // a product that would overflow 64 bits is a mismatch, not a wrap-around to the right size
      {R"({"x":{"dtype":"U8","shape":[4294967296,4294967296,1],"data_offsets":[0,0]}})", "", "does not fill"},
      // gaps and overlaps
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight_bytes,
       "data bytes [4, 8) belong to no tensor"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight_bytes,
       "data bytes [0, 4) belong to no tensor"},
      {R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       eight_bytes, "tensors 'x' and 'y' overlap"},
      // values a double cannot hold
      {R"({"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", little_endian((std::uint64_t{1} << 53) + 1, 8),
       "tensor 'i': I64 value 9007199254740993 at element 0 is beyond 2^53"},
      {R"({"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x02", 2),
       "tensor 'b': BOOL byte 2 at element 1 is neither 0 nor 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    expect_error(file_bytes(c.header, c.data), c.error);
  }
}

TEST(Safetensors, ErrorsNameTheFile) {
  safetensors::File file;
  std::string error;
  EXPECT_FALSE(safetensors::try_read("/nonexistent/weights.safetensors", file, error));
  EXPECT_EQ(error, "/nonexistent/weights.safetensors: cannot open");
  const std::string path = testing::TempDir() + "qkv_truncated.safetensors";
  std::ofstream(path, std::ios::binary) << std::string("\x10\x00", 2);
  try {
    safetensors::read(path);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), path + ": truncated: 2 bytes, fewer than the 8 of the header length");
  }
  std::remove(path.c_str());
}

// The committed fixtures are well-formed: every tensor the generators list, with their metadata.
TEST(Safetensors, ReadsTheFixtures) {
  const safetensors::File mha = safetensors::read(fixture_path("mha_torch.safetensors"));
  EXPECT_EQ(mha.tensors.size(), 140u);
  EXPECT_EQ(mha.metadata.at("generator"), "scripts/make_mha_fixtures.py");
  EXPECT_EQ(mha.tensors.at("bool_mask.attn_mask").dtype, "BOOL");
  EXPECT_EQ(mha.tensors.at("self.out").shape, (std::vector<std::int64_t>{5, 2, 12}));
  const safetensors::File ppocr = safetensors::read(fixture_path("ppocr_v4_block1_attention.safetensors"));
  EXPECT_EQ(ppocr.tensors.size(), 9u);
  EXPECT_EQ(ppocr.metadata.at("generator"), "scripts/make_ppocr_fixture.py");
  EXPECT_EQ(ppocr.tensors.at("linear_77.w_0").dtype, "F32");
  EXPECT_EQ(ppocr.tensors.at("linear_77.w_0").shape, (std::vector<std::int64_t>{120, 360}));
}

}  // namespace
