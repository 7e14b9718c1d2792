// Tests of io/token_data and io/text_corpus: Megatron .idx/.bin and llm.c shards built byte by
// byte from the format definitions (reference/style-and-ecosystem.md §2c, independent of the
// writers) read back right; writer round trips on random tokens; one failing file per validation
// check, each error naming the file; the byte tokenizer and the hash split on a fixture corpus.
// Files go to $PACKMOE_TEST_TMP (else the system temp dir), one fresh directory per test.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "common/test_files.h"
#include "io/text_corpus.h"
#include "io/token_data.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using test::write_raw;

class TokenDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("token_data_");
    seed_ = test::recorded_random_seed();
    rng_.seed(seed_);
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// Little-endian byte builders, written from the format tables, not from the writers.
template <typename T>
void put(std::vector<uint8_t>* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
  }
}

void write_text(const std::string& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

struct IdxSpec {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  uint64_t version = 1;
  uint8_t dtype = 8;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;  // empty: contiguous from lengths
  std::vector<int64_t> doc_idx;
  std::vector<uint8_t> modes;     // multimodal trailing array, when non-empty
};

std::vector<uint8_t> make_idx(const IdxSpec& s, uint32_t itemsize) {
  std::vector<uint8_t> out(s.magic.begin(), s.magic.end());
  put<uint64_t>(&out, s.version);
  out.push_back(s.dtype);
  put<uint64_t>(&out, s.lengths.size());
  put<uint64_t>(&out, s.doc_idx.size());
  EXPECT_EQ(out.size(), 34u);
  for (int32_t l : s.lengths) put<int32_t>(&out, l);
  int64_t at = 0;
  for (size_t i = 0; i < s.lengths.size(); ++i) {
    put<int64_t>(&out, s.pointers.empty() ? at : s.pointers[i]);
    at += int64_t{s.lengths[i]} * itemsize;
  }
  for (int64_t d : s.doc_idx) put<int64_t>(&out, d);
  out.insert(out.end(), s.modes.begin(), s.modes.end());
  return out;
}

std::vector<uint8_t> make_llmc(int32_t magic, int32_t version, int32_t count,
                               const std::vector<uint32_t>& tokens, uint32_t itemsize) {
  std::vector<uint8_t> out;
  put<int32_t>(&out, magic);
  put<int32_t>(&out, version);
  put<int32_t>(&out, count);
  out.resize(1024, 0);
  for (uint32_t t : tokens) {
    if (itemsize == 2) put<uint16_t>(&out, static_cast<uint16_t>(t));
    else put<uint32_t>(&out, t);
  }
  return out;
}

// Asserts `r` failed with a message naming `file` and containing `what`.
template <typename R>
void expect_error(const R& r, const std::string& file, const std::string& what) {
  ASSERT_FALSE(r.is_ok()) << "expected an error about " << what;
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find(file), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

void expect_status_error(const Status& s, const std::string& file, const std::string& what) {
  ASSERT_FALSE(s.is_ok()) << "expected an error about " << what;
  EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
}

// ---- Megatron, hand-built -----------------------------------------------------------------------

TEST_F(TokenDataTest, MegatronHandBuiltUint16TwoDocumentsThreeSequences) {
  // Sequences of 3, 0 and 2 tokens; document 0 = sequences [0, 2), document 1 = [2, 3).
  IdxSpec s;
  s.lengths = {3, 0, 2};
  s.doc_idx = {0, 2, 3};
  write_raw(path("d.idx"), make_idx(s, 2));
  std::vector<uint8_t> bin;
  for (uint16_t t : {7, 65535, 0, 300, 1}) put<uint16_t>(&bin, t);
  write_raw(path("d.bin"), bin);

  for (const std::string& p : {path("d"), path("d.idx"), path("d.bin")}) {
    auto r = read_megatron(p);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r.value().tokens, (std::vector<uint32_t>{7, 65535, 0, 300, 1}));
    EXPECT_EQ(r.value().doc_offsets, (std::vector<uint64_t>{0, 3, 5}));
    ASSERT_EQ(r.value().num_documents(), 2u);
    EXPECT_EQ(r.value().document(1).size(), 2u);
    EXPECT_EQ(r.value().document(1)[0], 300u);
  }
}

TEST_F(TokenDataTest, MegatronHandBuiltOtherIntegerDtypesAndModes) {
  struct Case { uint8_t code; uint32_t size; std::vector<int64_t> values; };
  const std::vector<Case> cases = {
      {1, 1, {0, 255, 17}},  {2, 1, {0, 127, 5}},          {3, 2, {0, 32767, 9}},
      {4, 4, {0, 2147483647, 70000}}, {5, 8, {0, 4294967295LL, 1}}, {8, 2, {0, 65535, 2}}};
  for (const Case& c : cases) {
    SCOPED_TRACE("dtype code " + std::to_string(c.code));
    IdxSpec s;
    s.dtype = c.code;
    s.lengths = {1, 2};
    s.doc_idx = {0, 1, 2};
    s.modes = {0, 1};  // multimodal sequence modes: accepted and ignored
    write_raw(path("m.idx"), make_idx(s, c.size));
    std::vector<uint8_t> bin;
    for (int64_t v : c.values) {
      for (uint32_t i = 0; i < c.size; ++i) bin.push_back(static_cast<uint8_t>(uint64_t(v) >> (8 * i)));
    }
    write_raw(path("m.bin"), bin);
    auto r = read_megatron(path("m"));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    std::vector<uint32_t> expect(c.values.begin(), c.values.end());
    EXPECT_EQ(r.value().tokens, expect);
    EXPECT_EQ(r.value().doc_offsets, (std::vector<uint64_t>{0, 1, 3}));
  }
}

TEST_F(TokenDataTest, MegatronEmptyDataset) {
  IdxSpec s;
  s.doc_idx = {0};
  write_raw(path("e.idx"), make_idx(s, 2));
  write_raw(path("e.bin"), {});
  auto r = read_megatron(path("e"));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(r.value().tokens.empty());
  EXPECT_EQ(r.value().num_documents(), 0u);
}

// ---- llm.c, hand-built --------------------------------------------------------------------------

TEST_F(TokenDataTest, LlmcHandBuiltGpt2AndLlama3) {
  const std::vector<uint32_t> toks = {50256, 10, 20, 50256, 30, 65535};
  write_raw(path("g.bin"), make_llmc(20240520, 1, 6, toks, 2));
  auto r = read_llmc_shard(path("g.bin"));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().tokens, toks);
  EXPECT_TRUE(r.value().doc_offsets.empty());
  auto d = read_llmc_shard(path("g.bin"), 50256u);
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d.value().doc_offsets, (std::vector<uint64_t>{0, 3, 6}));

  const std::vector<uint32_t> big = {128000, 5, 4294967295u};
  write_raw(path("l.bin"), make_llmc(20240801, 7, 3, big, 4));
  auto l = read_llmc_shard(path("l.bin"));
  ASSERT_TRUE(l.is_ok()) << l.status().message();
  EXPECT_EQ(l.value().tokens, big);
}

