// sum_squares_cpu (backend/ops/elementwise.h) against independent references: the chunk / R32 /
// sequential order rebuilt here with explicit lane arrays and a written-out tree (bitwise), and a
// long-double sum on large inputs (1e-15 relative); empty inputs give +0, a negative length is an
// error. Also: adamw_update with grad_scale equals the update on g * grad_scale, bit for bit; the
// per-expert amax that adamw takes of its BF16 image equals the max of the image's values.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/elementwise.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

uint64_t fresh_seed() { return std::random_device{}(); }

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Normal values with tiny, large (dominating) and subnormal ones mixed in.
float rand_value(std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  switch (rng() % 20) {
    case 0:
      return std::ldexp(nd(rng), -60);
    case 1:
      return std::ldexp(nd(rng), 40);
    case 2:
      return f32_from_bits(static_cast<uint32_t>(1 + rng() % 0x7FFFFF));
    default:
      return nd(rng);
  }
}

std::vector<float> rand_floats(size_t n, std::mt19937_64& rng) {
  std::vector<float> v(n);
  for (float& x : v) x = rand_value(rng);
  return v;
}

// The R32 tree over n terms: lane l = +0 + term(l) + term(l + 32) + ... (a loop per lane), then
// the five levels of the tree written as separate arrays: level16[l] = lane[l] + lane[l + 16], and
// so on.
template <typename Term>
double by_lanes(int64_t n, Term term) {
  std::array<double, 32> lane{};
  for (int l = 0; l < 32; ++l) {
    double acc = 0.0;
    for (int64_t i = l; i < n; i += 32) acc = acc + term(i);
    lane[l] = acc;
  }
  std::array<double, 16> level16;
  for (int l = 0; l < 16; ++l) level16[l] = lane[l] + lane[l + 16];
  std::array<double, 8> level8;
  for (int l = 0; l < 8; ++l) level8[l] = level16[l] + level16[l + 8];
  std::array<double, 4> level4;
  for (int l = 0; l < 4; ++l) level4[l] = level8[l] + level8[l + 4];
  const double level2[2] = {level4[0] + level4[2], level4[1] + level4[3]};
  return level2[0] + level2[1];
}

// One chunk: the tree over its squares (each exact in FP64).
double chunk_by_lanes(const float* x, int64_t n) {
  return by_lanes(n, [&](int64_t i) { return static_cast<double>(x[i]) * x[i]; });
}

// Chunks of kSumSquaresChunk per segment; the chunk sums in (segment, chunk) order in groups of
// kSumSquaresGroup, the tree over each group, then the tree over the group sums.
double by_chunks(const std::vector<std::vector<float>>& segs) {
  std::vector<double> partial;
  for (const std::vector<float>& s : segs)
    for (size_t first = 0; first < s.size(); first += kSumSquaresChunk) {
      const int64_t len =
          std::min<int64_t>(kSumSquaresChunk, static_cast<int64_t>(s.size() - first));
      partial.push_back(chunk_by_lanes(s.data() + first, len));
    }
  std::vector<double> group;
  for (size_t first = 0; first < partial.size(); first += kSumSquaresGroup) {
    const int64_t len =
        std::min<int64_t>(kSumSquaresGroup, static_cast<int64_t>(partial.size() - first));
    group.push_back(by_lanes(len, [&](int64_t c) { return partial[first + c]; }));
  }
  return by_lanes(static_cast<int64_t>(group.size()), [&](int64_t g) { return group[g]; });
}

Segments<const float> segments_of(const std::vector<std::vector<float>>& segs) {
  Segments<const float> s;
  s.n = segs.empty() ? 0 : static_cast<int64_t>(segs[0].size());
  for (const std::vector<float>& v : segs) s.ptr.push_back(v.data());
  return s;
}

std::vector<std::vector<float>> rand_segments(int groups, size_t n, std::mt19937_64& rng) {
  std::vector<std::vector<float>> segs;
  for (int g = 0; g < groups; ++g) segs.push_back(rand_floats(n, rng));
  return segs;
}

TEST(SumSquares, ChunkR32OrderBitwise) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Case {
    int groups;
    size_t n;
  };
  // Below, at and above one lane round and one chunk; several chunks per segment; more than 32
  // chunks (the second tree's lanes loop); one whole group; more than one group.
  for (const Case& c : std::vector<Case>{{1, 1},
                                         {1, 31},
                                         {2, 33},
                                         {3, 100},
                                         {1, static_cast<size_t>(kSumSquaresChunk)},
                                         {2, static_cast<size_t>(kSumSquaresChunk) + 1},
                                         {3, 3 * static_cast<size_t>(kSumSquaresChunk) - 7},
                                         {2, 40 * static_cast<size_t>(kSumSquaresChunk) + 5},
                                         {1, static_cast<size_t>(kSumSquaresChunk * kSumSquaresGroup)},
                                         {2, static_cast<size_t>(kSumSquaresChunk *
                                                                 (kSumSquaresGroup + 40)) + 3}}) {
    const std::vector<std::vector<float>> segs = rand_segments(c.groups, c.n, rng);
    double got = -1.0;
    ASSERT_TRUE(sum_squares_cpu(segments_of(segs), &got).is_ok());
    const double want = by_chunks(segs);
    EXPECT_TRUE(same_bits(got, want))
        << "groups " << c.groups << " n " << c.n << ": " << got << " vs " << want;
  }
}

