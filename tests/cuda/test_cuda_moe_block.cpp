// MoEBlock on the CUDA backend. (a) The block-level parity matrix of
// tests/parity/test_moe_block_parity.cpp, run on the GPU: recipe {bf16, mxfp8, nvfp4} x primary
// weight {high, low} x grad-accum fusion {off, on} x delayed wgrad {off, on}; a single-layout and
// a discrete-layout block with the same init and inputs train four AdamW steps (micro-batches that
// overwrite and accumulate, an eval forward, an expert starved of tokens, aux loss,
// norm_topk_prob) and must give bitwise identical y, dx, main_grads, masters and primary-weight
// bytes at every step. (b) CUDA against the CPU reference: the same block (init, inputs) for one
// training step in each recipe; the routing must be identical (inputs keep every token's top-k
// logits well apart), the primary weights bitwise identical (the quantizers are), and y, dx, the
// main_grads and the updated masters within a relative Frobenius tolerance (the GEMMs sum in
// another FP32 order, so BF16 roundings of intermediates can flip). (c) The expert linears with
// device token counts against host counts on the GPU, bitwise. Backend interface only; skips
// without a GPU. The shared parity run, case matrix and helpers are tests/common/moe_block_harness.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/device_counts_checks.h"
#include "common/moe_block_harness.h"
#include "core/codecs.h"
#include "nn/moe_block.h"
#include "common/single_rank_optimizer.h"

namespace packmoe {
namespace {

using testing::bytes_of;
using testing::Case;
using testing::kE;
using testing::kF;
using testing::kH;
using testing::kParamNames;
using testing::kT;
using testing::kTopK;
using testing::random_f32;
using testing::to_bf16;

Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}

#define SKIP_WITHOUT_GPU()                                              \
  Backend* gpu = gpu_or_null();                                         \
  if (gpu == nullptr) GTEST_SKIP() << "no usable GPU: "                 \
                                   << get_backend(Device::kCUDA).status().message()

// ==== (a) single vs discrete layout on the GPU, bitwise, over four training steps ================

class CudaMoEBlockParity : public ::testing::TestWithParam<Case> {};

TEST_P(CudaMoEBlockParity, SingleEqualsDiscreteBitwiseOverFourSteps) {
  SKIP_WITHOUT_GPU();
  const Case& c = GetParam();
  // Every tensor and storage must live in GPU memory: the parity is checked where the block trains.
  testing::ParityRun run;
  testing::run_layout_parity(*gpu, c, Device::kCUDA, &run);
  if (!run.finished) return;  // a fatal assertion cut the run short
  std::printf("[moe cuda parity] %s steps=%d identical=%s\n", testing::case_text(c).c_str(),
              run.steps, HasFailure() ? "no" : "yes");
  std::fflush(stdout);
}

INSTANTIATE_TEST_SUITE_P(Matrix, CudaMoEBlockParity, ::testing::ValuesIn(testing::all_cases()),
                         testing::case_name);

// ==== (b) CUDA against the CPU reference, one training step per recipe ===========================
//
// Tolerance: relative Frobenius error ||cuda - cpu|| / ||cpu|| <= 1e-2 for y, dx, the three
// main_grads and the masters after one AdamW step. Why it holds: the MoE ops, the casts and the
// quantizers give the CPU's bits on the GPU (tests/cuda/test_cuda_moe_ops.cpp,
// test_cuda_quantize.cpp); the GEMMs multiply the same exact operand values and differ only in
// FP32 summation order (docs/gemm.md: <= 1e-5 relative for FP32 output, one BF16 rounding
// (2^-8 relative) on the elements whose rounding flips for BF16 output). With BF16 activations a
// path rounds h, yp, da, dxp and the GEMM operands a, dyp, dh; a flipped rounding moves one
// element by one BF16 ulp, and a flip in a quantized operand moves the MXFP8 / NVFP4 value of
// that element (or, through the block amax / RHT, of its block) by about one step of the format.
// Flips need a pre-rounding value within ~1e-6 relative of a rounding boundary, so few elements
// change and the Frobenius error stays orders of magnitude below 1e-2 (a wrong op or a missing
// term is O(1)). The routing itself is not covered by a tolerance: every token's k + 1 largest
// router logits are at least kMinGap apart (in FP64 on the BF16 weights and inputs), far above
// the ~1e-5 the FP32 router GEMMs can differ by, so top-k (order included) is the same on both
// backends, which the test asserts before comparing values.

constexpr double kTolerance = 1e-2;
constexpr double kMinGap = 0.05;

// ||a - b||_F / ||b||_F (0 when both are zero).
double rel_frobenius(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

// A tensor's values as F32 on the host (BF16 widened exactly).
std::vector<float> values_of(Backend& b, const Tensor& t) {
  const std::vector<uint8_t> raw = bytes_of(b, t);
  std::vector<float> out(t.numel());
  if (t.dtype() == DType::kF32) {
    std::memcpy(out.data(), raw.data(), raw.size());
  } else {
    PACKMOE_CHECK(t.dtype() == DType::kBF16, "values_of: F32 or BF16");
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    }
  }
  return out;
}

std::vector<float> floats_of_storage(const GroupedStorage& s) {
  const std::vector<uint8_t> raw = s.download();
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
  return out;
}

// The k + 1 largest logits of token t (FP64 on the given weights / inputs) are pairwise at least
// kMinGap apart.
bool well_separated(const float* x, const float* wr) {
  std::vector<double> z(kE, 0.0);
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t h = 0; h < kH; ++h)
      z[e] += static_cast<double>(x[h]) * static_cast<double>(wr[e * kH + h]);
  std::sort(z.begin(), z.end(), std::greater<>());
  for (int64_t j = 0; j < std::min<int64_t>(kTopK, kE - 1); ++j)
    if (z[j] - z[j + 1] < kMinGap) return false;
  return true;
}

