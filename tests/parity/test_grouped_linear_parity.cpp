// Single vs discrete layout of GroupedLinear, bitwise: recipe {bf16, mxfp8, mxfp8 2D weights,
// nvfp4} x primary weight {high, low} x grad-accum fusion {off, on} x delayed wgrad {off, on}.
// Two layers with the same init and inputs train four steps (micro-batches with overwrite and
// accumulate, experts with zero tokens, AdamW on a 1-rank DistOptimizer, re-quantization); outputs,
// input grads, main_grads, masters and every primary-weight byte must be identical at every step
// (Megatron accepts 2e-2).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/single_rank_optimizer.h"
#include "core/codecs.h"
#include "nn/grouped_linear.h"

namespace packmoe {
namespace {

constexpr int64_t kE = 4, kN = 64, kK = 32;

struct Case {
  Recipe recipe;
  bool mxfp8_2d;
  PrimaryWeight primary;
  bool fusion;
  bool delay;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(recipe_name(c.recipe)) + (c.mxfp8_2d ? "_2d" : "") +
         (c.primary == PrimaryWeight::kHighPrecision ? "_highprec" : "_lowprec") +
         (c.fusion ? "_fused" : "_unfused") + (c.delay ? "_delayed" : "_direct");
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  const std::pair<Recipe, bool> recipes[] = {
      {Recipe::kBF16, false}, {Recipe::kMxfp8, false}, {Recipe::kMxfp8, true}, {Recipe::kNvfp4, false}};
  for (auto [r, two_d] : recipes)
    for (PrimaryWeight p : {PrimaryWeight::kHighPrecision, PrimaryWeight::kLowPrecision})
      for (bool fusion : {false, true})
        for (bool delay : {false, true}) out.push_back({r, two_d, p, fusion, delay});
  return out;
}

// Host bytes of a tensor in `b`'s memory.
std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

// (rows, cols) BF16 in `b`'s memory; the rows of group g are scaled by 4^g so every expert has
// its own amax (NVFP4 per-group scales differ).
Tensor random_bf16(Backend& b, std::mt19937& rng, const std::vector<int64_t>& m, int64_t cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  int64_t rows = 0;
  for (int64_t mg : m) rows += mg;
  std::vector<uint16_t> h(rows * cols);
  size_t i = 0;
  for (size_t g = 0; g < m.size(); ++g)
    for (int64_t r = 0; r < m[g] * cols; ++r) h[i++] = f32_to_bf16(dist(rng) * float(1 << (2 * g)));
  Tensor t = Tensor::empty(b, DType::kBF16, {rows, cols});
  if (t.nbytes()) b.copy(t.data(), h.data(), t.nbytes(), Backend::CopyKind::kHostToDevice);
  return t;
}

struct Microbatch {
  std::vector<int64_t> m;  // (E,) tokens, multiples of 32 (every recipe's alignment)
  GradAccum accum;
};

// Four optimizer steps. Each starts from the optimizer's zeroed gradients; a first micro-batch that
// overwrites them never reads the zeros. Empty experts appear in every step, and each expert is empty in some micro-batch.
const std::vector<std::vector<Microbatch>> kPlan = {
    {{{32, 0, 64, 32}, GradAccum::kAccumulate}},
    {{{64, 32, 0, 0}, GradAccum::kOverwrite}, {{0, 32, 32, 64}, GradAccum::kAccumulate}},
    {{{0, 96, 32, 32}, GradAccum::kAccumulate}},
    {{{32, 32, 32, 32}, GradAccum::kOverwrite}, {{0, 0, 0, 64}, GradAccum::kAccumulate}},
};

class GroupedLinearParity : public testing::TestWithParam<Case> {};

TEST_P(GroupedLinearParity, SingleEqualsDiscreteBitwiseOverFourSteps) {
  const Case& c = GetParam();
  Backend& b = cpu_backend();

  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  Tensor init = Tensor::empty(b, DType::kF32, {kE, kN, kK});  // (E, N, K)
  for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = dist(rng) * float(1 + i % 7);

  GroupedLinearConfig cfg;
  cfg.recipe = {c.recipe, c.mxfp8_2d, /*sr_seed=*/777};
  cfg.primary = c.primary;
  cfg.grad_accum_fusion = c.fusion;
  cfg.delay_wgrad = c.delay;
  cfg.out_dtype = DType::kBF16;
  GroupedLinearConfig single_cfg = cfg, discrete_cfg = cfg;
  single_cfg.layout = Layout::kSingle;
  discrete_cfg.layout = Layout::kDiscrete;
  GroupedLinear single(b, single_cfg, init);
  GroupedLinear discrete(b, discrete_cfg, init);
  GroupedLinear* layers[] = {&single, &discrete};

  const AdamWConfig opt_cfg{/*lr=*/1e-2f, 0.9f, 0.999f, 1e-8f, /*weight_decay=*/0.1f};
  SingleRankOptimizer opt_single(b, {{&single.param(), true}}, opt_cfg);
  SingleRankOptimizer opt_discrete(b, {{&discrete.param(), true}}, opt_cfg);
  SingleRankOptimizer* opts[] = {&opt_single, &opt_discrete};

  // masters: between steps only (the optimizer's state is whole there).
  auto expect_same_weights = [&](const std::string& when, bool masters = true) {
    const auto a = single.param().weight_components();
    const auto d = discrete.param().weight_components();
    ASSERT_EQ(a.size(), d.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(a[i].storage->download() == d[i].storage->download())
          << when << ": primary/compute weight component " << a[i].name << " differs";
    if (masters) {
      EXPECT_TRUE(opt_single.master_bytes(0) == opt_discrete.master_bytes(0))
          << when << ": master differs";
    }
  };
  for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();
  expect_same_weights("after the optimizer took the init");

  std::vector<uint8_t> previous_master = opt_single.master_bytes(0);
  for (size_t step = 0; step < kPlan.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();  // the gather, zeroed grads
    for (size_t mb = 0; mb < kPlan[step].size(); ++mb) {
      SCOPED_TRACE("micro-batch " + std::to_string(mb));
      const Microbatch& micro = kPlan[step][mb];
      const Tensor x = random_bf16(b, rng, micro.m, kK);   // (M, K)
      const Tensor dy = random_bf16(b, rng, micro.m, kN);  // (M, N)
      const Tensor y_s = single.forward(x, micro.m);
      const Tensor y_d = discrete.forward(x, micro.m);
      EXPECT_TRUE(bytes_of(b, y_s) == bytes_of(b, y_d)) << "y differs";
      expect_same_weights("after forward", false);
      for (SingleRankOptimizer* o : opts) (*o)->prepare_backward();
      const Tensor dx_s = single.backward(dy, micro.accum);
      const Tensor dx_d = discrete.backward(dy, micro.accum);
      EXPECT_TRUE(bytes_of(b, dx_s) == bytes_of(b, dx_d)) << "dx differs";
      if (c.delay)
        for (GroupedLinear* l : layers) {
          EXPECT_EQ(l->state(), LinearState::kWgradPending);
          l->backward_dw();
        }
      for (GroupedLinear* l : layers) EXPECT_EQ(l->state(), LinearState::kIdle);
      EXPECT_TRUE(single.param().main_grad().download() == discrete.param().main_grad().download())
          << "main_grad differs";
    }
    for (SingleRankOptimizer* o : opts) (*o)->step();
    for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();
    expect_same_weights("after the optimizer step");
    // The experts train: the update reached the master (the "weights never change" bug).
    const std::vector<uint8_t> master = opt_single.master_bytes(0);
    EXPECT_FALSE(master == previous_master) << "the optimizer step left the master unchanged";
    previous_master = master;
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, GroupedLinearParity, testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace packmoe