// ---- writers: round trips and bytes -------------------------------------------------------------

TEST_F(TokenDataTest, MegatronWriterRoundTripsRandomTokens) {
  struct Case { MegatronDType dtype; uint32_t max; };
  for (const Case& c : {Case{MegatronDType::kU8, 255}, Case{MegatronDType::kI8, 127},
                        Case{MegatronDType::kI16, 32767}, Case{MegatronDType::kU16, 65535},
                        Case{MegatronDType::kI32, 2147483647u},
                        Case{MegatronDType::kI64, 4294967295u}}) {
    SCOPED_TRACE("dtype code " + std::to_string(int(c.dtype)));
    TokenDataset data;
    std::uniform_int_distribution<uint32_t> tok(0, c.max);
    std::uniform_int_distribution<int> len(0, 40);
    data.doc_offsets = {0};
    for (int d = 0; d < 25; ++d) {
      const int n = len(rng_);
      for (int i = 0; i < n; ++i) data.tokens.push_back(tok(rng_));
      data.doc_offsets.push_back(data.tokens.size());
    }
    ASSERT_TRUE(write_megatron(path("w"), data, c.dtype).is_ok());
    auto r = read_megatron(path("w"));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r.value().tokens, data.tokens);
    EXPECT_EQ(r.value().doc_offsets, data.doc_offsets);
  }
}

