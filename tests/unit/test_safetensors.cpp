// Tests of io/safetensors: the writer against bytes written out by hand and against the reference
// library's own test vectors (so it is checked against the format, not against the reader), random
// round trips over many dtypes, one failing file per reader check, and the atomic-write contract.
// Files go to $PACKMOE_TEST_TMP (else the system temp dir), one fresh directory per test.
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/test_files.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using test::read_raw;
using test::write_raw;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("safetensors_");
    seed_ = test::recorded_random_seed();
    rng_.seed(seed_);
  }
  void TearDown() override { test::remove_test_dir(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::set<std::string> listing(const fs::path& dir) const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
  }

  std::vector<uint8_t> random_bytes(size_t n) {
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(byte(rng_));
    return v;
  }

  fs::path dir_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// A file: 8-byte little-endian `declared` (default: the header length), the header, then `data`.
std::vector<uint8_t> make_file(const std::string& header, std::vector<uint8_t> data,
                               uint64_t declared = UINT64_MAX) {
  if (declared == UINT64_MAX) declared = header.size();
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(declared >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> iota_bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 37 + 11);
  return v;
}

std::vector<uint8_t> bytes_of(std::span<const uint8_t> s) { return {s.begin(), s.end()}; }

// ---- dtypes -------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, DtypeMapping) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kE4M3, DType::kE5M2, DType::kE8M0, DType::kE2M1,
                  DType::kU8, DType::kI32, DType::kI64}) {
    std::string_view s = dtype_to_safetensors(t);
    auto back = dtype_from_safetensors(s);
    ASSERT_TRUE(back.is_ok()) << s;
    EXPECT_EQ(back.value(), t) << s;
    EXPECT_EQ(safetensors_dtype_bits(s), static_cast<size_t>(dtype_bits(t))) << s;
  }
  EXPECT_EQ(dtype_to_safetensors(DType::kE2M1), "F4");
  EXPECT_EQ(dtype_to_safetensors(DType::kE4M3), "F8_E4M3");

  auto f16 = dtype_from_safetensors("F16");
  ASSERT_FALSE(f16.is_ok());
  EXPECT_NE(f16.status().message().find("unsupported safetensors dtype F16"), std::string::npos);
  auto junk = dtype_from_safetensors("F12");
  ASSERT_FALSE(junk.is_ok());
  EXPECT_NE(junk.status().message().find("unknown"), std::string::npos);

  const std::pair<const char*, size_t> bits[] = {
      {"BOOL", 8}, {"U8", 8},       {"I8", 8},       {"I16", 16},          {"U16", 16},
      {"F16", 16}, {"BF16", 16},    {"I32", 32},     {"U32", 32},          {"F32", 32},
      {"F64", 64}, {"I64", 64},     {"U64", 64},     {"C64", 64},          {"F8_E4M3", 8},
      {"F8_E5M2", 8}, {"F8_E8M0", 8}, {"F4", 4},    {"F6_E2M3", 6},       {"F6_E3M2", 6},
      {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"f32", 0}, {"", 0}, {"F8_E4M3FN", 0}};
  for (const auto& [name, b] : bits) EXPECT_EQ(safetensors_dtype_bits(name), b) << name;
}

// ---- writer against the format ------------------------------------------------------------------

