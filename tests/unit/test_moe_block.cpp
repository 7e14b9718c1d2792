// MoEBlock units: the optimizer's masters are the FP32 init's bytes in every recipe; every expert's gradient
// reaches its slice of the packed main_grad (and a starved expert's slice stays zero); the BF16
// block's dx and router-weight gradient against FP64 central finite differences of an FP64
// re-implementation of the whole block written here; checked state ordering (death tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/single_rank_optimizer.h"
#include "core/codecs.h"
#include "nn/moe_block.h"

namespace packmoe {
namespace {

struct RecipeCase {
  const char* name;
  QuantRecipe recipe;
};
const RecipeCase kRecipes[] = {{"bf16", {Recipe::kBF16, false, 3}},
                               {"mxfp8", {Recipe::kMxfp8, false, 3}},
                               {"mxfp8_2d", {Recipe::kMxfp8, true, 3}},
                               {"nvfp4", {Recipe::kNvfp4, false, 3}}};

std::vector<uint8_t> host_bytes(const Tensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

std::vector<float> floats_of(Backend& b, const Tensor& t) {
  PACKMOE_CHECK(t.dtype() == DType::kF32, "F32 expected");
  std::vector<float> h(t.numel());
  b.copy(h.data(), t.data(), t.nbytes(), Backend::CopyKind::kDeviceToHost);
  return h;
}

// F32 host tensor of N(mean, stddev); `bf16_exact` rounds every value to a BF16-representable one.
Tensor random_f32(Shape shape, std::mt19937& rng, float mean, float stddev,
                  bool bf16_exact = false) {
  std::normal_distribution<float> dist(mean, stddev);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = dist(rng);
    t.data_as<float>()[i] = bf16_exact ? bf16_to_f32(f32_to_bf16(v)) : v;
  }
  return t;
}

Tensor to_bf16(const Tensor& f32) {
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, f32.shape());
  for (int64_t i = 0; i < h.numel(); ++i)
    h.data_as<uint16_t>()[i] = f32_to_bf16(f32.data_as<float>()[i]);
  return h;
}

// ---- masters are the init's bytes ---------------------------------------------------------------

TEST(MoEBlock, MastersEqualTheOriginalInitBytesInEveryRecipe) {
  constexpr int64_t T = 64, H = 64, F = 32, E = 4;
  Backend& b = cpu_backend();
  std::mt19937 rng(11);
  const MoEBlockInit init{random_f32({E, H}, rng, 0.0f, 0.1f),
                          random_f32({E, 2 * F, H}, rng, 0.0f, 0.1f),
                          random_f32({E, H, F}, rng, 0.0f, 0.1f)};
  // Full FP32 mantissas: a master made from the BF16 or dequantized weight would differ.
  const Tensor* inits[] = {&init.router, &init.fc1, &init.fc2};
  for (const Tensor* t : inits)
    ASSERT_FALSE(host_bytes(*t) == host_bytes(to_bf16(*t).reshaped(t->shape())));
  const Tensor x = b.to_device(to_bf16(random_f32({T, H}, rng, 0.0f, 1.0f)));
  const Tensor dy = b.to_device(random_f32({T, H}, rng, 0.0f, 1.0f));
  for (const RecipeCase& r : kRecipes)
    for (PrimaryWeight p : {PrimaryWeight::kHighPrecision, PrimaryWeight::kLowPrecision})
      for (Layout l : {Layout::kSingle, Layout::kDiscrete}) {
        SCOPED_TRACE(std::string(r.name) + (p == PrimaryWeight::kHighPrecision ? " high" : " low") +
                     (l == Layout::kSingle ? " single" : " discrete"));
        MoEBlockConfig cfg;
        cfg.recipe = r.recipe;
        cfg.primary = p;
        cfg.layout = l;
        MoEBlock block(b, cfg, init);
        // A training micro-batch before the optimizer exists must not disturb the held init.
        block.forward(x);
        block.backward(dy, GradAccum::kOverwrite);
        SingleRankOptimizer opt(b, decayed_params(block.params()), AdamWConfig{});
        for (int i = 0; i < 3; ++i)
          EXPECT_TRUE(opt.master_bytes(i) == host_bytes(*inits[i])) << "param " << i;
      }
}

// ---- every expert's gradient reaches its slice of main_grad ------------------------------------

// Per expert: does its slice of the packed main_grad hold any non-zero value?
std::vector<bool> nonzero_slices(const GroupedParam& p) {
  const std::vector<uint8_t> g = p.main_grad().download();
  const size_t slice = p.n() * p.k() * sizeof(float);
  std::vector<bool> out;
  for (int64_t e = 0; e < p.experts(); ++e) {
    bool any = false;
    for (size_t i = 0; i < slice; i += sizeof(float)) {
      float v;
      std::memcpy(&v, g.data() + e * slice + i, sizeof v);
      any = any || v != 0.0f;
    }
    out.push_back(any);
  }
  return out;
}

TEST(MoEBlock, EveryExpertsGradientReachesItsSliceOfMainGrad) {
  constexpr int64_t T = 64, H = 64, F = 32, E = 4, kStarved = 2;
  Backend& b = cpu_backend();
  std::mt19937 rng(12);
  MoEBlockInit init{random_f32({E, H}, rng, 0.0f, 0.1f), random_f32({E, 2 * F, H}, rng, 0.0f, 0.1f),
                    random_f32({E, H, F}, rng, 0.0f, 0.1f)};
  // Router row kStarved = -0.1 + N(0, 0.05): for inputs of mean 1 its logit is about
  // -0.1 * H = -6.4, far below the others (|logit| ~ 1), so expert kStarved gets no tokens; for
  // mean-0 inputs its logit is like the others' and it gets its share.
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (int64_t h = 0; h < H; ++h)
    init.router.data_as<float>()[kStarved * H + h] = -0.1f + dist(rng);
  const Tensor x_starve = b.to_device(to_bf16(random_f32({T, H}, rng, 1.0f, 1.0f)));
  const Tensor x_all = b.to_device(to_bf16(random_f32({T, H}, rng, 0.0f, 1.0f)));
  const Tensor dy = b.to_device(random_f32({T, H}, rng, 0.0f, 1.0f));
  std::vector<bool> starved(E, true), busy(E, true);
  starved[kStarved] = false;

  for (const RecipeCase& r : kRecipes)
    for (Layout l : {Layout::kSingle, Layout::kDiscrete})
      for (bool fusion : {false, true})
        for (bool delay : {false, true}) {
          SCOPED_TRACE(std::string(r.name) + (l == Layout::kSingle ? " single" : " discrete") +
                       (fusion ? " fused" : " unfused") + (delay ? " delayed" : ""));
          MoEBlockConfig cfg;
          cfg.recipe = r.recipe;
          cfg.primary = PrimaryWeight::kLowPrecision;
          cfg.layout = l;
          cfg.grad_accum_fusion = fusion;
          cfg.delay_wgrad = delay;
          cfg.aux_loss_coef = 1e-2f;
          MoEBlock block(b, cfg, init);
          auto micro_batch = [&](const Tensor& x, GradAccum accum) {
            block.forward(x);
            block.backward(dy, accum);
            if (delay) block.backward_dw();
            std::vector<bool> routed;
            for (int64_t c : block.plan().counts) routed.push_back(c > 0);
            return routed;
          };
          auto expect_slices = [&](const std::vector<bool>& expected, const char* when) {
            EXPECT_EQ(nonzero_slices(block.fc1().param()), expected) << when << ": fc1";
            EXPECT_EQ(nonzero_slices(block.fc2().param()), expected) << when << ": fc2";
            EXPECT_EQ(nonzero_slices(block.router().param()), std::vector<bool>{true})
                << when << ": router";
          };
          // Accumulating after zero_grad: the starved expert's slices stay zero.
          block.zero_grad();
          ASSERT_EQ(micro_batch(x_starve, GradAccum::kAccumulate), starved);
          expect_slices(starved, "accumulate, one expert starved");
          // Every expert gets tokens: every slice is reached.
          ASSERT_EQ(micro_batch(x_all, GradAccum::kAccumulate), busy);
          expect_slices(busy, "accumulate, every expert busy");
          // Overwrite over a dirty main_grad: the starved expert's slices become zero again.
          ASSERT_EQ(micro_batch(x_starve, GradAccum::kOverwrite), starved);
          expect_slices(starved, "overwrite, one expert starved");
        }
}

// ---- backward against FP64 finite differences ---------------------------------------------------

constexpr int64_t kT = 16, kH = 32, kF = 16, kE = 4, kK = 2;
// Central differences err by h^2/6 |L'''| ~ 1e-9 (every third derivative is O(1) for O(1) inputs)
// plus eps64 |L| / h ~ 1e-11: far below the tolerances below.
constexpr double kStep = 1e-4;
// The top-k boundary logit gap every token keeps: the FD step moves a logit by < 1e-3, the FP32
// router GEMM by ~1e-6, so the block, the FP64 model and every perturbation select the same
// experts.
constexpr double kMinGap = 0.1;

// The whole block in FP64 on the same (BF16-representable) weights and inputs, independent of the
// code under test: L = <r, y> + coef * aux.
struct Block64 {
  bool norm = false;
  double coef = 0.0;
  std::vector<double> w1, w2, r;  // (E, 2F, H), (E, H, F), (T, H)

