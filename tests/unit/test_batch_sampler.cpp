// BatchSampler without shuffling: rows are the windows stream[p, p + S + 1) with p = 0, S, 2S,
// ... wrapping at the end of the stream (epochs counted), checked by hand on a small stream and
// against the index formula on fresh random streams; states can be saved and restored (resume
// reads the same windows); document separators; tokens >= vocab_size and short streams are
// errors naming the file and the side; the fixed validation set. Shuffles and blends:
// tests/unit/test_sampling.cpp.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "train/batch_sampler.h"

namespace packmoe::train {
namespace {

io::TokenDataset iota_data(uint32_t n, const std::string& source = "iota.bin") {
  io::TokenDataset d;
  d.tokens.resize(n);
  std::iota(d.tokens.begin(), d.tokens.end(), 0u);
  d.source = source;
  return d;
}

std::vector<int32_t> range(int32_t from, int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(BatchSampler, WindowsShiftTargetsAndWrap) {
  // T = 20, S = 4: windows start at 0, 4, 8, 12 (16 + 5 > 20); B = 2.
  BatchSampler s = BatchSampler::create(single_source(iota_data(20)), 32, 2, 4).value();
  EXPECT_EQ(s.shapes().front().windows, 4);
  Batch b = s.next();
  EXPECT_EQ(b.batch, 2);
  EXPECT_EQ(b.seq, 4);
  std::vector<int32_t> inputs = range(0, 8), targets = range(1, 4);
  const std::vector<int32_t> t2 = range(5, 4);
  targets.insert(targets.end(), t2.begin(), t2.end());
  EXPECT_EQ(b.inputs, inputs);
  EXPECT_EQ(b.targets, targets);
  EXPECT_EQ(s.state().consumed, std::vector<int64_t>{2});
  b = s.next();
  EXPECT_EQ(b.inputs[4], 12);
  EXPECT_EQ(b.targets[7], 16);
  b = s.next();  // wraps: the next window would need tokens 16..20
  EXPECT_EQ(b.inputs[0], 0);
  EXPECT_EQ(b.inputs[4], 4);
  EXPECT_EQ(s.state().consumed, std::vector<int64_t>{6});  // epoch 1, its third window next
}

TEST(BatchSampler, MatchesTheIndexFormulaOnRandomStreams) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t S = std::uniform_int_distribution<int64_t>(1, 40)(rng);
    const int64_t B = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const int64_t T = std::uniform_int_distribution<int64_t>(S + 1, 400)(rng);
    io::TokenDataset d;
    for (int64_t i = 0; i < T; ++i) d.tokens.push_back(std::uniform_int_distribution<uint32_t>(0, 999)(rng));
    BatchSampler s = BatchSampler::create(single_source(d), 1000, B, S).value();
    const int64_t W = (T - S - 1) / S + 1;
    ASSERT_EQ(s.shapes().front().windows, W);
    for (int64_t n = 0; n < 7; ++n) {
      const Batch b = s.next();
      for (int64_t r = 0; r < B; ++r) {
        const int64_t g = n * B + r;  // global row index
        const int64_t p = (g % W) * S;
        for (int64_t t = 0; t < S; ++t) {
          ASSERT_EQ(b.inputs[r * S + t], static_cast<int32_t>(d.tokens[p + t]));
          ASSERT_EQ(b.targets[r * S + t], static_cast<int32_t>(d.tokens[p + t + 1]));
        }
      }
      EXPECT_EQ(s.state().consumed.front(), (n + 1) * B);
    }
  }
}

TEST(BatchSampler, RestoredStateReadsTheSameWindows) {
  BatchSampler a = BatchSampler::create(single_source(iota_data(1000)), 1000, 3, 16).value();
  for (int i = 0; i < 25; ++i) a.next();  // past one epoch of 62 windows
  const SamplerState saved = a.state();
  EXPECT_EQ(saved.consumed, std::vector<int64_t>{75});
  BatchSampler b = BatchSampler::create(single_source(iota_data(1000)), 1000, 3, 16).value();
  ASSERT_TRUE(b.set_state(saved).is_ok());
  for (int i = 0; i < 5; ++i) {
    const Batch x = a.next(), y = b.next();
    EXPECT_EQ(x.inputs, y.inputs);
    EXPECT_EQ(x.targets, y.targets);
  }
  EXPECT_EQ(a.state().consumed, b.state().consumed);
  EXPECT_FALSE(b.set_state({{-16}}).is_ok());
  EXPECT_FALSE(b.set_state({{}}).is_ok());
}

TEST(BatchSampler, SeparatorGoesBetweenDocuments) {
  io::TokenDataset d;
  d.tokens = {1, 2, 3, 4, 5};
  d.doc_offsets = {0, 2, 3, 5};  // [1 2] [3] [4 5]
  BatchSampler s = BatchSampler::create(single_source(d, 9), 10, 1, 6).value();
  EXPECT_EQ(s.shapes().front().tokens, 7);
  const Batch b = s.next();
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{1, 2, 9, 3, 9, 4}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2, 9, 3, 9, 4, 5}));
  // Without a separator (or without boundaries) documents are concatenated as they are.
  EXPECT_EQ(BatchSampler::create(single_source(d), 10, 1, 4).value().shapes().front().tokens, 5);
  const auto bad_sep = BatchSampler::create(single_source(d, 10), 10, 1, 4);
  EXPECT_NE(bad_sep.status().message().find("separator token 10"), std::string::npos);
}