// huggingface/safetensors safetensors/src/tensor.rs, test_serialization_forced_alignement: the
// reference writer's exact bytes for {"attn0": F32 [1, 1, 2, 3] = 0..5}.
TEST_F(SafetensorsTest, WriterMatchesReferenceTestVector) {
  const std::vector<uint8_t> expected = {
      72,  0,   0,   0,   0,   0,   0,   0,   123, 34,  97,  116, 116, 110, 48,  34,  58,  123, 34,
      100, 116, 121, 112, 101, 34,  58,  34,  70,  51,  50,  34,  44,  34,  115, 104, 97,  112, 101,
      34,  58,  91,  49,  44,  49,  44,  50,  44,  51,  93,  44,  34,  100, 97,  116, 97,  95,  111,
      102, 102, 115, 101, 116, 115, 34,  58,  91,  48,  44,  50,  52,  93,  125, 125, 32,  32,  32,
      32,  32,  32,  32,  0,   0,   0,   0,   0,   0,   128, 63,  0,   0,   0,   64,  0,   0,   64,
      64,  0,   0,   128, 64,  0,   0,   160, 64};
  const float values[6] = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f};
  std::vector<uint8_t> data(sizeof(values));
  std::memcpy(data.data(), values, sizeof(values));
  SafetensorsWriter w;
  w.add("attn0", "F32", {1, 1, 2, 3}, data);
  auto bytes = w.serialize();
  ASSERT_TRUE(bytes.is_ok()) << bytes.status().message();
  EXPECT_EQ(bytes.value(), expected);

  // test_empty: no tensors, then no tensors with {"framework": "pt"}.
  SafetensorsWriter empty;
  EXPECT_EQ(empty.serialize().value(),
            make_file(std::string("{}") + std::string(6, ' '), {}));
  empty.set_metadata("framework", "pt");
  const std::vector<uint8_t> expected_meta = {
      40,  0,   0,   0,   0,  0,  0,   0,   123, 34,  95,  95,  109, 101, 116, 97,
      100, 97,  116, 97,  95, 95, 34,  58,  123, 34,  102, 114, 97,  109, 101, 119,
      111, 114, 107, 34,  58, 34, 112, 116, 34,  125, 125, 32,  32,  32,  32,  32};
  EXPECT_EQ(empty.serialize().value(), expected_meta);
}

// Ordering (widest dtype first, then name), metadata first with sorted keys and serde escapes,
// scalar / empty / sub-byte tensors, and padding, all against a header typed out by hand.
TEST_F(SafetensorsTest, WriterMatchesHandWrittenFile) {
  SafetensorsWriter w;
  w.add("b", "U8", {3}, std::vector<uint8_t>{1, 2, 3});
  w.add("a", "BF16", {2}, std::vector<uint8_t>{0x80, 0x3F, 0x00, 0xC0});  // 1.0, -2.0
  w.add("d", "F4", {4}, std::vector<uint8_t>{0x21, 0x43});
  w.add("e", "F32", {0}, std::vector<uint8_t>{});
  w.add("c", "F32", {}, std::vector<uint8_t>{0x00, 0x00, 0xC0, 0x3F});  // 1.5
  w.set_metadata("note", "say \"hi\"\n!");
  w.set_metadata("format", "pt");

  const std::string header =
      R"({"__metadata__":{"format":"pt","note":"say \"hi\"\n!"},)"
      R"("c":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
      R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
      R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
      R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},)"
      R"("d":{"dtype":"F4","shape":[4],"data_offsets":[11,13]}})"
      "       ";  // 321 bytes of JSON + 7 spaces = 328
  ASSERT_EQ(header.size(), 328u);
  const std::vector<uint8_t> data = {0x00, 0x00, 0xC0, 0x3F, 0x80, 0x3F, 0x00,
                                     0xC0, 1,    2,    3,    0x21, 0x43};
  const std::vector<uint8_t> expected = make_file(header, data);

  auto bytes = w.serialize();
  ASSERT_TRUE(bytes.is_ok()) << bytes.status().message();
  EXPECT_EQ(std::string(bytes.value().begin(), bytes.value().end()),
            std::string(expected.begin(), expected.end()));

  const std::string p = path("hand.safetensors");
  ASSERT_TRUE(w.write(p).is_ok());
  EXPECT_EQ(read_raw(p), expected);
}

// ---- reader on hand-built files -----------------------------------------------------------------

