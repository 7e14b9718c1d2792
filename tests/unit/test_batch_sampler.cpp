// BatchSampler: rows are the windows stream[p, p + S + 1) with p = 0, S, 2S, ... wrapping at the
// end of the stream (epochs counted), checked by hand on a small stream and against the index
// formula on fresh random streams; positions can be saved and restored (resume reads the same
// windows); document separators; tokens >= vocab_size and short streams are errors naming the
// file; the fixed validation set.
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
  BatchSampler s = BatchSampler::create(iota_data(20), 32, 2, 4).value();
  EXPECT_EQ(s.windows_per_epoch(), 4);
  Batch b = s.next();
  EXPECT_EQ(b.batch, 2);
  EXPECT_EQ(b.seq, 4);
  std::vector<int32_t> inputs = range(0, 8), targets = range(1, 4);
  const std::vector<int32_t> t2 = range(5, 4);
  targets.insert(targets.end(), t2.begin(), t2.end());
  EXPECT_EQ(b.inputs, inputs);
  EXPECT_EQ(b.targets, targets);
  EXPECT_EQ(s.position().offset, 8);
  EXPECT_EQ(s.position().epoch, 0);
  b = s.next();
  EXPECT_EQ(b.inputs[4], 12);
  EXPECT_EQ(b.targets[7], 16);
  b = s.next();  // wraps: the next window would need tokens 16..20
  EXPECT_EQ(b.inputs[0], 0);
  EXPECT_EQ(b.inputs[4], 4);
  EXPECT_EQ(s.position().epoch, 1);
  EXPECT_EQ(s.position().offset, 8);
}

TEST(BatchSampler, MatchesTheIndexFormulaOnRandomStreams) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t S = std::uniform_int_distribution<int64_t>(1, 40)(rng);
    const int64_t B = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const int64_t T = std::uniform_int_distribution<int64_t>(S + 1, 400)(rng);
    io::TokenDataset d;
    for (int64_t i = 0; i < T; ++i) d.tokens.push_back(std::uniform_int_distribution<uint32_t>(0, 999)(rng));
    BatchSampler s = BatchSampler::create(d, 1000, B, S).value();
    const int64_t W = (T - S - 1) / S + 1;
    ASSERT_EQ(s.windows_per_epoch(), W);
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
      EXPECT_EQ(s.position().epoch, ((n + 1) * B - 1) / W);
    }
  }
}

TEST(BatchSampler, RestoredPositionReadsTheSameWindows) {
  BatchSampler a = BatchSampler::create(iota_data(1000), 1000, 3, 16).value();
  for (int i = 0; i < 25; ++i) a.next();  // past one epoch
  const SamplerPosition saved = a.position();
  EXPECT_GE(saved.epoch, 1);
  BatchSampler b = BatchSampler::create(iota_data(1000), 1000, 3, 16).value();
  ASSERT_TRUE(b.set_position(saved).is_ok());
  for (int i = 0; i < 5; ++i) {
    const Batch x = a.next(), y = b.next();
    EXPECT_EQ(x.inputs, y.inputs);
    EXPECT_EQ(x.targets, y.targets);
  }
  EXPECT_EQ(a.position().offset, b.position().offset);
  EXPECT_EQ(a.position().epoch, b.position().epoch);

  EXPECT_FALSE(b.set_position({17, 0}).is_ok());    // not a window start
  EXPECT_FALSE(b.set_position({992, 0}).is_ok());   // 992 + 17 > 1000
  EXPECT_FALSE(b.set_position({-16, 0}).is_ok());
  const Status bad = b.set_position({0, -1});
  EXPECT_NE(bad.message().find("iota.bin"), std::string::npos) << bad.message();
  EXPECT_TRUE(b.set_position({976, 4}).is_ok());    // the last window
}

