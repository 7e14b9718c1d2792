// Activation recomputation (nn/recompute.h) on the CPU. (a) Selective and full give bitwise the
// run of none (tests/common/recompute_checks.h): losses, aux losses, grad norms, FP32 masters and
// AdamW moments after 3 steps, in each recipe, grad-accum 1 and 2, tied and untied heads, MoE and
// dense layers, causal and document-masked rows. (b) They hold less: the most bytes in use during
// one training forward + backward, counted by a backend that forwards to the CPU's, falls from
// none to selective to full, and the gradients are the same bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "common/recompute_checks.h"
#include "nn/model.h"

namespace packmoe {
namespace {

using testing::RecomputeCase;

class RecomputeVsNone : public ::testing::TestWithParam<RecomputeCase> {};

TEST_P(RecomputeVsNone, SameBytes) { testing::expect_recompute_bitwise(cpu_backend(), GetParam(), 3); }

INSTANTIATE_TEST_SUITE_P(
    Cases, RecomputeVsNone,
    ::testing::Values(RecomputeCase{Recipe::kBF16, 1, false, true, false},
                      RecomputeCase{Recipe::kBF16, 2, true, false, true},
                      RecomputeCase{Recipe::kMxfp8, 2, false, true, false},
                      RecomputeCase{Recipe::kMxfp8, 1, true, false, false},
                      RecomputeCase{Recipe::kNvfp4, 2, true, true, false},
                      RecomputeCase{Recipe::kNvfp4, 1, false, false, true}),
    testing::recompute_case_name);

// The CPU backend, counting the bytes it holds and the most it held.
class CountingBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override {
    void* p = cpu().allocate(bytes);
    sizes_[p] = bytes;
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void deallocate(void* ptr) override {
    in_use_ -= sizes_.at(ptr);
    sizes_.erase(ptr);
    cpu().deallocate(ptr);
  }
  std::string name() const override { return "counting cpu"; }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    cpu().copy(dst, src, bytes, kind);
  }
  void fill_zero(void* dst, size_t bytes) override { cpu().fill_zero(dst, bytes); }
  void synchronize() override {}
  double time_ms(const std::function<void()>& body, int warmup, int iters) override {
    return cpu().time_ms(body, warmup, iters);
  }
  const OpKernels& kernels() const override { return cpu_backend().kernels(); }

  void reset_peak() { peak_ = in_use_; }
  size_t peak() const { return peak_; }

 private:
  static Backend& cpu() { return cpu_backend(); }
  std::map<void*, size_t> sizes_;
  size_t in_use_ = 0, peak_ = 0;
};

struct StepMemory {
  size_t peak = 0;                          // bytes, above what the model held before the step
  std::vector<std::vector<uint8_t>> grads;  // main_grad bytes per param
};

StepMemory one_step(const ModelConfig& c, const ModelWeights& init, const Batch& batch,
                    Recompute mode) {
  CountingBackend b;
  StepMemory out;
  {
    ModelPrecision precision;
    precision.recipe.recipe = Recipe::kBF16;
    Model model(b, c, precision, init);
    model.set_recompute(mode);
    model.zero_grad();
    b.reset_peak();
    const size_t before = b.peak();
    Result<ForwardLosses> l = model.forward(batch, 1.0f);
    EXPECT_TRUE(l.is_ok()) << l.status().message();
    model.backward();
    out.peak = b.peak() - before;
    for (const NamedParam& p : model.params()) {
      const GroupedStorage& g = p.param->main_grad();
      for (int64_t e = 0; e < g.groups(); ++e) {
        const auto* bytes = static_cast<const uint8_t*>(g.group(e));
        out.grads.emplace_back(bytes, bytes + g.bytes_per_group());
      }
    }
  }
  return out;
}

TEST(Recompute, HoldsLessAndGivesTheSameGradients) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  ModelConfig c = testing::recompute_model({Recipe::kBF16, 1, false, true, false});
  c.num_hidden_layers = 4;
  c.mlp_only_layers = {1, 3};
  const ModelWeights init = random_model_weights(c, seed);
  std::mt19937 rng(seed);
  Batch batch;
  batch.batch = 2;
  batch.seq = 64;
  for (int64_t t = 0; t < batch.batch * batch.seq; ++t) {
    batch.inputs.push_back(static_cast<int32_t>(rng() % c.vocab_size));
    batch.targets.push_back(static_cast<int32_t>(rng() % c.vocab_size));
  }
  const StepMemory none = one_step(c, init, batch, Recompute::kNone);
  const StepMemory selective = one_step(c, init, batch, Recompute::kSelective);
  const StepMemory full = one_step(c, init, batch, Recompute::kFull);
  std::printf("peak bytes of one step: none %zu, selective %zu, full %zu\n", none.peak,
              selective.peak, full.peak);
  EXPECT_LT(selective.peak, none.peak);
  EXPECT_LT(full.peak, selective.peak);
  EXPECT_TRUE(selective.grads == none.grads);
  EXPECT_TRUE(full.grads == none.grads);
}

}  // namespace
}  // namespace packmoe