TEST(SumSquares, HandWrittenSmallCase) {
  // n = 34: lane 0 = 1^2 + 3^2 = 10, lane 1 = 2^2 + 4^2 = 20, lanes 2..31 = 0.5^2 each; the tree
  // adds exactly: 10 + 20 + 30 * 0.25 = 37.5.
  std::vector<float> x(34, 0.5f);
  x[0] = 1.0f, x[1] = 2.0f, x[32] = 3.0f, x[33] = 4.0f;
  Segments<const float> s;
  s.n = 34;
  s.ptr = {x.data()};
  double got = 0.0;
  ASSERT_TRUE(sum_squares_cpu(s, &got).is_ok());
  EXPECT_EQ(got, 37.5);
  // A second identical segment doubles it (the tree over the two chunk sums).
  s.ptr = {x.data(), x.data()};
  ASSERT_TRUE(sum_squares_cpu(s, &got).is_ok());
  EXPECT_EQ(got, 75.0);
}

TEST(SumSquares, CloseToLongDoubleOnLargeInputs) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int groups : {1, 4}) {
    const std::vector<std::vector<float>> segs = rand_segments(groups, 1'000'003, rng);
    long double want = 0.0L;
    for (const std::vector<float>& s : segs)
      for (float v : s) want += static_cast<long double>(v) * v;
    double got = 0.0;
    ASSERT_TRUE(sum_squares_cpu(segments_of(segs), &got).is_ok());
    EXPECT_LE(std::fabs(static_cast<long double>(got) - want), 1e-15L * want) << groups;
  }
}

TEST(SumSquares, EmptyInputsArePositiveZero) {
  double got = -1.0;
  Segments<const float> none;  // zero segments
  none.n = 100;
  ASSERT_TRUE(sum_squares_cpu(none, &got).is_ok());
  EXPECT_TRUE(same_bits(got, 0.0));
  const std::vector<float> x = {3.0f};
  Segments<const float> empty;  // segments of n = 0
  empty.ptr = {x.data(), x.data(), x.data()};
  empty.n = 0;
  got = -1.0;
  ASSERT_TRUE(sum_squares_cpu(empty, &got).is_ok());
  EXPECT_TRUE(same_bits(got, 0.0));
}

TEST(SumSquares, NegativeLengthIsAnError) {
  const std::vector<float> x = {1.0f};
  Segments<const float> s;
  s.ptr = {x.data()};
  s.n = -5;
  double got = 42.0;
  const Status st = ops::sum_squares(cpu_backend(), s, &got);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("sum_squares"), std::string::npos) << st.message();
  EXPECT_EQ(got, 42.0) << "nothing written on error";
}

// ---- AdamW grad_scale -------------------------------------------------------------------------

TEST(AdamWGradScale, EqualsUpdateOnScaledGradient) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    AdamWStepScalars s{};
    s.beta1 = 0.9f, s.beta2 = 0.999f, s.one_minus_beta1 = 1.0f - s.beta1;
    s.one_minus_beta2 = 1.0f - s.beta2, s.eps = 1e-8f;
    s.decay = 1.0f - 1e-4f * unit(rng);
    s.step_size = 1e-3f * (0.1f + unit(rng));
    s.sqrt_bias_correction2 = 0.05f + 0.95f * unit(rng);
    s.grad_scale = trial % 10 == 0 ? std::ldexp(unit(rng), -20) : unit(rng);  // clipping: < 1
    const float p0 = nd(rng), m0 = nd(rng) * 0.1f, v0 = std::fabs(nd(rng)) * 0.01f;
    const float g = nd(rng) * (trial % 7 == 0 ? 1e3f : 1.0f);

    float p1 = p0, m1 = m0, v1 = v0;
    adamw_update(p1, m1, v1, g, s);

    AdamWStepScalars unscaled = s;
    unscaled.grad_scale = 1.0f;
    float p2 = p0, m2 = m0, v2 = v0;
    const float scaled_g = g * s.grad_scale;  // one FP32 product
    adamw_update(p2, m2, v2, scaled_g, unscaled);

    ASSERT_EQ(f32_bits(p1), f32_bits(p2)) << "trial " << trial;
    ASSERT_EQ(f32_bits(m1), f32_bits(m2)) << "trial " << trial;
    ASSERT_EQ(f32_bits(v1), f32_bits(v2)) << "trial " << trial;
  }
}

