// Single vs discrete layout of MoEBlock, bitwise: recipe {bf16, mxfp8, nvfp4} x primary weight
// {high, low} x grad-accum fusion {off, on} x delayed wgrad {off, on}. Two blocks with the same
// init and inputs train four AdamW steps (micro-batches that overwrite and accumulate, an eval
// forward, an expert starved of tokens, aux loss, norm_topk_prob); outputs, input gradients, every
// main_grad, master and primary-weight byte must be identical at every step.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/moe_block.h"
#include "optim/adamw.h"

namespace packmoe {
namespace {

constexpr int64_t kT = 64, kH = 64, kF = 32, kE = 4, kTopK = 2;
constexpr int64_t kStarved = 3;  // the expert that positive-mean inputs never route to

struct Case {
  Recipe recipe;
  PrimaryWeight primary;
  bool fusion;
  bool delay;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(recipe_name(c.recipe)) +
         (c.primary == PrimaryWeight::kHighPrecision ? "_highprec" : "_lowprec") +
         (c.fusion ? "_fused" : "_unfused") + (c.delay ? "_delayed" : "_direct");
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    for (PrimaryWeight p : {PrimaryWeight::kHighPrecision, PrimaryWeight::kLowPrecision})
      for (bool fusion : {false, true})
        for (bool delay : {false, true}) out.push_back({r, p, fusion, delay});
  return out;
}

std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

// F32 host tensor of N(mean, stddev) values with full FP32 mantissas.
Tensor random_f32(Shape shape, std::mt19937& rng, float mean, float stddev) {
  std::normal_distribution<float> dist(mean, stddev);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
  return t;
}

// (T, H) in `b`'s memory: BF16 or F32 values of N(mean, 1).
Tensor random_activation(Backend& b, std::mt19937& rng, DType dtype, float mean) {
  const Tensor f = random_f32({kT, kH}, rng, mean, 1.0f);
  if (dtype == DType::kF32) return b.to_device(f);
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, {kT, kH});
  for (int64_t i = 0; i < h.numel(); ++i)
    h.data_as<uint16_t>()[i] = f32_to_bf16(f.data_as<float>()[i]);
  return b.to_device(h);
}

// Router rows of N(0, 0.1); row kStarved is -0.1 + N(0, 0.05), so its logit is about
// -0.1 * sum_h x_h: far below the others when x has mean 1, comparable when x has mean 0.
MoEBlockInit make_init(std::mt19937& rng) {
  MoEBlockInit init{random_f32({kE, kH}, rng, 0.0f, 0.1f),
                    random_f32({kE, 2 * kF, kH}, rng, 0.0f, 0.1f),
                    random_f32({kE, kH, kF}, rng, 0.0f, 0.1f)};
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (int64_t h = 0; h < kH; ++h)
    init.router.data_as<float>()[kStarved * kH + h] = -0.1f + dist(rng);
  return init;
}

struct Microbatch {
  float x_mean;  // 1: expert kStarved gets no tokens; 0: every expert gets some
  GradAccum accum;
  DType dy_dtype;
};

struct Step {
  bool eval_forward_first;  // a forward with no backward, dropped by the next forward
  std::vector<Microbatch> micro;
};

// Steps whose first micro-batch accumulates start with zero_grad; the others overwrite.
const std::vector<Step> kPlan = {
    {false, {{0.0f, GradAccum::kAccumulate, DType::kF32}}},
    {false,
     {{1.0f, GradAccum::kOverwrite, DType::kBF16}, {0.0f, GradAccum::kAccumulate, DType::kF32}}},
    {true, {{1.0f, GradAccum::kAccumulate, DType::kBF16}}},
    {false,
     {{0.0f, GradAccum::kOverwrite, DType::kF32}, {1.0f, GradAccum::kAccumulate, DType::kBF16}}},
};

class MoEBlockParity : public testing::TestWithParam<Case> {};

TEST_P(MoEBlockParity, SingleEqualsDiscreteBitwiseOverFourSteps) {
  const Case& c = GetParam();
  Backend& b = cpu_backend();
  std::mt19937 rng(4321);
  const MoEBlockInit init = make_init(rng);

  MoEBlockConfig cfg;
  cfg.top_k = kTopK;
  cfg.norm_topk_prob = true;
  cfg.aux_loss_coef = 1e-2f;
  cfg.recipe = {c.recipe, false, /*sr_seed=*/99};
  cfg.primary = c.primary;
  cfg.grad_accum_fusion = c.fusion;
  cfg.delay_wgrad = c.delay;
  MoEBlockConfig single_cfg = cfg, discrete_cfg = cfg;
  single_cfg.layout = Layout::kSingle;
  discrete_cfg.layout = Layout::kDiscrete;
  MoEBlock single(b, single_cfg, init);
  MoEBlock discrete(b, discrete_cfg, init);
  MoEBlock* blocks[] = {&single, &discrete};

  const AdamWConfig opt_cfg{/*lr=*/1e-2f, 0.9f, 0.999f, 1e-8f, /*weight_decay=*/0.1f};
  AdamW opt_single(opt_cfg), opt_discrete(opt_cfg);
  for (MoEBlock* blk : blocks) blk->create_masters();
  for (GroupedParam* p : single.params()) opt_single.add(*p);
  for (GroupedParam* p : discrete.params()) opt_discrete.add(*p);

  const char* names[] = {"router", "fc1", "fc2"};
  auto expect_same_params = [&](const std::string& when, bool grads) {
    const std::vector<GroupedParam*> s = single.params(), d = discrete.params();
    for (size_t i = 0; i < s.size(); ++i) {
      const auto a = s[i]->weight_components(), e = d[i]->weight_components();
      ASSERT_EQ(a.size(), e.size());
      for (size_t j = 0; j < a.size(); ++j)
        EXPECT_TRUE(a[j].storage->download() == e[j].storage->download())
            << when << ": " << names[i] << " weight component " << a[j].name << " differs";
      EXPECT_TRUE(s[i]->master().download() == d[i]->master().download())
          << when << ": " << names[i] << " master differs";
      if (grads) {
        EXPECT_TRUE(s[i]->main_grad().download() == d[i]->main_grad().download())
            << when << ": " << names[i] << " main_grad differs";
      }
    }
  };
  expect_same_params("after create_masters", true);

  auto masters = [&] {
    std::vector<std::vector<uint8_t>> out;
    for (GroupedParam* p : single.params()) out.push_back(p->master().download());
    return out;
  };
  std::vector<std::vector<uint8_t>> previous = masters();
  for (size_t step = 0; step < kPlan.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (kPlan[step].eval_forward_first) {
      const Tensor x = random_activation(b, rng, DType::kBF16, 0.0f);
      EXPECT_TRUE(bytes_of(b, single.forward(x)) == bytes_of(b, discrete.forward(x))) << "eval y";
    }
    if (kPlan[step].micro[0].accum == GradAccum::kAccumulate)
      for (MoEBlock* blk : blocks) blk->zero_grad();
    for (size_t mb = 0; mb < kPlan[step].micro.size(); ++mb) {
      SCOPED_TRACE("micro-batch " + std::to_string(mb));
      const Microbatch& micro = kPlan[step].micro[mb];
      const Tensor x = random_activation(b, rng, DType::kBF16, micro.x_mean);  // (T, H)
      const Tensor dy = random_activation(b, rng, micro.dy_dtype, 0.0f);       // (T, H)
      const Tensor y_s = single.forward(x);
      const Tensor y_d = discrete.forward(x);
      EXPECT_TRUE(bytes_of(b, y_s) == bytes_of(b, y_d)) << "y differs";
      EXPECT_EQ(single.aux_loss(), discrete.aux_loss());
      const std::vector<int64_t>& counts = single.plan().counts;
      EXPECT_EQ(counts, discrete.plan().counts);
      // The routing covers what the plan promises: a starved expert, or every expert busy.
      for (int64_t e = 0; e < kE; ++e)
        EXPECT_EQ(counts[e] == 0, micro.x_mean != 0.0f && e == kStarved) << "expert " << e;
      const Tensor dx_s = single.backward(dy, micro.accum);
      const Tensor dx_d = discrete.backward(dy, micro.accum);
      EXPECT_TRUE(bytes_of(b, dx_s) == bytes_of(b, dx_d)) << "dx differs";
      for (MoEBlock* blk : blocks) {
        EXPECT_EQ(blk->state(), c.delay ? BlockState::kWgradPending : BlockState::kIdle);
        if (c.delay) blk->backward_dw();
        EXPECT_EQ(blk->state(), BlockState::kIdle);
      }
      expect_same_params("after backward", true);
    }
    opt_single.step();
    opt_discrete.step();
    expect_same_params("after the optimizer step", false);
    // Every param trains: the update reached each master (the "weights never change" bug).
    const std::vector<std::vector<uint8_t>> now = masters();
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_FALSE(now[i] == previous[i])
          << "the optimizer step left the " << names[i] << " master unchanged";
    previous = now;
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, MoEBlockParity, testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace packmoe
