// plan_memory (train/memory_plan.h, `packmoe train --dry-run`) against the real Trainer on the
// same ranks: tiny Qwen3-MoEs of 10 and 12 experts, for every EP dividing the world size and the
// experts, every recipe (MXFP8 1D and 2D), both primary weights, every gather mode, tied and
// untied embeddings, small buckets. On every rank, EXACT equality with the real optimizers (the
// dense one over all ranks and, with EP > 1, the experts' over the expert-data-parallel group):
// plan().total(), shard().size(), traffic()'s all-gather, FP32-replica and reduce-scatter bytes;
// the parameters this rank's model holds; its primary weights' allocated bytes. And the plan's
// errors are the Trainer's.
#include <string>
#include <vector>

#include "common/dist_main.h"
#include "common/dist_train_setup.h"
#include "nn/model.h"
#include "train/memory_plan.h"
#include "train/model_config.h"
#include "train/trainer.h"

namespace packmoe::dist_test {
namespace {

constexpr int64_t kBucketElems = 4096;  // several buckets per optimizer

// A Qwen3-MoE of the tiny preset's sizes with `experts` experts of `width` channels in `layers`
// layers; kShapes holds three: together their shard cuts fall inside expert rows at 2, 3 and 4
// ranks, with EP 1 and with EP 2 of 4, where a wrong quantization block (unit_rows) moves them.
struct ModelShape {
  int64_t experts, layers, width;
};
constexpr ModelShape kShapes[] = {{12, 2, 32}, {12, 2, 96}, {10, 3, 32}};

ModelConfig model_of(const ModelShape& shape, bool tied) {
  ModelConfig m = train::model_config_preset("tiny").value();
  m.num_experts = shape.experts;
  m.num_experts_per_tok = 2;
  m.num_hidden_layers = shape.layers;
  m.moe_intermediate_size = shape.width;
  m.tie_word_embeddings = tied;
  return m;
}

int64_t bytes_of(const std::vector<NamedStorage>& parts, bool only_bf16) {
  int64_t n = 0;
  for (const NamedStorage& s : parts)
    if (!only_bf16 || s.name == "bf16")
      n += s.storage->groups() * static_cast<int64_t>(s.storage->bytes_per_group());
  return n;
}

// What the Model's params hold of their primary weights: the BF16 param where one is kept, and
// the recipe's quantized copies (allocated from construction on, also while a high-precision
// primary's compute copies are stale).
int64_t allocated_weight_bytes(const Model& model) {
  int64_t n = 0;
  for (const NamedParam& p : model.params())
    n += bytes_of(p.param->weight_components(), true) +
         bytes_of(p.param->recipe_ops().components(), false);
  return n;
}

void expect_same(const train::OptimizerMemory& planned, const DistOptimizer& real) {
  EXPECT_EQ(planned.ranks, real.plan().world_size());
  EXPECT_EQ(planned.grad_elements, real.plan().total());
  EXPECT_EQ(planned.master_elements, real.shard().size());
  EXPECT_EQ(planned.all_gather_bytes, real.traffic().all_gather_bytes);
  EXPECT_EQ(planned.fp32_gather_bytes, real.traffic().fp32_bytes);
  EXPECT_EQ(planned.reduce_scatter_bytes, real.traffic().reduce_scatter_bytes);
}

struct Case {
  Recipe recipe;
  bool mxfp8_2d;
  PrimaryWeight primary;
};

class MemoryPlan : public ::testing::TestWithParam<Case> {};

TEST_P(MemoryPlan, EqualsTheTrainersOptimizersOnEveryRank) {
  const Case tc = GetParam();
  Communicator& world = comm();
  Backend& b = world.backend();
  for (const ModelShape& shape : kShapes)
    for (bool tied : {false, true})
      for (GatherMode gather : {GatherMode::kBf16, GatherMode::kLowp, GatherMode::kReuseGradBuffer})
        for (int ep = 1; ep <= world.size(); ++ep) {
          const ModelConfig model = model_of(shape, tied);
          if (world.size() % ep != 0 || model.num_experts % ep != 0) continue;
          SCOPED_TRACE(::testing::Message()
                       << shape.experts << " experts in " << shape.layers << " layers, width "
                       << shape.width << ", EP " << ep << " of " << world.size()
                       << " ranks, gather " << gather_mode_name(gather)
                       << (tied ? ", tied" : ", untied") << ", rank " << world.rank());
          train::TrainConfig config = dist_checks::train_config(1, tc.recipe, 7);
          config.precision.recipe.mxfp8_weight_2d = tc.mxfp8_2d;
          config.precision.primary = tc.primary;
          config.gather_mode = gather;
          config.expert_parallel = ep;
          Result<train::MemoryPlan> planned =
              train::plan_memory(model, config.precision, gather, world.size(), ep, kBucketElems);
          ASSERT_TRUE(planned.is_ok()) << planned.status().message();
          ASSERT_EQ(planned.value().ranks.size(), static_cast<size_t>(world.size()));
          const train::RankMemory& mine = planned.value().ranks[world.rank()];
          EXPECT_EQ(mine.rank, world.rank());
          auto trainer = train::Trainer::create(b, model, config, dist_checks::corpus(), nullptr,
                                                {&world, kBucketElems});
          ASSERT_TRUE(trainer.is_ok()) << trainer.status().message();
          train::Trainer& t = *trainer.value();
          expect_same(mine.dense, t.optimizer());
          if (DistOptimizer* experts = t.parallel_optimizer().experts()) {
            expect_same(mine.experts, *experts);
          } else {
            EXPECT_EQ(ep, 1);
            EXPECT_EQ(mine.experts.ranks, 0);
            EXPECT_EQ(mine.experts.grad_elements, 0);
          }
          int64_t dense = 0, experts = 0;
          for (const NamedParam& p : t.model().params())
            (p.expert ? experts : dense) += p.param->experts() * p.param->n() * p.param->k();
          EXPECT_EQ(mine.dense_params, dense);
          EXPECT_EQ(mine.expert_params, experts);
          EXPECT_EQ(mine.weight_bytes, allocated_weight_bytes(t.model()));
        }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, MemoryPlan,
    ::testing::Values(Case{Recipe::kBF16, false, PrimaryWeight::kLowPrecision},
                      Case{Recipe::kMxfp8, false, PrimaryWeight::kLowPrecision},
                      Case{Recipe::kMxfp8, true, PrimaryWeight::kLowPrecision},
                      Case{Recipe::kNvfp4, false, PrimaryWeight::kLowPrecision},
                      Case{Recipe::kMxfp8, false, PrimaryWeight::kHighPrecision},
                      Case{Recipe::kNvfp4, false, PrimaryWeight::kHighPrecision}));

TEST(MemoryPlanErrors, AreTheTrainersForBadLayouts) {
  Communicator& world = comm();
  auto same_error = [&](const ModelConfig& m, int ep) {
    train::TrainConfig config = dist_checks::train_config(1, Recipe::kBF16, 7);
    config.expert_parallel = ep;
    Result<train::MemoryPlan> planned =
        train::plan_memory(m, config.precision, config.gather_mode, world.size(), ep, kBucketElems);
    auto trainer = train::Trainer::create(world.backend(), m, config, dist_checks::corpus(),
                                          nullptr, {&world, kBucketElems});
    ASSERT_FALSE(planned.is_ok()) << "EP " << ep;
    ASSERT_FALSE(trainer.is_ok()) << "EP " << ep;
    EXPECT_EQ(planned.status().message(), trainer.status().message());
  };
  const ModelConfig model = model_of(kShapes[0], false);
  same_error(model, world.size() + 1);  // does not divide the ranks
  ModelConfig odd = model;
  odd.num_experts = 13;  // no EP > 1 divides it
  if (world.size() > 1) same_error(odd, world.size());
  ModelConfig dense = model;
  for (int64_t i = 0; i < dense.num_hidden_layers; ++i) dense.mlp_only_layers.push_back(i);
  if (world.size() > 1) same_error(dense, world.size());
}

}  // namespace
}  // namespace packmoe::dist_test

int main(int argc, char** argv) {
  return packmoe::dist_test::run_all(argc, argv, packmoe::Device::kCPU);
}
