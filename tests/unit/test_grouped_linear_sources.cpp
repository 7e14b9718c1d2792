// GroupedLinear with S x E token counts (S sources of the same E experts, source-major: what
// expert parallelism hands the expert MLP) against the same layer run source by source, as S
// data-parallel ranks would (forward, then backward accumulating into main_grad in source order):
// y and dx bitwise the concatenation of the per-source results, main_grad bitwise the rank-ordered
// sum, for BF16, MXFP8 and NVFP4 (its stochastic-rounding stream included), fused and unfused
// gradient accumulation. Fresh random inputs and counts (some groups empty) per run.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/grouped_linear.h"

namespace packmoe {
namespace {

constexpr int64_t kE = 3, kN = 32, kK = 64, kSources = 3;

struct Variant {
  Recipe recipe;
  bool fusion;
};

Tensor bf16_rows(Backend& b, std::mt19937& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor t = Tensor::empty(b, DType::kBF16, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<uint16_t>()[i] = f32_to_bf16(dist(rng));
  return t;
}

Tensor rows_of(Backend& b, const Tensor& t, int64_t first, int64_t count) {
  Tensor out = Tensor::empty(b, t.dtype(), {count, t.dim(1)});
  const size_t row = t.nbytes() / static_cast<size_t>(t.dim(0));
  b.copy(out.data(), static_cast<const uint8_t*>(t.data()) + first * row, count * row,
         Backend::CopyKind::kDeviceToDevice);
  return out;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

class GroupedLinearSources : public testing::TestWithParam<Variant> {};

TEST_P(GroupedLinearSources, EqualTheSourcesRunOneByOneAndSummedInOrder) {
  const Variant v = GetParam();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  Backend& b = cpu_backend();
  const int64_t align = token_alignment(v.recipe);
  std::vector<int64_t> m(kSources * kE);  // (S * E) source-major
  for (int64_t& c : m) c = align * static_cast<int64_t>(rng() % 3);  // 0, 1 or 2 blocks
  m[0] = align;  // source 0 has rows (it starts main_grad)
  m[1] = 0;
  m[kE + 1] = 2 * align;
  const int64_t M = std::accumulate(m.begin(), m.end(), int64_t{0});
  std::normal_distribution<float> wdist(0.0f, 0.1f);
  Tensor init = Tensor::empty(b, DType::kF32, {kE, kN, kK});
  for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = wdist(rng);
  const Tensor x = bf16_rows(b, rng, M, kK);
  const Tensor dy = bf16_rows(b, rng, M, kN);

  GroupedLinearConfig cfg;
  cfg.recipe = {v.recipe, false, seed};
  cfg.grad_accum_fusion = v.fusion;
  cfg.out_dtype = DType::kBF16;

  // All sources in one call.
  GroupedLinear together(b, cfg, init);
  together.set_grad_sr_offset(5);
  const std::vector<uint8_t> y_all = bytes_of(together.forward(x, m));
  const std::vector<uint8_t> dx_all = bytes_of(together.backward(dy, GradAccum::kOverwrite));

  // Source by source, as S ranks (micro-batches) in order.
  GroupedLinear alone(b, cfg, init);
  alone.set_grad_sr_offset(5);
  std::vector<uint8_t> y_each, dx_each;
  int64_t first = 0;
  for (int64_t s = 0; s < kSources; ++s) {
    const std::vector<int64_t> ms(m.begin() + s * kE, m.begin() + (s + 1) * kE);
    const int64_t rows = std::accumulate(ms.begin(), ms.end(), int64_t{0});
    if (rows > 0) {
      const std::vector<uint8_t> y = bytes_of(alone.forward(rows_of(b, x, first, rows), ms));
      const std::vector<uint8_t> dx = bytes_of(alone.backward(
          rows_of(b, dy, first, rows), s == 0 ? GradAccum::kOverwrite : GradAccum::kAccumulate));
      y_each.insert(y_each.end(), y.begin(), y.end());
      dx_each.insert(dx_each.end(), dx.begin(), dx.end());
    } else {
      ASSERT_NE(s, 0);
    }
    first += rows;
  }
  EXPECT_EQ(y_all, y_each);
  EXPECT_EQ(dx_all, dx_each);
  EXPECT_EQ(together.param().main_grad().download(), alone.param().main_grad().download());
  EXPECT_EQ(together.grad_sr_offset(), alone.grad_sr_offset());
}

INSTANTIATE_TEST_SUITE_P(Recipes, GroupedLinearSources,
                         testing::Values(Variant{Recipe::kBF16, true}, Variant{Recipe::kBF16, false},
                                         Variant{Recipe::kMxfp8, true},
                                         Variant{Recipe::kNvfp4, true},
                                         Variant{Recipe::kNvfp4, false}));

TEST(GroupedLinearSources, CountsThatAreNotAMultipleOfTheExpertsFail) {
  Backend& b = cpu_backend();
  GroupedLinearConfig cfg;
  Tensor init = Tensor::empty(b, DType::kF32, {kE, kN, kK});
  for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = 0.01f;
  GroupedLinear layer(b, cfg, init);
  std::mt19937 rng(1);
  const Tensor x = bf16_rows(b, rng, 4, kK);
  EXPECT_DEATH(layer.forward(x, {1, 1, 1, 1}), "multiple of the experts");
}

}  // namespace
}  // namespace packmoe