  // x (T, H), wr (E, H). `selected` (T, k) gets each token's chosen experts in ascending order.
  double loss(const std::vector<double>& x, const std::vector<double>& wr,
              std::vector<int32_t>* selected = nullptr, std::vector<double>* y_out = nullptr,
              double* aux_out = nullptr) const {
    std::vector<double> probs(kT * kE), y(kT * kH, 0.0);
    std::vector<int32_t> idx(kT * kK);
    for (int64_t t = 0; t < kT; ++t) {
      double z[kE], m = -INFINITY, s = 0;
      for (int64_t e = 0; e < kE; ++e) {
        z[e] = 0;
        for (int64_t h = 0; h < kH; ++h) z[e] += x[t * kH + h] * wr[e * kH + h];
        m = std::max(m, z[e]);
      }
      for (int64_t e = 0; e < kE; ++e) s += std::exp(z[e] - m);
      for (int64_t e = 0; e < kE; ++e) probs[t * kE + e] = std::exp(z[e] - m) / s;
      int32_t order[kE];
      std::iota(order, order + kE, 0);
      std::stable_sort(order, order + kE,
                       [&](int32_t a, int32_t b) { return probs[t * kE + a] > probs[t * kE + b]; });
      double wsum = 0;
      for (int64_t j = 0; j < kK; ++j) wsum += probs[t * kE + order[j]];
      for (int64_t j = 0; j < kK; ++j) {
        const int32_t e = order[j];
        idx[t * kK + j] = e;
        const double wj = norm ? probs[t * kE + e] / wsum : probs[t * kE + e];
        double a[kF];
        for (int64_t f = 0; f < kF; ++f) {
          double g = 0, u = 0;
          for (int64_t h = 0; h < kH; ++h) {
            g += w1[(e * 2 * kF + f) * kH + h] * x[t * kH + h];
            u += w1[(e * 2 * kF + kF + f) * kH + h] * x[t * kH + h];
          }
          a[f] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int64_t h = 0; h < kH; ++h) {
          double o = 0;
          for (int64_t f = 0; f < kF; ++f) o += w2[(e * kH + h) * kF + f] * a[f];
          y[t * kH + h] += wj * o;
        }
      }
    }
    if (selected) {
      selected->assign(idx.begin(), idx.end());
      for (int64_t t = 0; t < kT; ++t)
        std::sort(selected->begin() + t * kK, selected->begin() + (t + 1) * kK);
    }
    // aux = E * sum_e (count_e / T) * pbar_e: f[j, e] summed over j is the expert's count.
    std::vector<double> count(kE, 0.0), pbar(kE, 0.0);
    for (int32_t e : idx) count[e] += 1.0;
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t e = 0; e < kE; ++e) pbar[e] += probs[t * kE + e] / kT;
    double aux = 0;
    for (int64_t e = 0; e < kE; ++e) aux += count[e] / kT * pbar[e];
    aux *= kE;
    double l = coef * aux;
    for (int64_t i = 0; i < kT * kH; ++i) l += r[i] * y[i];
    if (y_out) *y_out = y;
    if (aux_out) *aux_out = aux;
    return l;
  }
};