class CudaMoEBlockVsCpu : public ::testing::TestWithParam<Recipe> {};

TEST_P(CudaMoEBlockVsCpu, OneTrainingStepAgreesWithTheCpuReference) {
  SKIP_WITHOUT_GPU();
  const Recipe recipe = GetParam();
  Backend& cpu = cpu_backend();
  std::mt19937 rng(777);
  // Router weights BF16-representable, so the FP64 separation check sees the block's exact
  // router weight; the expert weights keep full FP32 mantissas (masters must be the init).
  const MoEBlockInit init{random_f32({kE, kH}, rng, 0.0f, 0.3f, /*bf16_exact=*/true),
                          random_f32({kE, 2 * kF, kH}, rng, 0.0f, 0.1f),
                          random_f32({kE, kH, kF}, rng, 0.0f, 0.1f)};
  // x: BF16 values; a token is redrawn until its top-k logits are well separated.
  Tensor x32 = Tensor::empty(cpu, DType::kF32, {kT, kH});
  {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    float* x = x32.data_as<float>();
    int redraws = 0;
    for (int64_t t = 0; t < kT; ++t) {
      do {
        for (int64_t h = 0; h < kH; ++h) x[t * kH + h] = bf16_to_f32(f32_to_bf16(dist(rng)));
        ++redraws;
      } while (!well_separated(x + t * kH, init.router.data_as<float>()));
      ASSERT_LT(redraws, 100 * kT) << "cannot draw well-separated tokens";
    }
  }
  const Tensor x_host = to_bf16(x32);
  const Tensor dy_host = to_bf16(random_f32({kT, kH}, rng, 0.0f, 1.0f));

  MoEBlockConfig cfg;
  cfg.top_k = kTopK;
  cfg.norm_topk_prob = true;
  cfg.aux_loss_coef = 1e-2f;
  cfg.recipe = {recipe, false, /*sr_seed=*/7};
  cfg.primary = PrimaryWeight::kLowPrecision;  // what bench/moe_block.cpp times
  cfg.layout = Layout::kSingle;
  cfg.grad_accum_fusion = true;
  cfg.delay_wgrad = false;
  cfg.out_dtype = DType::kBF16;
  cfg.activation_dtype = DType::kBF16;
  MoEBlock on_cpu(cpu, cfg, init);
  MoEBlock on_gpu(*gpu, cfg, init);

  // The primary weights come from the same init through bitwise-equal casts and quantizers.
  {
    const std::vector<GroupedParam*> c = on_cpu.params(), g = on_gpu.params();
    for (size_t i = 0; i < c.size(); ++i) {
      const auto a = c[i]->weight_components(), e = g[i]->weight_components();
      ASSERT_EQ(a.size(), e.size());
      for (size_t j = 0; j < a.size(); ++j)
        EXPECT_TRUE(a[j].storage->download() == e[j].storage->download())
            << kParamNames[i] << " primary weight component " << a[j].name << " differs at init";
    }
  }
  const AdamWConfig opt_cfg{/*lr=*/1e-3f, 0.9f, 0.999f, 1e-8f, /*weight_decay=*/0.0f};
  SingleRankOptimizer opt_cpu(cpu, decayed_params(on_cpu.params()), opt_cfg);
  SingleRankOptimizer opt_gpu(*gpu, decayed_params(on_gpu.params()), opt_cfg);
  opt_cpu->prepare_forward();
  opt_gpu->prepare_forward();

  const Tensor y_cpu = on_cpu.forward(cpu.to_device(x_host));
  const Tensor y_gpu = on_gpu.forward(gpu->to_device(x_host));
  ASSERT_EQ(y_gpu.device(), Device::kCUDA);
  // Routing first: the values below are only comparable when every token went to the same
  // experts in the same order.
  ASSERT_EQ(on_gpu.plan().counts, on_cpu.plan().counts) << "tokens per expert differ";
  ASSERT_EQ(on_gpu.plan().dest, on_cpu.plan().dest) << "routing destinations differ";
  for (int64_t e = 0; e < kE; ++e) EXPECT_GT(on_cpu.plan().counts[e], 0) << "expert " << e;
  EXPECT_NEAR(on_gpu.aux_loss(), on_cpu.aux_loss(), 1e-4 * std::fabs(on_cpu.aux_loss()))
      << "aux loss: FP32 sums of probs that differ by the router GEMMs' summation order";

  opt_cpu->prepare_backward();
  opt_gpu->prepare_backward();
  const Tensor dx_cpu = on_cpu.backward(cpu.to_device(dy_host), GradAccum::kOverwrite);
  const Tensor dx_gpu = on_gpu.backward(gpu->to_device(dy_host), GradAccum::kOverwrite);

  const double err_y = rel_frobenius(values_of(*gpu, y_gpu), values_of(cpu, y_cpu));
  const double err_dx = rel_frobenius(values_of(*gpu, dx_gpu), values_of(cpu, dx_cpu));
  EXPECT_LE(err_y, kTolerance) << "y";
  EXPECT_LE(err_dx, kTolerance) << "dx";
  double err_grad[3], err_master[3];
  {
    const std::vector<GroupedParam*> c = on_cpu.params(), g = on_gpu.params();
    for (size_t i = 0; i < c.size(); ++i) {
      err_grad[i] = rel_frobenius(floats_of_storage(g[i]->main_grad()),
                                  floats_of_storage(c[i]->main_grad()));
      EXPECT_LE(err_grad[i], kTolerance) << kParamNames[i] << " main_grad";
    }
    opt_cpu->step();
    opt_gpu->step();
    for (size_t i = 0; i < c.size(); ++i) {
      const int p = static_cast<int>(i);
      err_master[i] = rel_frobenius(opt_gpu.master(p), opt_cpu.master(p));
      EXPECT_LE(err_master[i], kTolerance) << kParamNames[i] << " master after the AdamW step";
    }
  }
  std::printf(
      "[moe cuda vs cpu] %s y=%.3g dx=%.3g grad_router=%.3g grad_fc1=%.3g grad_fc2=%.3g "
      "master_router=%.3g master_fc1=%.3g master_fc2=%.3g (rel. Frobenius, tol %.0e)\n",
      recipe_name(recipe), err_y, err_dx, err_grad[0], err_grad[1], err_grad[2], err_master[0],
      err_master[1], err_master[2], kTolerance);
  std::fflush(stdout);
}

// (c) The expert linears as the block runs them, with the token counts in device memory (the
// grouped GEMMs' m_device: no host wait in BF16), against the same linears with host counts on
// the GPU: bitwise equal y, dx and main_grad in every recipe (tests/common/device_counts_checks.h).
TEST(CudaMoEBlockDeviceCounts, ExpertLinearsGiveTheHostCountBytes) {
  SKIP_WITHOUT_GPU();
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    for (bool delay : {false, true}) {
      testing::expect_device_counts_match_host(*gpu, r, delay);
      if (HasFatalFailure()) return;
    }
}

INSTANTIATE_TEST_SUITE_P(Recipes, CudaMoEBlockVsCpu,
                         ::testing::Values(Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4),
                         [](const ::testing::TestParamInfo<Recipe>& info) {
                           return std::string(recipe_name(info.param));
                         });

}  // namespace
}  // namespace packmoe
