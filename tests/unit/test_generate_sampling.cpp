// Token choice (generate/sampling.h) on fixed logits with hand-derived answers: greedy is the
// argmax (ties to the lower id), temperature rescales the softmax, top-k and top-p keep exactly
// the sets their definitions give, a seed replays the same draws and another seed does not, the
// draws' frequencies follow the candidates' probabilities and never leave the set; bad settings
// are one error naming the flag; the streamed text waits for whole UTF-8 characters.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "core/philox.h"
#include "generate/sampling.h"
#include "generate/text_codec.h"

namespace packmoe::generate {
namespace {

std::vector<int32_t> ids_of(const std::vector<Candidate>& c) {
  std::vector<int32_t> out;
  for (const Candidate& x : c) out.push_back(x.id);
  return out;
}

SamplingConfig sampling(double t, int64_t k, double p, uint64_t seed = 7) {
  return SamplingConfig{t, k, p, seed};
}

TEST(Sampling, GreedyIsTheArgmaxWithTiesToTheLowerId) {
  const std::vector<float> z = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  for (uint64_t step : {0, 1, 99}) EXPECT_EQ(choose_token(z, sampling(0, 0, 1), step), 1);
  EXPECT_EQ(choose_token(std::vector<float>{-2.0f, -1.0f}, sampling(0, 1, 0.1), 0), 1);
}

TEST(Sampling, TemperatureTopKAndTopPSets) {
  // Probabilities at T = 1: 0.5, 0.3, 0.2 for ids 2, 0, 1 (id 3 far below).
  const std::vector<float> z = {std::log(0.3f), std::log(0.2f), std::log(0.5f), -40.0f};
  std::vector<Candidate> c = candidates(z, sampling(1, 0, 1));
  ASSERT_EQ(ids_of(c), (std::vector<int32_t>{2, 0, 1, 3}));
  EXPECT_NEAR(c[0].p, 0.5, 1e-7);
  EXPECT_NEAR(c[1].p, 0.3, 1e-7);
  EXPECT_NEAR(c[2].p, 0.2, 1e-7);
  // top-k 2: ids 2, 0 renormalised to 5/8, 3/8.
  c = candidates(z, sampling(1, 2, 1));
  ASSERT_EQ(ids_of(c), (std::vector<int32_t>{2, 0}));
  EXPECT_NEAR(c[0].p, 0.625, 1e-7);
  EXPECT_NEAR(c[1].p, 0.375, 1e-7);
  // top-p: the shortest prefix reaching p.
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 0, 0.5))), (std::vector<int32_t>{2}));
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 0, 0.3))), (std::vector<int32_t>{2}));
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 0, 0.6))), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 0, 0.79))), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 0, 0.81))), (std::vector<int32_t>{2, 0, 1}));
  // top-k first, then top-p over the k: 5/8 >= 0.6 keeps one.
  EXPECT_EQ(ids_of(candidates(z, sampling(1, 2, 0.6))), (std::vector<int32_t>{2}));
  // T = 0.5 squares the odds: 0.25 : 0.09 : 0.04 over 0.38.
  c = candidates(z, sampling(0.5, 3, 1));
  ASSERT_EQ(c.size(), 3u);
  EXPECT_NEAR(c[0].p, 0.25 / 0.38, 1e-6);
  EXPECT_NEAR(c[1].p, 0.09 / 0.38, 1e-6);
  EXPECT_NEAR(c[2].p, 0.04 / 0.38, 1e-6);
  // Exact quarters: top-p 0.5 is reached by two ids, exactly (">=" p, not "> p").
  const std::vector<float> flat = {1.0f, 1.0f, 1.0f, 1.0f};
  EXPECT_EQ(ids_of(candidates(flat, sampling(1, 0, 0.5))), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(ids_of(candidates(flat, sampling(1, 0, 0.25))), (std::vector<int32_t>{0}));
  EXPECT_EQ(candidates(flat, sampling(1, 0, 0.5))[1].p, 0.5);
  // Equal logits: the lower id first.
  EXPECT_EQ(ids_of(candidates(std::vector<float>{1, 2, 2, 1}, sampling(1, 3, 1))),
            (std::vector<int32_t>{1, 2, 0}));
}