// Smallest gap between the k-th and (k+1)-th largest logit of token t.
double boundary_gap(const std::vector<double>& x, const std::vector<double>& wr, int64_t t) {
  std::vector<double> z(kE, 0.0);
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t h = 0; h < kH; ++h) z[e] += x[t * kH + h] * wr[e * kH + h];
  std::sort(z.begin(), z.end(), std::greater<>());
  return z[kK - 1] - z[kK];
}

std::vector<double> widen(const Tensor& f32) {
  const float* p = f32.data_as<const float>();
  return std::vector<double>(p, p + f32.numel());
}

// max |analytic - fd| <= tol * max |fd|.
void expect_grad_near(const char* what, const std::vector<float>& analytic,
                      const std::vector<double>& fd, double tol) {
  ASSERT_EQ(analytic.size(), fd.size()) << what;
  double max_err = 0, max_fd = 0;
  size_t worst = 0;
  for (size_t i = 0; i < fd.size(); ++i) {
    const double err = std::fabs(analytic[i] - fd[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
    max_fd = std::max(max_fd, std::fabs(fd[i]));
  }
  ASSERT_GT(max_fd, 0.0) << what << ": the loss does not depend on these inputs";
  EXPECT_LE(max_err, tol * max_fd)
      << what << ": max |analytic - fd| = " << max_err << " at " << worst << " (analytic "
      << analytic[worst] << ", fd " << fd[worst] << "), max |fd| = " << max_fd;
  std::printf("  %-6s max |analytic - fd| / max |fd| = %.3g (tol %.3g)\n", what, max_err / max_fd,
              tol);
}

struct FdCase {
  const char* name;
  DType activations;  // the block's activation_dtype
  bool norm;
  float coef;
  bool zero_dy;  // the loss is the aux loss alone
  double tol;
};

// Tolerances, as max |analytic - fd| / max |fd|. The FP64 model has the block's exact weights and
// inputs (BF16-representable), so the differences are the block's roundings: 2^-9 relative for each
// BF16 rounding (FP32 ones are negligible), applied to terms of sums. F32 activations round the
// BF16 GEMM operands a (SwiGLU output), dyp, dh and dlogits: the expert dx path passes dyp and dh,
// the router path (dx and dW_r, through dw = <dy, yp>) a and dlogits, y only a; at most 2 on any
// path, 2 * 2^-9 ~ 3.9e-3 of the terms' magnitudes (measured <= 4.2e-3 of max |fd|, sums cancel a
// little). BF16 activations also round h, yp, da and dxp: at most 5 on a path (dyp, da, h, dh,
// dxp), ~9.8e-3 (measured <= 5.5e-3). The tolerances 2^-6 and 2^-5 leave about 4x over the
// measurements, while a wrong or missing term is O(1) (dropping the aux backward gives 1.0, the
// router's dx 0.6).
const FdCase kFdCases[] = {
    {"f32 activations", DType::kF32, false, 0.1f, false, 1.0 / 64},
    {"f32 activations, norm_topk_prob", DType::kF32, true, 0.1f, false, 1.0 / 64},
    {"bf16 activations", DType::kBF16, false, 0.1f, false, 1.0 / 32},
    {"bf16 activations, norm_topk_prob", DType::kBF16, true, 0.1f, false, 1.0 / 32},
    {"aux loss alone", DType::kF32, true, 1.0f, true, 1.0 / 64},
};

TEST(MoEBlock, Bf16BackwardMatchesFp64FiniteDifferences) {
  Backend& b = cpu_backend();
  for (const FdCase& c : kFdCases) {
    SCOPED_TRACE(c.name);
    std::printf("%s\n", c.name);
    std::mt19937 rng(2024);
    const MoEBlockInit init{random_f32({kE, kH}, rng, 0.0f, 0.3f, true),
                            random_f32({kE, 2 * kF, kH}, rng, 0.0f, 0.2f, true),
                            random_f32({kE, kH, kF}, rng, 0.0f, 0.2f, true)};
    std::vector<double> wr = widen(init.router);  // (E, H)
    // x: BF16 values; a token is redrawn until its top-k boundary gap is at least kMinGap.
    Tensor x32 = Tensor::empty(cpu_backend(), DType::kF32, {kT, kH});
    std::vector<double> x(kT * kH);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (int64_t t = 0; t < kT; ++t) do {
        for (int64_t h = 0; h < kH; ++h)
          x[t * kH + h] = x32.data_as<float>()[t * kH + h] = bf16_to_f32(f32_to_bf16(dist(rng)));
      } while (boundary_gap(x, wr, t) < kMinGap);
    Tensor r32 = random_f32({kT, kH}, rng, 0.0f, 1.0f);
    if (c.zero_dy) std::fill(r32.data_as<float>(), r32.data_as<float>() + r32.numel(), 0.0f);

    Block64 model{c.norm, c.coef, widen(init.fc1), widen(init.fc2), widen(r32)};
    std::vector<int32_t> selected;
    std::vector<double> y64;
    double aux64 = 0;
    model.loss(x, wr, &selected, &y64, &aux64);

    MoEBlockConfig cfg;
    cfg.top_k = kK;
    cfg.norm_topk_prob = c.norm;
    cfg.aux_loss_coef = c.coef;
    cfg.recipe = {Recipe::kBF16, false, 0};
    cfg.out_dtype = DType::kF32;
    cfg.activation_dtype = c.activations;
    MoEBlock block(b, cfg, init);
    const std::vector<float> y = floats_of(b, block.forward(b.to_device(to_bf16(x32))));
    const std::vector<float> dx =
        floats_of(b, block.backward(b.to_device(r32), GradAccum::kOverwrite));
    std::vector<float> dwr(kE * kH);
    const std::vector<uint8_t> g = block.router().param().main_grad().download();  // (1, E, H)
    std::memcpy(dwr.data(), g.data(), g.size());

    // The forward agrees too (same roundings as the gradients above, one pass only).
    expect_grad_near("y", y, y64, c.tol);
    EXPECT_NEAR(block.aux_loss(), aux64, 1e-6 * aux64) << "aux: FP32 sums of O(1) terms";

    // Central differences w.r.t. every element of v (x or wr, perturbed in place and restored).
    auto fd = [&](std::vector<double>& v) {
      std::vector<double> out(v.size());
      std::vector<int32_t> sel;
      for (size_t i = 0; i < v.size(); ++i) {
        const double v0 = v[i];
        v[i] = v0 + kStep;
        const double up = model.loss(x, wr, &sel);
        EXPECT_EQ(sel, selected) << "a perturbation changed the top-k choice";
        v[i] = v0 - kStep;
        const double down = model.loss(x, wr, &sel);
        EXPECT_EQ(sel, selected) << "a perturbation changed the top-k choice";
        v[i] = v0;
        out[i] = (up - down) / (2 * kStep);
      }
      return out;
    };
    expect_grad_near("dx", dx, fd(x), c.tol);
    expect_grad_near("dW_r", dwr, fd(wr), c.tol);
  }
}

// ---- state ordering -----------------------------------------------------------------------------

class MoEBlockStateDeathTest : public testing::Test {
 protected:
  static constexpr int64_t T = 32, H = 32, F = 32, E = 4;
  std::unique_ptr<MoEBlock> block(bool delay, float aux_coef = 0.0f) {
    std::mt19937 rng(13);
    MoEBlockConfig cfg;
    cfg.delay_wgrad = delay;
    cfg.aux_loss_coef = aux_coef;
    const MoEBlockInit init{random_f32({E, H}, rng, 0.0f, 0.1f),
                            random_f32({E, 2 * F, H}, rng, 0.0f, 0.1f),
                            random_f32({E, H, F}, rng, 0.0f, 0.1f)};
    return std::make_unique<MoEBlock>(cpu_backend(), cfg, init);
  }
  Tensor x() {
    std::mt19937 rng(14);
    return to_bf16(random_f32({T, H}, rng, 0.0f, 1.0f));
  }
  Tensor dy() {
    std::mt19937 rng(15);
    return random_f32({T, H}, rng, 0.0f, 1.0f);
  }
};

TEST_F(MoEBlockStateDeathTest, BackwardBeforeForwardDies) {
  auto blk = block(false);
  EXPECT_DEATH(blk->backward(dy(), GradAccum::kAccumulate),
               "MoEBlock backward needs a forward first");
}

TEST_F(MoEBlockStateDeathTest, SecondBackwardDies) {
  auto blk = block(false);
  blk->forward(x());
  blk->backward(dy(), GradAccum::kAccumulate);
  EXPECT_EQ(blk->state(), BlockState::kIdle);
  EXPECT_DEATH(blk->backward(dy(), GradAccum::kAccumulate),
               "MoEBlock backward needs a forward first");
}

TEST_F(MoEBlockStateDeathTest, ForwardWithPendingWgradsDies) {
  auto blk = block(true);
  blk->forward(x());
  blk->backward(dy(), GradAccum::kAccumulate);
  EXPECT_EQ(blk->state(), BlockState::kWgradPending);
  EXPECT_DEATH(blk->forward(x()), "MoEBlock forward with delayed wgrads pending");
}

TEST_F(MoEBlockStateDeathTest, ZeroGradOrOptimizerStepWithPendingWgradsDies) {
  auto blk = block(true);
  blk->forward(x());
  blk->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(blk->zero_grad(), "zero_grad with a delayed wgrad pending");
  blk->backward_dw();
  // Under an optimizer (which zeroes the gradients itself), its step refuses as well.
  SingleRankOptimizer opt(cpu_backend(), decayed_params(blk->params()), AdamWConfig{});
  opt->prepare_forward();
  blk->forward(x());
  opt->prepare_backward();
  blk->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(opt->step(), "optimizer step with a delayed wgrad pending");
  blk->backward_dw();
  EXPECT_EQ(blk->state(), BlockState::kIdle);
  opt->step();
}

TEST_F(MoEBlockStateDeathTest, BackwardDwWithoutQueuedWgradsDies) {
  auto delayed = block(true);
  delayed->forward(x());
  delayed->backward(dy(), GradAccum::kAccumulate);
  delayed->backward_dw();
  EXPECT_DEATH(delayed->backward_dw(), "MoEBlock backward_dw without queued wgrads");
  auto direct = block(false);
  direct->forward(x());
  direct->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(direct->backward_dw(), "MoEBlock backward_dw without queued wgrads");
}

TEST_F(MoEBlockStateDeathTest, AuxLossReadsNeedTheAuxLossOn) {
  auto off = block(false);
  off->forward(x());
  EXPECT_DEATH(off->aux_loss(), "the aux loss is off");
  auto on = block(false, 1e-3f);
  EXPECT_DEATH(on->aux_loss(), "aux_loss before the first forward");
  on->forward(x());
  EXPECT_GT(on->aux_loss(), 0.0f);
}

}  // namespace
}  // namespace packmoe
