// Shared MoEBlock test harness (header-only): the single-vs-discrete layout parity matrix, block
// construction from a seed, the four-step training plan (AdamW on a 1-rank DistOptimizer per
// block) and the bytewise comparison of
// outputs, main_grads, masters and weight components. Used by tests/parity/test_moe_block_parity.cpp
// (CPU backend) and tests/cuda/test_cuda_moe_block.cpp (CUDA backend); the Backend is a parameter.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/single_rank_optimizer.h"
#include "core/codecs.h"
#include "nn/moe_block.h"

namespace packmoe::testing {

inline constexpr int64_t kT = 64, kH = 64, kF = 32, kE = 4, kTopK = 2;
inline constexpr int64_t kStarved = 3;  // the expert that positive-mean inputs never route to
inline constexpr const char* kParamNames[] = {"router", "fc1", "fc2"};

inline std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

// F32 host tensor of N(mean, stddev) with full FP32 mantissas; `bf16_exact` rounds every value
// to a BF16-representable one.
inline Tensor random_f32(Shape shape, std::mt19937& rng, float mean, float stddev,
                         bool bf16_exact = false) {
  std::normal_distribution<float> dist(mean, stddev);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = dist(rng);
    t.data_as<float>()[i] = bf16_exact ? bf16_to_f32(f32_to_bf16(v)) : v;
  }
  return t;
}

inline Tensor to_bf16(const Tensor& f32) {
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, f32.shape());
  for (int64_t i = 0; i < h.numel(); ++i)
    h.data_as<uint16_t>()[i] = f32_to_bf16(f32.data_as<float>()[i]);
  return h;
}

// (T, H) in `b`'s memory: BF16 or F32 values of N(mean, 1).
inline Tensor random_activation(Backend& b, std::mt19937& rng, DType dtype, float mean) {
  const Tensor f = random_f32({kT, kH}, rng, mean, 1.0f);
  return b.to_device(dtype == DType::kF32 ? f : to_bf16(f));
}

// ---- the case matrix --------------------------------------------------------------------------

struct Case {
  Recipe recipe;
  PrimaryWeight primary;
  bool fusion;
  bool delay;
};

inline std::string case_text(const Case& c) {
  return std::string(recipe_name(c.recipe)) +
         (c.primary == PrimaryWeight::kHighPrecision ? "_highprec" : "_lowprec") +
         (c.fusion ? "_fused" : "_unfused") + (c.delay ? "_delayed" : "_direct");
}

inline std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return case_text(info.param);
}

// recipe {bf16, mxfp8, nvfp4} x primary weight {high, low} x fusion {off, on} x delay {off, on}.
inline std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    for (PrimaryWeight p : {PrimaryWeight::kHighPrecision, PrimaryWeight::kLowPrecision})
      for (bool fusion : {false, true})
        for (bool delay : {false, true}) out.push_back({r, p, fusion, delay});
  return out;
}

// ---- block construction and the training plan -------------------------------------------------

// Router rows of N(0, 0.1); row kStarved is -0.1 + N(0, 0.05), so its logit is about
// -0.1 * sum_h x_h: far below the others when x has mean 1, comparable when x has mean 0.
inline MoEBlockInit make_parity_init(std::mt19937& rng) {
  MoEBlockInit init{random_f32({kE, kH}, rng, 0.0f, 0.1f),
                    random_f32({kE, 2 * kF, kH}, rng, 0.0f, 0.1f),
                    random_f32({kE, kH, kF}, rng, 0.0f, 0.1f)};
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (int64_t h = 0; h < kH; ++h)
    init.router.data_as<float>()[kStarved * kH + h] = -0.1f + dist(rng);
  return init;
}