TEST_F(SafetensorsTest, ParsesHandBuiltFile) {
  // Any key order, whitespace, no padding (data starts unaligned), an ignored extra field.
  const std::string header =
      R"( { "w2": {"data_offsets": [8, 12], "shape": [2], "dtype": "I16"},)"
      R"(  "w1" : {"shape":[2,2],"dtype":"U8","data_offsets":[0,4], "extra": true},)"
      R"(  "__metadata__": {"k": "v", "format": "pt"},)"
      R"(  "w0": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [4, 8]},)"
      R"(  "z": {"dtype": "F16", "shape": [3, 0], "data_offsets": [12, 12]} })";
  const std::vector<uint8_t> data = iota_bytes(12);
  const std::string p = path("hand_built.safetensors");
  write_raw(p, make_file(header, data));

  auto r = SafetensorsFile::read(p);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const SafetensorsFile& f = r.value();
  EXPECT_EQ(f.source(), p);
  EXPECT_EQ(f.header_bytes(), header.size());
  ASSERT_EQ(f.entries().size(), 4u);
  const char* names[] = {"w1", "w0", "w2", "z"};  // data offset order
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(f.entries()[i].name, names[i]);

  const SafetensorsEntry* w1 = f.find("w1");
  ASSERT_NE(w1, nullptr);
  EXPECT_EQ(w1->dtype, "U8");
  EXPECT_EQ(w1->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(w1->numel(), 4);
  EXPECT_EQ(bytes_of(w1->bytes), std::vector<uint8_t>(data.begin(), data.begin() + 4));
  const SafetensorsEntry* w0 = f.find("w0");
  ASSERT_NE(w0, nullptr);
  EXPECT_EQ(w0->dtype, "F8_E4M3");
  EXPECT_EQ(bytes_of(w0->bytes), std::vector<uint8_t>(data.begin() + 4, data.begin() + 8));
  const SafetensorsEntry* w2 = f.find("w2");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(bytes_of(w2->bytes), std::vector<uint8_t>(data.begin() + 8, data.end()));
  const SafetensorsEntry* z = f.find("z");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->numel(), 0);
  EXPECT_TRUE(z->bytes.empty());
  EXPECT_EQ(f.find("w3"), nullptr);
  EXPECT_EQ(f.find("__metadata__"), nullptr);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"k", "v"}}));

  // A caller reports dtypes packmoe has no DType for, as the header promises.
  auto dt = dtype_from_safetensors(z->dtype);
  ASSERT_FALSE(dt.is_ok());
  EXPECT_NE(dt.status().message().find("F16"), std::string::npos);

  // A file with no tensors and no metadata is valid.
  auto empty = SafetensorsFile::parse(make_file("{}", {}), "empty");
  ASSERT_TRUE(empty.is_ok()) << empty.status().message();
  EXPECT_TRUE(empty.value().entries().empty());
  EXPECT_TRUE(empty.value().metadata().empty());
}

// ---- round trip ---------------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripRandomTensors) {
  struct Spec {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Spec> specs = {
      {"model.embed_tokens.weight", "BF16", {7, 5}},
      {"model.layers.0.mlp.experts.gate_up_proj", "F32", {3, 4, 6}},
      {"scale", "F32", {}},
      {"empty", "BF16", {0, 5}},
      {"token_ids", "I64", {9}},
      {"counts", "I32", {5}},
      {"mask", "BOOL", {13}},
      {"fp8_e4m3", "F8_E4M3", {3, 11}},
      {"fp8_e5m2", "F8_E5M2", {7}},
      {"e8m0_scales", "F8_E8M0", {2, 3}},
      {"nvfp4_as_f4", "F4", {2, 6}},
      {"nvfp4_as_u8", "U8", {1, 1, 17}},
      {"half", "F16", {5}},
      {"double", "F64", {3}},
      {"short", "I16", {3}},
      {"byte", "I8", {1}},
      {"\xce\xbb/unicode name with \"quotes\"", "F32", {2}},
  };
  SafetensorsWriter w;
  std::map<std::string, std::vector<uint8_t>> data;
  for (const Spec& s : specs) {
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    auto bytes = random_bytes(static_cast<size_t>(numel) * safetensors_dtype_bits(s.dtype) / 8);
    data[s.name] = bytes;
    if (s.name == "scale") {
      w.add(s.name, s.dtype, s.shape, std::span<const uint8_t>(bytes));  // the copying overload
    } else {
      w.add(s.name, s.dtype, s.shape, std::move(bytes));
    }
  }
  w.set_metadata("format", "pt");
  w.set_metadata("packmoe.seed", std::to_string(seed_));
  ASSERT_EQ(w.size(), specs.size());

  const std::string p = path("round_trip.safetensors");
  Status st = w.write(p);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(listing(dir_), std::set<std::string>{"round_trip.safetensors"});
  EXPECT_EQ(read_raw(p), w.serialize().value());

  auto r = SafetensorsFile::read(p);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  SafetensorsFile f = std::move(r).value();  // entries must survive the move
  ASSERT_EQ(f.entries().size(), specs.size());
  EXPECT_EQ(f.header_bytes() % 8, 0u);
  for (const Spec& s : specs) {
    const SafetensorsEntry* e = f.find(s.name);
    ASSERT_NE(e, nullptr) << s.name;
    EXPECT_EQ(e->dtype, s.dtype) << s.name;
    EXPECT_EQ(e->shape, s.shape) << s.name;
    EXPECT_EQ(bytes_of(e->bytes), data[s.name]) << s.name << " seed " << seed_;
  }
  // The reference order makes every tensor start at a multiple of its element size.
  const uint8_t* base = f.entries().front().bytes.data();
  size_t previous_end = 0;
  for (const SafetensorsEntry& e : f.entries()) {
    size_t offset = static_cast<size_t>(e.bytes.data() - base);
    size_t align = std::max<size_t>(1, safetensors_dtype_bits(e.dtype) / 8);
    EXPECT_EQ(offset % align, 0u) << e.name;
    EXPECT_EQ(offset, previous_end) << e.name;
    previous_end = offset + e.bytes.size();
  }
  EXPECT_EQ(f.metadata().at("packmoe.seed"), std::to_string(seed_));
  EXPECT_EQ(f.metadata().at("format"), "pt");
}