TEST_F(TokenDataTest, MegatronWriterBytesMatchTheFormat) {
  TokenDataset data;
  data.tokens = {1, 2, 3, 4, 5};
  data.doc_offsets = {0, 2, 5};
  ASSERT_TRUE(write_megatron(path("b"), data, MegatronDType::kU16).is_ok());
  IdxSpec s;
  s.lengths = {2, 3};
  s.doc_idx = {0, 1, 2};
  std::ifstream f(path("b.idx"), std::ios::binary);
  std::vector<uint8_t> got((std::istreambuf_iterator<char>(f)), {});
  EXPECT_EQ(got, make_idx(s, 2));
  EXPECT_EQ(fs::file_size(path("b.bin")), 10u);
  // No documents given: one document of everything; no tokens: zero documents.
  data.doc_offsets.clear();
  ASSERT_TRUE(write_megatron(path("one"), data).is_ok());
  EXPECT_EQ(read_megatron(path("one")).value().doc_offsets, (std::vector<uint64_t>{0, 5}));
  ASSERT_TRUE(write_megatron(path("none"), TokenDataset{}).is_ok());
  EXPECT_EQ(read_megatron(path("none")).value().num_documents(), 0u);
}

TEST_F(TokenDataTest, LlmcWriterRoundTripsAndMatchesBytes) {
  std::uniform_int_distribution<uint32_t> tok16(0, 65535);
  std::vector<uint32_t> toks(1000);
  for (auto& t : toks) t = tok16(rng_);
  ASSERT_TRUE(write_llmc_shard(path("s.bin"), toks).is_ok());
  std::ifstream f(path("s.bin"), std::ios::binary);
  std::vector<uint8_t> got((std::istreambuf_iterator<char>(f)), {});
  EXPECT_EQ(got, make_llmc(20240520, 1, 1000, toks, 2));
  auto r = read_llmc_shard(path("s.bin"));
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r.value().tokens, toks);

  std::uniform_int_distribution<uint32_t> tok32;
  for (auto& t : toks) t = tok32(rng_);
  ASSERT_TRUE(write_llmc_shard(path("l.bin"), toks, LlmcFormat::kLlama3).is_ok());
  auto l = read_llmc_shard(path("l.bin"));
  ASSERT_TRUE(l.is_ok());
  EXPECT_EQ(l.value().tokens, toks);
  ASSERT_TRUE(write_llmc_shard(path("z.bin"), {}).is_ok());
  EXPECT_TRUE(read_llmc_shard(path("z.bin")).value().tokens.empty());
}

TEST_F(TokenDataTest, WritersRejectOutOfRangeTokensAndWriteNothing) {
  TokenDataset data;
  data.tokens = {1, 65536, 2};
  expect_status_error(write_megatron(path("o"), data, MegatronDType::kU16), path("o.bin"),
               "out of range for uint16");
  EXPECT_FALSE(fs::exists(path("o.bin")));
  EXPECT_FALSE(fs::exists(path("o.idx")));
  data.tokens = {1, 128};
  expect_status_error(write_megatron(path("o"), data, MegatronDType::kI8), path("o.bin"),
               "out of range for int8");
  const std::vector<uint32_t> toks = {0, 70000};
  expect_status_error(write_llmc_shard(path("o.shard"), toks), path("o.shard"),
               "out of range for uint16");
  EXPECT_FALSE(fs::exists(path("o.shard")));
  data.tokens = {1};
  expect_status_error(write_megatron(path("o"), data, MegatronDType::kF32), path("o.idx"),
               "cannot hold token ids");
  data.doc_offsets = {0, 2};
  expect_status_error(write_megatron(path("o"), data), path("o.idx"), "document offsets");
  EXPECT_TRUE(fs::is_empty(dir_));  // no temporary file left behind either
}

// ---- Megatron validation errors -----------------------------------------------------------------

class MegatronErrors : public TokenDataTest {
 protected:
  // x.idx from `s` and an x.bin of `bin_bytes` bytes (10 = the 5 uint16 tokens of good()).
  void write_dataset(const IdxSpec& s, size_t bin_bytes = 10) {
    write_raw(path("x.idx"), make_idx(s, s.dtype == 4 ? 4 : 2));
    write_raw(path("x.bin"), std::vector<uint8_t>(bin_bytes, 1));
  }
  IdxSpec good() const {
    IdxSpec s;
    s.lengths = {2, 3};
    s.doc_idx = {0, 1, 2};
    return s;
  }
};