// The parity block's config for case `c` in `layout`.
inline MoEBlockConfig parity_config(const Case& c, Layout layout) {
  MoEBlockConfig cfg;
  cfg.top_k = kTopK;
  cfg.norm_topk_prob = true;
  cfg.aux_loss_coef = 1e-2f;
  cfg.recipe = {c.recipe, false, /*sr_seed=*/99};
  cfg.primary = c.primary;
  cfg.grad_accum_fusion = c.fusion;
  cfg.delay_wgrad = c.delay;
  cfg.layout = layout;
  return cfg;
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

// Each step starts from the optimizer's zeroed gradients; a first micro-batch that overwrites them
// never reads the zeros.
inline const std::vector<Step> kPlan = {
    {false, {{0.0f, GradAccum::kAccumulate, DType::kF32}}},
    {false,
     {{1.0f, GradAccum::kOverwrite, DType::kBF16}, {0.0f, GradAccum::kAccumulate, DType::kF32}}},
    {true, {{1.0f, GradAccum::kAccumulate, DType::kBF16}}},
    {false,
     {{0.0f, GradAccum::kOverwrite, DType::kF32}, {1.0f, GradAccum::kAccumulate, DType::kBF16}}},
};

// ---- the parity run ---------------------------------------------------------------------------

// Bytewise: every weight component, (with `grads`) main_grad and (with the blocks' optimizers,
// between steps) master of `single` equals `discrete`'s. With `resident`, the storages must also
// live in that device's memory.
inline void expect_same_params(MoEBlock& single, MoEBlock& discrete, const std::string& when,
                               bool grads, std::optional<Device> resident,
                               SingleRankOptimizer* opt_s = nullptr,
                               SingleRankOptimizer* opt_d = nullptr) {
  const std::vector<GroupedParam*> s = single.params(), d = discrete.params();
  for (size_t i = 0; i < s.size(); ++i) {
    const auto a = s[i]->weight_components(), e = d[i]->weight_components();
    if (resident) {
      ASSERT_EQ(s[i]->main_grad().memory().device(), *resident);
      ASSERT_EQ(e.at(0).storage->memory().device(), *resident);
    }
    ASSERT_EQ(a.size(), e.size());
    for (size_t j = 0; j < a.size(); ++j)
      EXPECT_TRUE(a[j].storage->download() == e[j].storage->download())
          << when << ": " << kParamNames[i] << " weight component " << a[j].name << " differs";
    if (opt_s && opt_d) {
      EXPECT_TRUE(opt_s->master_bytes(static_cast<int>(i)) ==
                  opt_d->master_bytes(static_cast<int>(i)))
          << when << ": " << kParamNames[i] << " master differs";
    }
    if (grads) {
      EXPECT_TRUE(s[i]->main_grad().download() == d[i]->main_grad().download())
          << when << ": " << kParamNames[i] << " main_grad differs";
    }
  }
}

inline std::vector<std::vector<uint8_t>> masters_of(SingleRankOptimizer& opt) {
  std::vector<std::vector<uint8_t>> out;
  for (int p = 0; p < 3; ++p) out.push_back(opt.master_bytes(p));
  return out;
}

// What run_layout_parity got through: `steps` training steps; `finished` once the whole plan ran
// (false when a fatal assertion cut it short).
struct ParityRun {
  int steps = 0;
  bool finished = false;
};

// A single-layout and a discrete-layout block with the same init (seed 4321) and inputs, on `b`,
// train the four steps of kPlan, each under its own 1-rank DistOptimizer; y, dx, aux loss, routing, main_grads, masters and
// weight components must be bitwise identical at every step, and every master must move at every
// step. With `resident`, the inputs, outputs and param storages must live in that device's memory.
inline void run_layout_parity(Backend& b, const Case& c, std::optional<Device> resident,
                              ParityRun* run) {
  std::mt19937 rng(4321);
  const MoEBlockInit init = make_parity_init(rng);  // host F32: each param keeps its own copy
  MoEBlock single(b, parity_config(c, Layout::kSingle), init);
  MoEBlock discrete(b, parity_config(c, Layout::kDiscrete), init);
  MoEBlock* blocks[] = {&single, &discrete};

  const AdamWConfig opt_cfg{/*lr=*/1e-2f, 0.9f, 0.999f, 1e-8f, /*weight_decay=*/0.1f};
  SingleRankOptimizer opt_single(b, decayed_params(single.params()), opt_cfg);
  SingleRankOptimizer opt_discrete(b, decayed_params(discrete.params()), opt_cfg);
  SingleRankOptimizer* opts[] = {&opt_single, &opt_discrete};
  for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();

  expect_same_params(single, discrete, "after the optimizers took the init", true, resident,
                     &opt_single, &opt_discrete);

  std::vector<std::vector<uint8_t>> previous = masters_of(opt_single);
  for (size_t step = 0; step < kPlan.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();  // the gather, zeroed grads
    if (kPlan[step].eval_forward_first) {
      const Tensor x = random_activation(b, rng, DType::kBF16, 0.0f);
      EXPECT_TRUE(bytes_of(b, single.forward(x)) == bytes_of(b, discrete.forward(x))) << "eval y";
    }
    for (size_t mb = 0; mb < kPlan[step].micro.size(); ++mb) {
      SCOPED_TRACE("micro-batch " + std::to_string(mb));
      const Microbatch& micro = kPlan[step].micro[mb];
      const Tensor x = random_activation(b, rng, DType::kBF16, micro.x_mean);  // (T, H)
      const Tensor dy = random_activation(b, rng, micro.dy_dtype, 0.0f);       // (T, H)
      if (resident) {
        ASSERT_EQ(x.device(), *resident);
      }
      const Tensor y_s = single.forward(x);
      const Tensor y_d = discrete.forward(x);
      if (resident) {
        ASSERT_EQ(y_s.device(), *resident);
      }
      EXPECT_TRUE(bytes_of(b, y_s) == bytes_of(b, y_d)) << "y differs";
      EXPECT_EQ(single.aux_loss(), discrete.aux_loss());
      const std::vector<int64_t>& counts = single.plan().counts;
      EXPECT_EQ(counts, discrete.plan().counts);
      // The routing covers what the plan promises: a starved expert, or every expert busy.
      for (int64_t e = 0; e < kE; ++e)
        EXPECT_EQ(counts[e] == 0, micro.x_mean != 0.0f && e == kStarved) << "expert " << e;
      for (SingleRankOptimizer* o : opts) (*o)->prepare_backward();
      const Tensor dx_s = single.backward(dy, micro.accum);
      const Tensor dx_d = discrete.backward(dy, micro.accum);
      EXPECT_TRUE(bytes_of(b, dx_s) == bytes_of(b, dx_d)) << "dx differs";
      for (MoEBlock* blk : blocks) {
        EXPECT_EQ(blk->state(), c.delay ? BlockState::kWgradPending : BlockState::kIdle);
        if (c.delay) blk->backward_dw();
        EXPECT_EQ(blk->state(), BlockState::kIdle);
      }
      expect_same_params(single, discrete, "after backward", true, resident);
    }
    for (SingleRankOptimizer* o : opts) (*o)->step();
    for (SingleRankOptimizer* o : opts) (*o)->prepare_forward();
    expect_same_params(single, discrete, "after the optimizer step", false, resident, &opt_single,
                       &opt_discrete);
    // Every param trains: the update reached each master (the "weights never change" bug).
    const std::vector<std::vector<uint8_t>> now = masters_of(opt_single);
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_FALSE(now[i] == previous[i])
          << "the optimizer step left the " << kParamNames[i] << " master unchanged";
    previous = now;
    ++run->steps;
  }
  run->finished = true;
}

}  // namespace packmoe::testing