// ---- every reader check -------------------------------------------------------------------------

TEST_F(SafetensorsTest, ReaderRejectsBadFiles) {
  struct Case {
    std::string tag;
    std::vector<uint8_t> bytes;
    std::string expect;  // must appear in the message
  };
  auto one = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return R"({"t":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets +
           "}}";
  };
  const std::vector<Case> cases = {
      {"short", {1, 2, 3}, "shorter than the 8-byte"},
      {"absurd_header", make_file("{}", iota_bytes(8), 200'000'000), "too large"},
      {"header_past_end", make_file("{}", {}, 100), "runs past the end of the file"},
      {"empty_header", make_file("", {}), "not valid JSON"},
      {"bad_json", make_file(R"({"t": )", {}), "not valid JSON"},
      {"bad_utf8", make_file("{\"\xff\":{}}", {}), "not valid JSON"},
      {"trailing_json", make_file("{} {}", {}), "not valid JSON"},
      {"not_object", make_file("[1, 2]", {}), "not a JSON object"},
      {"entry_not_object", make_file(R"({"t": 3})", {}), "not a JSON object"},
      {"missing_dtype", make_file(R"({"t":{"shape":[1],"data_offsets":[0,1]}})", iota_bytes(1)),
       "missing \"dtype\""},
      {"missing_shape", make_file(R"({"t":{"dtype":"U8","data_offsets":[0,1]}})", iota_bytes(1)),
       "missing \"shape\""},
      {"missing_offsets", make_file(R"({"t":{"dtype":"U8","shape":[1]}})", iota_bytes(1)),
       "missing \"data_offsets\""},
      {"dtype_not_string", make_file(one("8", "[1]", "[0,1]"), iota_bytes(1)), "not a string"},
      {"unknown_dtype", make_file(one("\"F12\"", "[1]", "[0,1]"), iota_bytes(1)),
       "unknown dtype \"F12\""},
      {"shape_not_array", make_file(one("\"U8\"", "1", "[0,1]"), iota_bytes(1)), "not an array"},
      {"shape_float", make_file(one("\"U8\"", "[1.0]", "[0,1]"), iota_bytes(1)), "non-integer"},
      {"shape_negative", make_file(one("\"U8\"", "[-2, -1]", "[0,2]"), iota_bytes(2)),
       "-2 is negative"},
      {"shape_overflow",
       make_file(one("\"F32\"", "[4294967296, 4294967296, 16]", "[0,0]"), {}), "overflows"},
      {"shape_bits_overflow",
       make_file(one("\"F64\"", "[4294967296, 1073741824]", "[0,0]"), {}), "overflows"},
      {"dim_over_int64", make_file(one("\"U8\"", "[18446744073709551615]", "[0,0]"), {}),
       "overflows int64"},
      {"offsets_arity", make_file(one("\"U8\"", "[1]", "[0]"), iota_bytes(1)),
       "two non-negative integers"},
      {"offsets_negative", make_file(one("\"U8\"", "[1]", "[-1,0]"), iota_bytes(1)),
       "two non-negative integers"},
      {"offsets_string", make_file(one("\"U8\"", "[1]", "\"0-1\""), iota_bytes(1)),
       "two non-negative integers"},
      {"offsets_reversed", make_file(one("\"U8\"", "[4]", "[4,0]"), iota_bytes(4)), "reversed"},
      {"offsets_past_buffer", make_file(one("\"U8\"", "[8]", "[0,8]"), iota_bytes(4)),
       "past the end of the 4-byte data buffer"},
      {"size_mismatch", make_file(one("\"F32\"", "[2]", "[0,4]"), iota_bytes(4)),
       "hold 4 bytes but shape [2] of F32 needs 8"},
      {"name_with_newline",
       make_file(R"({"a\nb":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", iota_bytes(4)),
       "tensor 'a\\x0ab'"},
      {"f4_odd", make_file(one("\"F4\"", "[3]", "[0,2]"), iota_bytes(2)),
       "not a whole number of bytes"},
      {"overlap",
       make_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                 iota_bytes(12)),
       "overlap tensor 'a'"},
      {"empty_inside_other",
       make_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})",
                 iota_bytes(8)),
       "overlap"},
      {"hole",
       make_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                 R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                 iota_bytes(12)),
       "hole in the data buffer: bytes [4, 8]"},
      {"hole_at_start", make_file(one("\"U8\"", "[4]", "[2,6]"), iota_bytes(6)), "hole"},
      {"trailing", make_file(one("\"U8\"", "[4]", "[0,4]"), iota_bytes(6)), "trailing bytes"},
      {"no_tensors_trailing", make_file("{}", iota_bytes(3)), "trailing bytes"},
      {"duplicate_name",
       make_file(R"({"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("t":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                 iota_bytes(4)),
       "duplicate tensor name 't'"},
      {"duplicate_field",
       make_file(R"({"t":{"dtype":"U8","shape":[2],"dtype":"I8","data_offsets":[0,2]}})",
                 iota_bytes(2)),
       "duplicate key 'dtype' inside header entry 't'"},
      {"metadata_not_object", make_file(R"({"__metadata__":[1]})", {}), "__metadata__"},
      {"metadata_not_string", make_file(R"({"__metadata__":{"n":1}})", {}),
       "__metadata__ key 'n' is not a string"},
  };
  std::set<std::string> tags;
  for (const Case& c : cases) {
    ASSERT_TRUE(tags.insert(c.tag).second) << c.tag;
    const std::string name = "bad_" + c.tag + ".safetensors";
    const std::string p = path(name);
    write_raw(p, c.bytes);
    auto r = SafetensorsFile::read(p);
    ASSERT_FALSE(r.is_ok()) << c.tag;
    const std::string& m = r.status().message();
    EXPECT_NE(m.find(name), std::string::npos) << c.tag << ": " << m;
    EXPECT_NE(m.find(c.expect), std::string::npos) << c.tag << ": " << m;
    for (unsigned char ch : m) ASSERT_TRUE(ch >= 0x20) << c.tag << ": one printable line: " << m;
  }

  auto missing = SafetensorsFile::read(path("missing.safetensors"));
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("missing.safetensors"), std::string::npos);
  EXPECT_NE(missing.status().message().find("cannot open"), std::string::npos);

  fs::create_directory(dir_ / "a_dir.safetensors");
  auto directory = SafetensorsFile::read(path("a_dir.safetensors"));
  ASSERT_FALSE(directory.is_ok());
  EXPECT_NE(directory.status().message().find("a_dir.safetensors: not a regular file"),
            std::string::npos)
      << directory.status().message();

  // parse() uses the caller's label.
  auto labelled = SafetensorsFile::parse({1, 2}, "shard 3 of ckpt/");
  ASSERT_FALSE(labelled.is_ok());
  EXPECT_EQ(labelled.status().message().rfind("shard 3 of ckpt/: ", 0), 0u);
}