TEST(AdamWGradScale, ScaleOneChangesNothingAndScaleMatters) {
  AdamWStepScalars s{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 1.0f, 1e-3f, 0.5f};
  EXPECT_EQ(s.grad_scale, 1.0f) << "default: no clipping";
  float p = 1.0f, m = 0.2f, v = 0.04f;
  adamw_update(p, m, v, 0.5f, s);
  float p_half = 1.0f, m_half = 0.2f, v_half = 0.04f;
  s.grad_scale = 0.5f;
  adamw_update(p_half, m_half, v_half, 0.5f, s);
  // m = 0.9 * 0.2 + 0.1 * g: g = 0.5 vs the clipped 0.25.
  EXPECT_EQ(m, 0.9f * 0.2f + 0.1f * 0.5f);
  EXPECT_EQ(m_half, 0.9f * 0.2f + 0.1f * 0.25f);
  EXPECT_NE(p, p_half);
}

// adamw's optional amax (AdamWArgs::amax) against the image it wrote, expert by expert, read back
// here: NaNs (from NaN gradients) never win, experts beyond the segment stay as they were, and it
// is a max with what the slot held (the caller's zero, here also a larger value already there).
TEST(AdamWImageAmax, EqualsTheMaxOfTheImagePerExpert) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  bool nan_seen = false;
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    const int64_t span = 1 + static_cast<int64_t>(rng() % 400);
    const int64_t first = static_cast<int64_t>(rng() % 1000);
    const int64_t experts = (first + n - 1) / span + 2;  // one past the segment's last
    std::vector<float> p(n), m(n), v(n), g(n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = nd(rng) * (rng() % 50 == 0 ? 100.0f : 1.0f);
      m[i] = nd(rng) * 0.01f, v[i] = std::fabs(nd(rng)) * 1e-4f, g[i] = nd(rng) * 0.01f;
      if (rng() % 97 == 0) g[i] = std::numeric_limits<float>::quiet_NaN();
    }
    std::vector<uint16_t> image(n);
    std::vector<float> amax(experts, 0.0f);
    const int64_t preset = static_cast<int64_t>(rng() % experts);
    amax[preset] = 7.0f;  // max with what is there
    AdamWArgs a;
    a.scalars = {0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 1.0f - 1e-4f, 1e-3f, 0.5f};
    a.param = one_segment(p.data(), n), a.exp_avg = one_segment(m.data(), n);
    a.exp_avg_sq = one_segment(v.data(), n), a.grad = one_segment<const float>(g.data(), n);
    a.bf16 = one_segment(image.data(), n);
    a.amax = amax.data(), a.amax_span = span, a.amax_first = first;
    ASSERT_TRUE(ops::adamw(cpu_backend(), a).is_ok());
    std::vector<float> want(experts, 0.0f);
    want[preset] = 7.0f;
    bool any_nan = false;
    for (int64_t i = 0; i < n; ++i) {
      const float x = std::fabs(bf16_to_f32(image[i]));
      any_nan |= std::isnan(x);
      float& w = want[(first + i) / span];
      if (!std::isnan(x) && x > w) w = x;
    }
    nan_seen |= any_nan;
    for (int64_t e = 0; e < experts; ++e)
      ASSERT_EQ(f32_bits(amax[e]), f32_bits(want[e])) << "expert " << e;
  }
  EXPECT_TRUE(nan_seen) << "seed " << seed << ": no NaN reached an image";
}

TEST(AdamWImageAmax, NeedsTheImageOneSegmentAndASpan) {
  std::vector<float> p(8), m(8), v(8, 1.0f), g(8), amax(2);
  std::vector<uint16_t> image(8);
  AdamWArgs a;
  a.param = one_segment(p.data(), 8), a.exp_avg = one_segment(m.data(), 8);
  a.exp_avg_sq = one_segment(v.data(), 8), a.grad = one_segment<const float>(g.data(), 8);
  a.amax = amax.data(), a.amax_span = 4;
  EXPECT_FALSE(ops::adamw(cpu_backend(), a).is_ok()) << "no image";
  a.bf16 = one_segment(image.data(), 8);
  a.amax_span = 0;
  EXPECT_FALSE(ops::adamw(cpu_backend(), a).is_ok()) << "no span";
  a.amax_span = 4;
  EXPECT_TRUE(ops::adamw(cpu_backend(), a).is_ok());
}

}  // namespace
}  // namespace packmoe