TEST_F(MegatronErrors, BadMagic) {
  IdxSpec s = good();
  s.magic[0] = 'X';
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "bad magic");
}

TEST_F(MegatronErrors, BadVersion) {
  IdxSpec s = good();
  s.version = 2;
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "unsupported version 2");
}

TEST_F(MegatronErrors, UnknownAndFloatDtype) {
  IdxSpec s = good();
  for (uint8_t code : {0, 9, 255}) {
    s.dtype = code;
    write_dataset(s);
    expect_error(read_megatron(path("x")), path("x.idx"), "unknown dtype code " + std::to_string(code));
  }
  for (uint8_t code : {6, 7}) {
    s.dtype = code;
    write_dataset(s);
    expect_error(read_megatron(path("x")), path("x.idx"), "cannot hold token ids");
  }
}

TEST_F(MegatronErrors, TruncatedIndex) {
  write_dataset(good());
  std::ifstream f(path("x.idx"), std::ios::binary);
  std::vector<uint8_t> full((std::istreambuf_iterator<char>(f)), {});
  for (size_t keep : {size_t{0}, size_t{20}, size_t{33}}) {
    write_raw(path("x.idx"), std::vector<uint8_t>(full.begin(), full.begin() + keep));
    expect_error(read_megatron(path("x")), path("x.idx"), "shorter than the 34-byte header");
  }
  for (size_t cut : {size_t{1}, size_t{8}, full.size() - 34}) {
    write_raw(path("x.idx"), std::vector<uint8_t>(full.begin(), full.end() - cut));
    expect_error(read_megatron(path("x")), path("x.idx"), "truncated");
  }
  std::vector<uint8_t> longer = full;
  longer.push_back(0);  // 1 trailing byte: neither exact nor S bytes of modes
  write_raw(path("x.idx"), longer);
  expect_error(read_megatron(path("x")), path("x.idx"), "trailing bytes");
}

TEST_F(MegatronErrors, HugeCountsDoNotOverflowOrAllocate) {
  IdxSpec s = good();
  std::vector<uint8_t> bytes = make_idx(s, 2);
  for (uint64_t n : {uint64_t{1} << 62, ~uint64_t{0}, uint64_t{1} << 40}) {
    std::vector<uint8_t> b = bytes;
    std::memcpy(b.data() + 18, &n, 8);
    write_raw(path("x.idx"), b);
    ASSERT_FALSE(read_megatron(path("x")).is_ok());
    expect_error(read_megatron(path("x")), path("x.idx"), std::to_string(n));
  }
}

TEST_F(MegatronErrors, BinSizeMismatch) {
  write_dataset(good(), 9);
  expect_error(read_megatron(path("x")), path("x.bin"), "truncated");
  write_dataset(good(), 12);
  expect_error(read_megatron(path("x")), path("x.bin"), "describes 5 uint16 tokens = 10 bytes");
  fs::remove(path("x.bin"));
  expect_error(read_megatron(path("x")), path("x.bin"), "cannot open");
  fs::remove(path("x.idx"));
  expect_error(read_megatron(path("x")), path("x.idx"), "cannot open");
}

TEST_F(MegatronErrors, InconsistentArrays) {
  IdxSpec s = good();
  s.lengths = {2, -3};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "negative length");
  s = good();
  s.pointers = {0, 6};  // should be 4 (2 uint16 tokens)
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "contiguous");
  s = good();
  s.doc_idx = {1, 2};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "expected 0");
  s.doc_idx = {0, 2, 1};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "non-decreasing");
  s.doc_idx = {0, 3};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "non-decreasing");
  s.doc_idx = {0, 1};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "outside every document");
  s.doc_idx = {};
  write_dataset(s);
  expect_error(read_megatron(path("x")), path("x.idx"), "document index array is empty");
}