// Random corruptions of a valid file must fail cleanly or parse (never crash or read out of bounds;
// run under ASan to see the latter).
TEST_F(SafetensorsTest, ReaderSurvivesRandomCorruption) {
  SafetensorsWriter w;
  w.add("a", "F32", {3, 2}, random_bytes(24));
  w.add("b", "U8", {5}, random_bytes(5));
  w.set_metadata("format", "pt");
  const std::vector<uint8_t> good = w.serialize().value();
  ASSERT_TRUE(SafetensorsFile::parse(good, "good").is_ok());
  std::uniform_int_distribution<size_t> pos(0, good.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> bad = good;
    for (int k = 0; k < 1 + trial % 3; ++k) bad[pos(rng_)] = static_cast<uint8_t>(byte(rng_));
    if (trial % 5 == 0) bad.resize(pos(rng_));
    auto r = SafetensorsFile::parse(std::move(bad), "corrupt");
    if (!r.is_ok()) {
      EXPECT_EQ(r.status().message().rfind("corrupt: ", 0), 0u) << r.status().message();
      continue;
    }
    for (const SafetensorsEntry& e : r.value().entries()) {
      uint64_t bits = safetensors_dtype_bits(e.dtype);
      ASSERT_GT(bits, 0u);
      EXPECT_EQ(e.bytes.size() * 8, static_cast<uint64_t>(e.numel()) * bits);
    }
  }
}

