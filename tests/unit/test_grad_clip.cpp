// Global grad-norm clipping and AdamW as the trainer runs it (DistOptimizer over one rank): the
// norm against an FP64 reference over fresh random gradients (segments longer than one
// sum_squares chunk, both layouts, bitwise equal between layouts), the clip coefficient of torch's
// clip_grad_norm_, a clipped step equal to scaling the gradient first, per-param weight decay
// against the documented formula, and restoring (step count, masters, moments) continuing a run
// bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "backend/backend.h"
#include "common/single_rank_optimizer.h"
#include "optim/grad_clip.h"

namespace packmoe {
namespace {

Tensor random_tensor(std::mt19937& rng, Shape shape, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
  return t;
}

// A BF16-recipe param (E, N, K), and a way to set its main_grad (CPU memory).
std::unique_ptr<GroupedParam> make_param(const Tensor& init, Layout layout) {
  return std::make_unique<GroupedParam>(cpu_backend(), QuantRecipe{}, PrimaryWeight::kLowPrecision,
                                        layout, init);
}

void set_grad(const GroupedParam& p, const std::vector<float>& g) {
  const GroupedStorage& s = p.main_grad();
  const size_t per = s.bytes_per_group() / sizeof(float);
  ASSERT_EQ(g.size(), per * static_cast<size_t>(s.groups()));
  for (int64_t e = 0; e < s.groups(); ++e)
    std::memcpy(s.group(e), g.data() + e * per, s.bytes_per_group());
}

std::vector<float> random_values(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(GradClip, NormMatchesFp64ReferenceAndLayoutsAgreeBitwise) {
  std::mt19937 rng(std::random_device{}());
  // Shapes: a scalar-like norm, a small matrix, experts whose groups exceed one 65536-element chunk.
  const std::vector<Shape> shapes = {{1, 1, 1}, {1, 7, 13}, {3, 300, 257}, {2, 64, 32}};
  std::vector<std::unique_ptr<GroupedParam>> single, discrete;
  long double ref = 0;
  for (const Shape& shape : shapes) {
    Tensor init = random_tensor(rng, shape, 0.02f);
    single.push_back(make_param(init, Layout::kSingle));
    discrete.push_back(make_param(init, Layout::kDiscrete));
    const std::vector<float> g =
        random_values(rng, static_cast<size_t>(shape[0] * shape[1] * shape[2]),
                      std::uniform_real_distribution<float>(1e-3f, 10.f)(rng));
    set_grad(*single.back(), g);
    set_grad(*discrete.back(), g);
    for (float x : g) ref += static_cast<long double>(x) * x;
  }
  std::vector<const GroupedStorage*> gs, gd;
  for (auto& p : single) gs.push_back(&p->main_grad());
  for (auto& p : discrete) gd.push_back(&p->main_grad());
  const double norm = global_grad_norm(cpu_backend(), gs);
  EXPECT_NEAR(norm, static_cast<double>(std::sqrt(ref)), 1e-12 * norm);
  const double norm_discrete = global_grad_norm(cpu_backend(), gd);
  EXPECT_EQ(std::memcmp(&norm, &norm_discrete, sizeof(double)), 0);
  EXPECT_EQ(global_grad_norm(cpu_backend(), {}), 0.0);
}

TEST(GradClip, CoefficientFollowsTorch) {
  // torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
  EXPECT_EQ(clip_coefficient(4.0, 1.0), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(0.0, 1.0), 1.0f);
  EXPECT_LT(clip_coefficient(1.0, 1.0), 1.0f);  // the 1e-6 makes norm == max_norm clip slightly
  EXPECT_EQ(clip_coefficient(1e9, 0.0), 1.0f);  // disabled
  EXPECT_EQ(clip_coefficient(1e9, -1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(INFINITY, 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(clip_coefficient(NAN, 1.0)));
}

// One step of a 1-rank optimizer whose params' main_grads are set to `grads` (in params order).
DistStepResult step_with(SingleRankOptimizer& opt, const std::vector<GroupedParam*>& params,
                         const std::vector<std::vector<float>>& grads, double max_norm = 0.0) {
  opt->prepare_forward();
  opt->prepare_backward();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i]->take_grad_write();  // this test writes the gradient, as a backward would
    set_grad(*params[i], grads[i]);
  }
  return opt->step(max_norm);
}

TEST(SingleRankAdamW, ClipScaleEqualsScalingTheGradientFirst) {
  std::mt19937 rng(std::random_device{}());
  const Shape shape = {3, 16, 32};
  Tensor init = random_tensor(rng, shape, 0.05f);
  auto scaled = make_param(init, Layout::kSingle);
  auto prescaled = make_param(init, Layout::kDiscrete);
  const AdamWConfig cfg{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  SingleRankOptimizer a(cpu_backend(), {{scaled.get(), true}}, cfg);
  SingleRankOptimizer b(cpu_backend(), {{prescaled.get(), true}}, cfg);
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = random_values(rng, 3 * 16 * 32, 2.0f);
    // A max norm below the norm: the step multiplies the gradient by its clip scale c < 1.
    const DistStepResult r = step_with(a, {scaled.get()}, {g}, /*max_norm=*/0.05);
    const float c = r.clip_scale;
    ASSERT_LT(c, 1.0f);
    std::vector<float> gc(g.size());
    for (size_t i = 0; i < g.size(); ++i) gc[i] = g[i] * c;  // one FP32 rounding, as adamw_update
    EXPECT_EQ(step_with(b, {prescaled.get()}, {gc}).clip_scale, 1.0f);
  }
  const FullOptimizerState sa = a->gather_state(), sb = b->gather_state();
  EXPECT_EQ(sa.master, sb.master);
  EXPECT_EQ(sa.exp_avg, sb.exp_avg);
  EXPECT_EQ(sa.exp_avg_sq, sb.exp_avg_sq);
}

TEST(SingleRankAdamW, WeightDecayOnlyWhereAskedAndLrFromSetLr) {
  std::mt19937 rng(std::random_device{}());
  const Shape shape = {1, 8, 16};
  Tensor init = random_tensor(rng, shape, 0.5f);
  auto decayed = make_param(init, Layout::kSingle);
  auto norm = make_param(init, Layout::kSingle);
  const AdamWConfig cfg{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  SingleRankOptimizer opt(cpu_backend(), {{decayed.get(), true}, {norm.get(), false}}, cfg);
  const std::vector<float> g = random_values(rng, 8 * 16, 1.0f);
  opt->set_lr(0.25f);
  step_with(opt, {decayed.get(), norm.get()}, {g, g});
  // Step 1 of the documented formula in FP64: m = (1-b1) g, v = (1-b2) g^2,
  // p = p0 (1 - lr wd) - lr / (1-b1) * m / (sqrt(v) / sqrt(1-b2) + eps); no decay for the norm.
  const std::vector<float> p0(init.data_as<float>(), init.data_as<float>() + init.numel());
  const std::vector<float> pd = opt.master(0), pn = opt.master(1);
  for (size_t i = 0; i < g.size(); ++i) {
    const double m = (1 - 0.9) * g[i], v = (1 - 0.95) * double(g[i]) * g[i];
    const double upd = 0.25 / (1 - 0.9) * m / (std::sqrt(v) / std::sqrt(1 - 0.95) + 1e-8);
    EXPECT_NEAR(pd[i], p0[i] * (1 - 0.25 * 0.1) - upd, 2e-6) << i;
    EXPECT_NEAR(pn[i], p0[i] - upd, 2e-6) << i;
  }
  EXPECT_EQ(opt->lr(), 0.25f);
  EXPECT_EQ(opt->steps(), 1);
}

TEST(SingleRankAdamW, RestoredStepCountAndMomentsContinueBitwise) {
  std::mt19937 rng(std::random_device{}());
  const Shape shape = {2, 16, 32};
  Tensor init = random_tensor(rng, shape, 0.05f);
  std::vector<std::vector<float>> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(random_values(rng, 2 * 16 * 32, 1.0f));
  const AdamWConfig cfg{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};

  auto straight = make_param(init, Layout::kSingle);
  SingleRankOptimizer a(cpu_backend(), {{straight.get(), true}}, cfg);
  for (const auto& g : grads) step_with(a, {straight.get()}, {g});

  auto first_param = make_param(init, Layout::kDiscrete);
  SingleRankOptimizer first(cpu_backend(), {{first_param.get(), true}}, cfg);
  for (int i = 0; i < 2; ++i) step_with(first, {first_param.get()}, {grads[i]});
  // A fresh model and optimizer (another init: the load replaces it) restored from the first
  // one's state.
  auto resumed = make_param(random_tensor(rng, shape, 0.05f), Layout::kDiscrete);
  SingleRankOptimizer second(cpu_backend(), {{resumed.get(), true}}, cfg);
  ASSERT_TRUE(second->load_state(first->gather_state()).is_ok());
  step_with(second, {resumed.get()}, {grads[2]});
  EXPECT_EQ(second->steps(), 3);
  const FullOptimizerState sa = a->gather_state(), sb = second->gather_state();
  EXPECT_EQ(sa.master, sb.master);
  EXPECT_EQ(sa.exp_avg_sq, sb.exp_avg_sq);
}

}  // namespace
}  // namespace packmoe