TEST_F(MegatronErrors, NegativeTokenInSignedDtype) {
  IdxSpec s = good();
  s.dtype = 4;  // int32
  write_raw(path("x.idx"), make_idx(s, 4));
  std::vector<uint8_t> bin;
  for (int32_t t : {1, 2, 3, -5, 4}) put<int32_t>(&bin, t);
  write_raw(path("x.bin"), bin);
  expect_error(read_megatron(path("x")), path("x.bin"), "token 3 is -5");
}

// ---- llm.c validation errors --------------------------------------------------------------------

TEST_F(TokenDataTest, LlmcErrors) {
  const std::string p = path("e.bin");
  const std::vector<uint32_t> toks = {1, 2, 3};
  write_raw(p, make_llmc(20240521, 1, 3, toks, 2));
  expect_error(read_llmc_shard(p), p, "bad magic 20240521");
  write_raw(p, make_llmc(20240520, 2, 3, toks, 2));
  expect_error(read_llmc_shard(p), p, "unsupported version 2");
  write_raw(p, make_llmc(20240801, 1, 3, toks, 4));
  expect_error(read_llmc_shard(p), p, "unsupported version 1");
  write_raw(p, std::vector<uint8_t>(100, 0));
  expect_error(read_llmc_shard(p), p, "shorter than the 1024-byte");
  write_raw(p, make_llmc(20240520, 1, 4, toks, 2));
  expect_error(read_llmc_shard(p), p, "truncated");
  write_raw(p, make_llmc(20240520, 1, 2, toks, 2));
  expect_error(read_llmc_shard(p), p, "trailing bytes");
  write_raw(p, make_llmc(20240520, 1, -1, {}, 2));
  expect_error(read_llmc_shard(p), p, "negative token count");
  write_raw(p, make_llmc(20240520, 1, 2147483647, toks, 2));
  expect_error(read_llmc_shard(p), p, "truncated");
  expect_error(read_llmc_shard(path("missing.bin")), path("missing.bin"), "cannot open");
}

// ---- text corpus --------------------------------------------------------------------------------

TEST(ByteTokenizer, EveryByteRoundTrips) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<uint32_t> t = byte_tokenize(all);
  ASSERT_EQ(t.size(), 256u);
  for (uint32_t b = 0; b < 256; ++b) EXPECT_EQ(t[b], b);
  EXPECT_EQ(byte_detokenize(t), all);
  EXPECT_EQ(byte_tokenize("hé"), (std::vector<uint32_t>{0x68, 0xC3, 0xA9}));
}