// ---- writer errors and atomicity ----------------------------------------------------------------

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  struct Case {
    std::string tag;
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    size_t nbytes;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"unknown_dtype", "t", "F12", {2}, 2, "unknown dtype \"F12\""},
      {"size_mismatch", "t", "BF16", {2, 3}, 11, "needs 12 bytes, got 11"},
      {"negative", "t", "U8", {-1}, 0, "negative dimension"},
      {"f4_odd", "t", "F4", {3}, 2, "not a whole number of bytes"},
      {"reserved", "__metadata__", "U8", {1}, 1, "reserved"},
      {"bad_utf8", "bad\xc3", "U8", {1}, 1, "not valid UTF-8"},
      {"duplicate", "ok", "U8", {1}, 1, "duplicate tensor name"},
  };
  for (const Case& c : cases) {
    SafetensorsWriter w;
    w.add("ok", "U8", {1}, std::vector<uint8_t>{7});
    w.add(c.name, c.dtype, c.shape, random_bytes(c.nbytes));
    const std::string name = "writer_" + c.tag + ".safetensors";
    Status st = w.write(path(name));
    ASSERT_FALSE(st.is_ok()) << c.tag;
    EXPECT_NE(st.message().find(name), std::string::npos) << c.tag << ": " << st.message();
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << c.tag << ": " << st.message();
    EXPECT_FALSE(w.serialize().is_ok()) << c.tag;
  }
  SafetensorsWriter meta;
  meta.set_metadata("k", "\xff");
  EXPECT_FALSE(meta.serialize().is_ok());
  EXPECT_TRUE(listing(dir_).empty()) << "a failed write left a file behind";
}

TEST_F(SafetensorsTest, AtomicWrite) {
  SafetensorsWriter first;
  first.add("w", "F32", {4}, random_bytes(16));
  SafetensorsWriter second;
  second.add("w", "BF16", {3, 3}, random_bytes(18));
  second.add("v", "I64", {}, random_bytes(8));

  // A directory that does not exist: a clean error, nothing created.
  const std::string nowhere = (dir_ / "no_such_dir" / "x.safetensors").string();
  Status st = first.write(nowhere);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(nowhere), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("temporary file"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));

  // Success leaves exactly the target, with the usual permissions.
  const std::string target = path("model.safetensors");
  ASSERT_TRUE(first.write(target).is_ok());
  EXPECT_EQ(listing(dir_), std::set<std::string>{"model.safetensors"});
  EXPECT_EQ(read_raw(target), first.serialize().value());
  mode_t mask = ::umask(0);
  ::umask(mask);
  struct stat sb {};
  ASSERT_EQ(::stat(target.c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0666u & ~mask);

  // Writing over an existing file replaces it.
  ASSERT_TRUE(second.write(target).is_ok());
  EXPECT_EQ(listing(dir_), std::set<std::string>{"model.safetensors"});
  auto r = SafetensorsFile::read(target);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r.value().entries().size(), 2u);
  EXPECT_EQ(r.value().find("w")->dtype, "BF16");

  // A failure after the data was written (the rename onto a directory fails): the temporary file
  // is removed and the target untouched.
  fs::create_directory(dir_ / "taken.safetensors");
  write_raw(path("taken.safetensors/keep"), {1, 2, 3});
  st = second.write(path("taken.safetensors"));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("taken.safetensors"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("rename"), std::string::npos) << st.message();
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"model.safetensors", "taken.safetensors"}));
  EXPECT_EQ(listing(dir_ / "taken.safetensors"), std::set<std::string>{"keep"});
  EXPECT_EQ(read_raw(target), second.serialize().value());

  // A path naming a directory.
  st = first.write(path("sub/"));
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("names a directory"), std::string::npos) << st.message();

  // A relative path with no directory part writes into the working directory.
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_);
  st = first.write("relative.safetensors");
  fs::current_path(cwd);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(listing(dir_), (std::set<std::string>{"model.safetensors", "relative.safetensors",
                                                   "taken.safetensors"}));
}

}  // namespace
}  // namespace packmoe::io