TEST(BatchSampler, SeparatorGoesBetweenDocuments) {
  io::TokenDataset d;
  d.tokens = {1, 2, 3, 4, 5};
  d.doc_offsets = {0, 2, 3, 5};  // [1 2] [3] [4 5]
  StreamOptions sep;
  sep.separator = 9;
  BatchSampler s = BatchSampler::create(d, 10, 1, 6, sep).value();
  EXPECT_EQ(s.stream_tokens(), 7);
  const Batch b = s.next();
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{1, 2, 9, 3, 9, 4}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{2, 9, 3, 9, 4, 5}));
  // Without a separator (or without boundaries) documents are concatenated as they are.
  EXPECT_EQ(BatchSampler::create(d, 10, 1, 4).value().stream_tokens(), 5);
  sep.separator = 10;
  const auto bad_sep = BatchSampler::create(d, 10, 1, 4, sep);
  EXPECT_NE(bad_sep.status().message().find("separator token 10"), std::string::npos);
}

TEST(BatchSampler, TokenOutsideTheVocabularyAndShortStreamsAreNamedErrors) {
  io::TokenDataset d = iota_data(50, "data/train_text_document");
  d.tokens[37] = 300;
  const auto r = BatchSampler::create(d, 256, 2, 8);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(),
            "data/train_text_document: token 300 at index 37 is not below the model's vocab_size 256");
  const auto short_stream = BatchSampler::create(iota_data(8, "short.bin"), 256, 1, 8);
  ASSERT_FALSE(short_stream.is_ok());
  EXPECT_EQ(short_stream.status().message(), "short.bin: 8 tokens, fewer than seq_len + 1 = 9");
}

TEST(BatchSampler, FixedBatchesAreTheFirstWindowsAndMustFit) {
  const auto v = fixed_batches(iota_data(100), 128, 2, 8, 3);
  ASSERT_TRUE(v.is_ok()) << v.status().message();
  ASSERT_EQ(v.value().size(), 3u);
  EXPECT_EQ(v.value()[0].inputs[0], 0);
  EXPECT_EQ(v.value()[0].inputs[8], 8);
  EXPECT_EQ(v.value()[2].inputs[8], 40);
  // 100 tokens hold (100 - 9) / 8 + 1 = 12 windows; 7 batches of 2 need 14.
  const auto too_many = fixed_batches(iota_data(100, "valid.bin"), 128, 2, 8, 7);
  ASSERT_FALSE(too_many.is_ok());
  EXPECT_EQ(too_many.status().message(),
            "valid.bin: 12 windows of seq_len + 1 = 9 tokens, fewer than the 14 an evaluation "
            "reads (eval_batches 7 x micro_batch_size 2)");
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
  o.separator = 99;
  o.document_mask = DocumentMask::kIndex;
  o.reset_positions = true;
  BatchSampler s = BatchSampler::create(d, 100, 2, 6, o).value();
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
  BatchSampler s = BatchSampler::create(d, 10, 1, 8, o).value();
  const Batch b = s.next();
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 2, 2, 2, 5, 6, 6}));
  EXPECT_TRUE(b.positions.empty());
  // Without a mask a batch carries neither.
  BatchSampler plain = BatchSampler::create(d, 10, 1, 8).value();
  EXPECT_TRUE(plain.next().doc_start.empty());
}

TEST(BatchSampler, DocumentMaskErrors) {
  StreamOptions o;
  o.document_mask = DocumentMask::kIndex;
  const Result<BatchSampler> none = BatchSampler::create(iota_data(20), 32, 1, 4, o);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("--eod-token"), std::string::npos);
  o.document_mask = DocumentMask::kEodToken;
  o.eod_token = 32;
  const Result<BatchSampler> big = BatchSampler::create(iota_data(20), 32, 1, 4, o);
  ASSERT_FALSE(big.is_ok());
  EXPECT_NE(big.status().message().find("vocab_size 32"), std::string::npos);
}

}  // namespace
}  // namespace packmoe::train