TEST(DocumentHash, IsFnv1a64) {
  EXPECT_EQ(document_hash(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(document_hash("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(document_hash("foobar"), 0x85944171f73967e8ull);
}

class TextCorpusTest : public TokenDataTest {
 protected:
  void write_fixture() {
    fs::create_directories(dir_ / "corpus");
    std::string a, b;
    // Appended piecewise: GCC 12 gives a false -Wrestrict on chained operator+ with literals.
    for (int i = 0; i < 60; ++i) {
      a += "fortune number ";
      a += std::to_string(i);
      a += "\n\tsecond line\n%\n";
    }
    a += "last one without a separator\n";
    for (int i = 0; i < 40; ++i) {
      b += "b";
      b += std::to_string(i);
      b += "\r\n%\r\n";
    }
    b += "%\n  \n%\n";  // an empty and a blank document: dropped
    write_text((dir_ / "corpus" / "a").string(), a);
    write_text((dir_ / "corpus" / "b.txt").string(), b);
    write_text((dir_ / "corpus" / "a.dat").string(), std::string("\x00\x02junk", 6));
    write_text((dir_ / "corpus" / ".hidden").string(), "hidden\n");
    fs::create_symlink("a", dir_ / "corpus" / "a.u8");
  }
};

TEST_F(TextCorpusTest, DocumentsTokensAndDeterministicSplit) {
  write_fixture();
  TextCorpusOptions opt;
  opt.paths = {(dir_ / "corpus").string()};
  auto r = load_text_corpus(opt);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const TextCorpus& c = r.value();
  ASSERT_EQ(c.files.size(), 2u);  // a, b.txt; .dat, .u8 and hidden skipped
  EXPECT_EQ(fs::path(c.files[0]).filename(), "a");
  EXPECT_EQ(c.train.num_documents() + c.validation.num_documents(), 61u + 40u);
  EXPECT_EQ(c.text_bytes, c.train.tokens.size() + c.validation.tokens.size());
  ASSERT_TRUE(validate_doc_offsets(c.train, "train").is_ok());
  ASSERT_TRUE(validate_doc_offsets(c.validation, "validation").is_ok());
  EXPECT_GT(c.validation.num_documents(), 0u);  // ~10% of 101, fixed by the hash
  EXPECT_LT(c.validation.num_documents(), 30u);

  // Every document is on the side its hash says, and documents keep their text.
  for (const TokenDataset* d : {&c.train, &c.validation}) {
    for (size_t i = 0; i < d->num_documents(); ++i) {
      const std::string text = byte_detokenize(d->document(i));
      EXPECT_EQ(is_validation_document(text, 0.1), d == &c.validation) << text;
      EXPECT_NE(text.find_first_not_of(" \r\n\t"), std::string::npos);
      EXPECT_EQ(text.find("%"), std::string::npos) << text;
    }
  }
  const std::string first = "fortune number 0\n\tsecond line\n";
  const TokenDataset& side = is_validation_document(first, 0.1) ? c.validation : c.train;
  EXPECT_EQ(byte_detokenize(side.document(0)), first);

  // Same result again, and the same split when the files are passed one by one in reverse order.
  auto again = load_text_corpus(opt);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again.value().train.tokens, c.train.tokens);
  EXPECT_EQ(again.value().validation.doc_offsets, c.validation.doc_offsets);
  TextCorpusOptions rev;
  rev.paths = {c.files[1], c.files[0]};
  auto r2 = load_text_corpus(rev);
  ASSERT_TRUE(r2.is_ok());
  EXPECT_EQ(r2.value().validation.num_documents(), c.validation.num_documents());
  EXPECT_EQ(r2.value().text_bytes, c.text_bytes);

  // Fractions 0 and 1 put everything on one side.
  opt.validation_fraction = 0.0;
  EXPECT_EQ(load_text_corpus(opt).value().validation.num_documents(), 0u);
  opt.validation_fraction = 1.0;
  EXPECT_EQ(load_text_corpus(opt).value().train.num_documents(), 0u);
  opt.validation_fraction = 1.5;
  EXPECT_FALSE(load_text_corpus(opt).is_ok());

  // No separator: one document per file.
  opt.validation_fraction = 0.0;
  opt.separator_line = "";
  EXPECT_EQ(load_text_corpus(opt).value().train.num_documents(), 2u);
}

TEST_F(TextCorpusTest, MissingOrEmptyCorpusIsAClearError) {
  TextCorpusOptions opt;
  opt.paths = {path("nope")};
  expect_error(load_text_corpus(opt), path("nope"), "corpus path not found");
  fs::create_directories(dir_ / "empty");
  write_text((dir_ / "empty" / "x.dat").string(), "index");
  opt.paths = {(dir_ / "empty").string()};
  expect_error(load_text_corpus(opt), (dir_ / "empty").string(), "no text files");
  write_text((dir_ / "empty" / "blank").string(), "%\n \n%\n");
  expect_error(load_text_corpus(opt), (dir_ / "empty").string(), "hold no text");
}

TEST(DefaultCorpus, LoadsWhenInstalled) {
  if (!fs::exists(kDefaultCorpusDir)) {
    GTEST_SKIP() << kDefaultCorpusDir << " absent (Debian package '" << kDefaultCorpusPackage
                 << "' not installed)";
  }
  auto r = load_text_corpus();
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const TextCorpus& c = r.value();
  EXPECT_GT(c.text_bytes, 100'000u);
  const double docs = double(c.train.num_documents() + c.validation.num_documents());
  const double share = double(c.validation.num_documents()) / docs;
  EXPECT_GT(share, 0.07);
  EXPECT_LT(share, 0.13);
  for (uint32_t t : c.train.tokens) ASSERT_LT(t, kByteVocab);
  std::cout << "default corpus: " << c.files.size() << " files, " << c.text_bytes << " bytes, "
            << c.train.num_documents() << " train / " << c.validation.num_documents()
            << " validation documents\n";
}

}  // namespace
}  // namespace packmoe::io