TEST(BatchSampler, TokenOutsideTheVocabularyAndShortStreamsAreNamedErrors) {
  io::TokenDataset d = iota_data(50, "data/train_text_document");
  d.tokens[37] = 300;
  const auto r = BatchSampler::create(single_source(d), 256, 2, 8);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(),
            "data/train_text_document: token 300 at index 37 is not below the model's vocab_size 256");
  const auto short_stream = BatchSampler::create(single_source(iota_data(8, "short.bin")), 256, 1, 8);
  ASSERT_FALSE(short_stream.is_ok());
  EXPECT_EQ(short_stream.status().message(),
            "short.bin: the training side of the data has 8 tokens, fewer than the seq_len + 1 = "
            "9 one row needs (lower --seq-len or give more data)");
  const auto short_valid =
      fixed_batches(single_source(iota_data(8, "short.bin")), 256, 1, 8, 1);
  ASSERT_FALSE(short_valid.is_ok());
  EXPECT_NE(short_valid.status().message().find(
                "short.bin: the validation side of the data has 8 tokens, fewer than the seq_len "
                "+ 1 = 9 one row needs (raise --valid-fraction"),
            std::string::npos)
      << short_valid.status().message();
}

TEST(BatchSampler, FixedBatchesAreTheFirstWindowsAsManyAsFit) {
  const auto v = fixed_batches(single_source(iota_data(100)), 128, 2, 8, 3);
  ASSERT_TRUE(v.is_ok()) << v.status().message();
  ASSERT_EQ(v.value().size(), 3u);
  EXPECT_EQ(v.value()[0].inputs[0], 0);
  EXPECT_EQ(v.value()[0].inputs[8], 8);
  EXPECT_EQ(v.value()[2].inputs[8], 40);
  // 100 tokens hold (100 - 9) / 8 + 1 = 12 windows: 7 batches of 2 would need 14, 6 fit.
  const auto fewer = fixed_batches(single_source(iota_data(100, "valid.bin")), 128, 2, 8, 7);
  ASSERT_TRUE(fewer.is_ok()) << fewer.status().message();
  EXPECT_EQ(fewer.value().size(), 6u);
  // Not even one batch of 16 rows: the message says how many rows there are and what to change.
  const auto none = fixed_batches(single_source(iota_data(100, "valid.bin")), 128, 16, 8, 1);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().message(),
            "valid.bin: the validation data gives 12 distinct rows of seq_len + 1 = 9 tokens, "
            "fewer than the micro_batch_size = 16 of one evaluation batch (lower --micro-batch "
            "or --seq-len, raise --valid-fraction, or give --valid-data)");
}

}  // namespace
}  // namespace packmoe::train

namespace packmoe::train {
namespace {

// ---- document masks ---------------------------------------------------------------------------

TEST(BatchSampler, DocumentStartsFromTheIndexWithSeparators) {
  // Documents of 3, 5 and 4 tokens, '\n'-style separator 99 between them: the stream is
  // 0 1 2 | 99 | 3 4 5 6 7 | 99 | 8 9 10 11; the separator ends the document before it, so
  // documents begin at stream indices 0, 4 and 10. S = 6, B = 2: rows [0, 6) and [6, 12).
  io::TokenDataset d = iota_data(12);
  d.doc_offsets = {0, 3, 8, 12};
  StreamOptions o;
  o.document_mask = DocumentMask::kIndex;
  o.reset_positions = true;
  BatchSampler s = BatchSampler::create(single_source(d, 99), 100, 2, 6, o).value();
  const Batch b = s.next();
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{0, 1, 2, 99, 3, 4, 5, 6, 7, 99, 8, 9}));
  // Row 0: documents begin at 0 and 4; row 1 (offset 6) starts inside the second document
  // (clipped to 0) and the third begins at stream 10 = position 4.
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 0, 0, 4, 4, 0, 0, 0, 0, 4, 4}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0, 1}));
}

TEST(BatchSampler, DocumentStartsFromAnEodToken) {
  // eod = 3: the token after each 3 starts a document; positions stay 0..S-1 without reset.
  io::TokenDataset d;
  d.tokens = {5, 3, 7, 7, 3, 3, 1, 2, 9};
  d.source = "eod.bin";
  StreamOptions o;
  o.document_mask = DocumentMask::kEodToken;
  o.eod_token = 3;
  BatchSampler s = BatchSampler::create(single_source(d), 10, 1, 8, o).value();
  const Batch b = s.next();
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 2, 2, 2, 5, 6, 6}));
  EXPECT_TRUE(b.positions.empty());
  // Without a mask a batch carries neither.
  BatchSampler plain = BatchSampler::create(single_source(d), 10, 1, 8).value();
  EXPECT_TRUE(plain.next().doc_start.empty());
}

TEST(BatchSampler, DocumentMaskErrors) {
  StreamOptions o;
  o.document_mask = DocumentMask::kIndex;
  const Result<BatchSampler> none = BatchSampler::create(single_source(iota_data(20)), 32, 1, 4, o);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("--eod-token"), std::string::npos);
  o.document_mask = DocumentMask::kEodToken;
  o.eod_token = 32;
  const Result<BatchSampler> big = BatchSampler::create(single_source(iota_data(20)), 32, 1, 4, o);
  ASSERT_FALSE(big.is_ok());
  EXPECT_NE(big.status().message().find("vocab_size 32"), std::string::npos);
}

}  // namespace
}  // namespace packmoe::train