TEST(Sampling, UniformDrawIsPhiloxOfSeedAndStep) {
  const Philox4 r = philox_draw(12345, 17, 0);
  const double want = (static_cast<double>(r.v[0]) * 2097152.0 + (r.v[1] >> 11)) / 9007199254740992.0;
  EXPECT_EQ(uniform_draw(12345, 17), want);
  for (uint64_t s = 0; s < 1000; ++s) {
    const double u = uniform_draw(3, s);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(Sampling, SeededDrawsReplayAndFollowTheProbabilities) {
  const std::vector<float> z = {std::log(0.3f), std::log(0.2f), std::log(0.5f), -40.0f};
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const SamplingConfig a = sampling(1, 0, 0.81, seed), other = sampling(1, 0, 0.81, seed + 1);
  const int n = 20000;
  std::map<int32_t, int> count;
  int differ = 0;
  for (int s = 0; s < n; ++s) {
    const int32_t t = choose_token(z, a, s);
    ASSERT_EQ(t, choose_token(z, a, s));  // the same seed and step: the same token
    differ += t != choose_token(z, other, s);
    ++count[t];
  }
  EXPECT_GT(differ, n / 4);
  EXPECT_EQ(count.count(3), 0u) << "id 3 is outside top-p 0.81";
  const double p[3] = {0.3, 0.2, 0.5};
  for (int32_t id = 0; id < 3; ++id) {
    const double sigma = std::sqrt(n * p[id] * (1 - p[id]));
    EXPECT_NEAR(count[id], n * p[id], 5 * sigma) << id;
  }
  // top-k 1 at any temperature is greedy.
  for (int s = 0; s < 100; ++s) EXPECT_EQ(choose_token(z, sampling(2.0, 1, 1, seed), s), 2);
}

TEST(Sampling, BadSettingsNameTheFlag) {
  EXPECT_TRUE(validate(sampling(0, 0, 1)).is_ok());
  EXPECT_TRUE(validate(sampling(0.7, 40, 0.95)).is_ok());
  auto expect = [](const SamplingConfig& c, const std::string& part) {
    const Status s = validate(c);
    ASSERT_FALSE(s.is_ok()) << part;
    EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
  };
  expect(sampling(-0.1, 0, 1), "--temperature");
  expect(sampling(NAN, 0, 1), "--temperature");
  expect(sampling(1, -1, 1), "--top-k");
  expect(sampling(1, 0, 0), "--top-p");
  expect(sampling(1, 0, 1.5), "--top-p");
  expect(sampling(1, 0, NAN), "--top-p");
}

TEST(TextCodec, CompleteUtf8PrefixWaitsForWholeCharacters) {
  EXPECT_EQ(complete_utf8_prefix(""), 0u);
  EXPECT_EQ(complete_utf8_prefix("abc"), 3u);
  EXPECT_EQ(complete_utf8_prefix("ab\xC3"), 2u);              // first byte of a 2-byte é
  EXPECT_EQ(complete_utf8_prefix("ab\xC3\xA9"), 4u);          // é complete
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82"), 1u);           // 2 of the 3 bytes of €
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82\xAC"), 4u);
  EXPECT_EQ(complete_utf8_prefix("a\xF0\x9F\x98"), 1u);       // 3 of the 4 bytes of an emoji
  EXPECT_EQ(complete_utf8_prefix("a\xF0\x9F\x98\x80"), 5u);
  EXPECT_EQ(complete_utf8_prefix("a\x80"), 2u);               // a stray continuation byte: printed
  // Byte tokens: the prompt's bytes are the ids; V other than 256 needs a tokenizer.
  Result<TextCodec> bytes = TextCodec::bytes(256);
  ASSERT_TRUE(bytes.is_ok());
  Result<std::vector<int32_t>> ids = bytes.value().encode("h\xC3\xA9");
  ASSERT_TRUE(ids.is_ok());
  EXPECT_EQ(ids.value(), (std::vector<int32_t>{104, 0xC3, 0xA9}));
  EXPECT_EQ(bytes.value().decode(ids.value()), "h\xC3\xA9");
  EXPECT_TRUE(bytes.value().stop_ids().empty());
  const Result<TextCodec> wrong = TextCodec::bytes(1000);
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.status().message().find("--tokenizer"), std::string::npos);
}

}  // namespace
}  // namespace packmoe::generate
