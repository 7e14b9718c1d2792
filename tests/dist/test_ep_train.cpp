// Expert-parallel training through the Trainer (--expert-parallel, docs/dist.md) against the
// data-parallel run of the same micro-batches on the same ranks: a tiny Qwen3-MoE with 12
// experts, top-k 2, uneven routing (some experts get no token in some micro-batches), 3 steps,
// no clipping. For every EP > 1 dividing the world size:
//   - EP = world with one micro-batch per step (each expert's gradient sums every rank's part in
//     rank order, as the data-parallel reduce-scatter does): every loss bitwise, the grad norm
//     within 1e-12 relative (FP64 sums of squares over other shards), every master bitwise (the
//     dense ones in the world's optimizer, each rank's experts in the expert optimizer).
//   - EP < world, or two micro-batches per step: the first step's loss bitwise (the forward of
//     the same weights is the same), later losses within kLossBound (the expert gradients' FP32
//     sums run in another order).
// BF16 and MXFP8; NVFP4's first loss bitwise (its gradient stochastic rounding is numbered per
// quantizing rank, so the expert backward differs from data parallelism by design).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/dist_main.h"
#include "common/dist_train_setup.h"
#include "dist/ep_token_dispatcher.h"
#include "dist/expert_layout.h"
#include "nn/decoder_layer.h"
#include "nn/model.h"
#include "train/checkpoint.h"
#include "train/memory_plan.h"
#include "train/model_config.h"
#include "train/trainer.h"

namespace packmoe::dist_test {
namespace {

constexpr double kNormBound = 1e-12;  // relative
constexpr double kLossBound = 1e-4;   // relative, steps 2 and 3 when not bitwise

ModelConfig model_with_12_experts() {
  ModelConfig m = train::model_config_preset("tiny").value();
  m.num_experts = 12;
  m.num_experts_per_tok = 2;
  m.tie_word_embeddings = false;  // one process then reproduces N ranks bitwise (docs/dist.md)
  return m;
}

train::TrainConfig config(int64_t accum, Recipe recipe, int64_t ep, uint64_t seed) {
  train::TrainConfig c = dist_checks::train_config(accum, recipe, seed);
  c.expert_parallel = ep;
  return c;
}

struct Case {
  Recipe recipe;
  int64_t accum;
};

class EpTrain : public ::testing::TestWithParam<Case> {};

TEST_P(EpTrain, MatchesDataParallelOnTheSameMicroBatches) {
  const Case tc = GetParam();
  Communicator& world = comm();
  if (world.size() == 1) GTEST_SKIP() << "expert parallelism needs 2+ ranks";
  Backend& b = world.backend();
  const ModelConfig model = model_with_12_experts();
  const uint64_t seed = g_seed % 100000;
  for (int ep = 2; ep <= world.size(); ++ep) {
    if (world.size() % ep != 0 || model.num_experts % ep != 0) continue;
    SCOPED_TRACE(::testing::Message() << "EP " << ep << " of " << world.size() << " ranks, "
                                      << tc.accum << " micro-batch(es)");
    const bool bitwise = ep == world.size() && tc.accum == 1 && tc.recipe != Recipe::kNvfp4;
    auto dp = train::Trainer::create(b, model, config(tc.accum, tc.recipe, 1, seed), dist_checks::corpus(),
                                     nullptr, {&world})
                  .value();
    auto ept = train::Trainer::create(b, model, config(tc.accum, tc.recipe, ep, seed), dist_checks::corpus(),
                                      nullptr, {&world})
                   .value();
    ASSERT_TRUE(ept->parallel_optimizer().expert_parallel());
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE("step " + std::to_string(s + 1));
      const train::StepResult d = dp->train_step().value();
      const train::StepResult e = ept->train_step().value();
      if (s == 0 || bitwise) {
        EXPECT_EQ(e.loss, d.loss);
        EXPECT_EQ(e.aux_loss, d.aux_loss);
      } else if (tc.recipe != Recipe::kNvfp4) {
        EXPECT_LE(std::fabs(e.loss - d.loss), kLossBound * d.loss);
      }
      EXPECT_TRUE(std::isfinite(e.loss));
      if (bitwise) {
        EXPECT_LE(std::fabs(e.grad_norm - d.grad_norm) / d.grad_norm, kNormBound);
      }
      if (world.rank() == 0)
        std::printf("[ep train] EP %d of %d, %s: step %d loss %.17g (data parallel %.17g)\n", ep,
                    world.size(), recipe_name(tc.recipe), s + 1, e.loss, d.loss);
    }
    if (!bitwise) continue;
    // Masters: the data-parallel run's full state against the EP run's dense params and this
    // rank's experts.
    const FullOptimizerState full = dp->optimizer().gather_state();
    const FullOptimizerState dense = ept->optimizer().gather_state();
    const FullOptimizerState experts = ept->parallel_optimizer().experts()->gather_state();
    const ExpertLayout layout = make_expert_layout(world.size(), ep, model.num_experts, 1).value();
    const int64_t first = layout.first_expert(world.rank()), el = layout.local_experts();
    const std::vector<NamedParam>& params = dp->model().params();
    size_t di = 0, ei = 0;
    for (size_t p = 0; p < params.size(); ++p) {
      if (!params[p].expert) {
        EXPECT_EQ(dense.master[di++], full.master[p]) << params[p].name;
        continue;
      }
      const std::vector<float>& all = full.master[p];
      const size_t per_expert = all.size() / static_cast<size_t>(model.num_experts);
      const std::vector<float> slice(all.begin() + first * per_expert,
                                     all.begin() + (first + el) * per_expert);
      EXPECT_EQ(experts.master[ei++], slice) << params[p].name;
    }
    EXPECT_EQ(di, dense.master.size());
    EXPECT_EQ(ei, experts.master.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, EpTrain,
                         ::testing::Values(Case{Recipe::kBF16, 1}, Case{Recipe::kMxfp8, 1},
                                           Case{Recipe::kBF16, 2}, Case{Recipe::kNvfp4, 1}));

// --dispatch-dtype recipe against bf16 on the same micro-batches, every EP > 1: the first step's
// loss and aux loss bitwise (its forward is bitwise: docs/dist.md), the bytes each layer's
// dispatcher sent in it exactly what plan_all_to_all's figures make of that step's counts (and at
// most its per-step maximum); later losses within kDispatchLossBound (only the FC1 weight
// gradients differ). MXFP8 and NVFP4.
constexpr double kDispatchLossBound = 1e-3;  // relative, steps 2 and 3

class EpDispatchDtypeTrain : public ::testing::TestWithParam<Recipe> {};

TEST_P(EpDispatchDtypeTrain, RecipeDispatchAgainstBf16Dispatch) {
  const Recipe recipe = GetParam();
  Communicator& world = comm();
  if (world.size() == 1) GTEST_SKIP() << "expert parallelism needs 2+ ranks";
  Backend& b = world.backend();
  const ModelConfig model = model_with_12_experts();
  const uint64_t seed = g_seed % 100000;
  for (int ep = 2; ep <= world.size(); ++ep) {
    if (world.size() % ep != 0 || model.num_experts % ep != 0) continue;
    SCOPED_TRACE(::testing::Message() << "EP " << ep << " of " << world.size() << " ranks");
    train::TrainConfig quantized = config(1, recipe, ep, seed);
    quantized.dispatch_dtype = DispatchDtype::kRecipe;
    auto bf = train::Trainer::create(b, model, config(1, recipe, ep, seed), dist_checks::corpus(),
                                     nullptr, {&world})
                  .value();
    auto rc = train::Trainer::create(b, model, quantized, dist_checks::corpus(), nullptr, {&world})
                  .value();
    const ExpertLayout layout = make_expert_layout(world.size(), ep, model.num_experts, 1).value();
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE("step " + std::to_string(s + 1));
      const train::StepResult d = bf->train_step().value();
      const train::StepResult e = rc->train_step().value();
      if (s == 0) {
        EXPECT_EQ(e.loss, d.loss);
        EXPECT_EQ(e.aux_loss, d.aux_loss);
      } else {
        EXPECT_LE(std::fabs(e.loss - d.loss), kDispatchLossBound * d.loss);
      }
      if (world.rank() == 0)
        std::printf("[ep dispatch dtype] %s EP %d of %d: step %d loss %.17g (bf16 dispatch "
                    "%.17g)\n",
                    recipe_name(recipe), ep, world.size(), s + 1, e.loss, d.loss);
      if (s != 0) continue;
      // The first step's bytes, layer by layer: own rows in the dispatch dtype and as dY in
      // BF16, received rows twice in BF16, the per-expert bytes.
      for (auto* t : {bf.get(), rc.get()}) {
        const DispatchDtype dtype = t == bf.get() ? DispatchDtype::kBF16 : DispatchDtype::kRecipe;
        const train::AllToAllPlan p = train::plan_all_to_all(
            model, recipe, dtype, ep, quantized.micro_batch_size * quantized.seq_len, 1);
        int64_t total = 0;
        for (int64_t i = 0; i < model.num_hidden_layers; ++i) {
          MoEBlock* moe = t->model().layer(i).moe();
          if (moe == nullptr) continue;
          const std::vector<int64_t> padded = moe->plan().padded_counts;  // (E)
          DeviceBuffer mine = upload(padded);
          DeviceBuffer every(b, mine.size() * world.size());
          world.all_gather(mine.get(), every.get(), static_cast<int64_t>(mine.size()));
          const std::vector<int64_t> all = download<int64_t>(every);  // (world, E)
          int64_t own = 0, received = 0;
          for (int64_t c : padded) own += c;
          const int64_t first = layout.first_expert(world.rank());
          for (int q = 0; q < ep; ++q)
            for (int64_t x = first; x < first + layout.local_experts(); ++x)
              received += all[(layout.ep_group(world.rank()) * ep + q) * model.num_experts + x];
          const auto& dispatcher = dynamic_cast<const EpTokenDispatcher&>(moe->token_dispatcher());
          EXPECT_EQ(dispatcher.row_bytes_sent(),
                    own * (p.dispatch_row_bytes + p.row_bytes) +
                        model.num_experts * p.dispatch_group_bytes + 2 * received * p.row_bytes)
              << dispatch_dtype_name(dtype) << ", layer " << i;
          total += dispatcher.row_bytes_sent();
        }
        EXPECT_LE(total, p.max_bytes_per_step) << dispatch_dtype_name(dtype);
      }
    }
  }
}

// --recompute selective and full with the recipe dispatch (full recomputation dispatches FC1's
// payload again) reproduce --recompute none bitwise: losses and grad norms of 3 steps, EP = world.
TEST_P(EpDispatchDtypeTrain, RecomputeReproducesTheRunBitwise) {
  Communicator& world = comm();
  if (world.size() == 1) GTEST_SKIP() << "expert parallelism needs 2+ ranks";
  Backend& b = world.backend();
  const ModelConfig model = model_with_12_experts();
  if (model.num_experts % world.size() != 0) GTEST_SKIP() << "EP = world must divide 12";
  const uint64_t seed = g_seed % 100000;
  std::vector<train::StepResult> want;
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(train::recompute_name(r));
    train::TrainConfig c = config(1, GetParam(), world.size(), seed);
    c.dispatch_dtype = DispatchDtype::kRecipe;
    c.recompute = r;
    auto t = train::Trainer::create(b, model, c, dist_checks::corpus(), nullptr, {&world}).value();
    for (int s = 0; s < 3; ++s) {
      const train::StepResult got = t->train_step().value();
      if (r == Recompute::kNone) {
        want.push_back(got);
        continue;
      }
      EXPECT_EQ(got.loss, want[s].loss) << "step " << s + 1;
      EXPECT_EQ(got.grad_norm, want[s].grad_norm) << "step " << s + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, EpDispatchDtypeTrain,
                         ::testing::Values(Recipe::kMxfp8, Recipe::kNvfp4));

// A checkpoint saved after 2 steps by every EP >= 2 dividing the world (np 4: EP 2 and EP 4),
// resumed on the same ranks by every EP dividing the world (data parallelism included) and by one
// process (grad-accum = world): the third step's loss equals the uninterrupted run's bitwise where
// the two layouts are the same run (the same EP; EP = world, data parallelism and one process are
// bitwise one run), others within kLossBound.
TEST(EpTrain, CheckpointResumesUnderEveryLayout) {
  Communicator& world = comm();
  if (world.size() == 1) GTEST_SKIP() << "expert parallelism needs 2+ ranks";
  Backend& b = world.backend();
  const ModelConfig model = model_with_12_experts();
  if (model.num_experts % world.size() != 0) GTEST_SKIP() << "EP = world must divide 12";
  const uint64_t seed = g_seed % 100000;
  const int n = world.size();
  // Layouts that run bitwise the same steps as data parallelism.
  auto like_dp = [n](int ep) { return ep == 1 || ep == n; };
  for (int save_ep = 2; save_ep <= n; ++save_ep) {
    if (n % save_ep != 0) continue;
    SCOPED_TRACE(::testing::Message() << "saved with EP " << save_ep);
    const std::filesystem::path root =
        std::filesystem::temp_directory_path() /
        ("packmoe_ep_ckpt_" + std::to_string(g_seed) + "_" + std::to_string(save_ep));
    auto saving = train::Trainer::create(b, model, config(1, Recipe::kBF16, save_ep, seed),
                                         dist_checks::corpus(), nullptr, {&world})
                      .value();
    saving->train_step().value();
    saving->train_step().value();
    const auto committed = saving->save_checkpoint(root.string(), 1);
    ASSERT_TRUE(committed.is_ok()) << committed.status().message();
    const double want = saving->train_step().value().loss;
    Result<train::TrainerCheckpoint> c = train::read_trainer_checkpoint(committed.value().info.dir);
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    for (int ep = 1; ep <= n; ++ep) {
      if (n % ep != 0) continue;
      SCOPED_TRACE(::testing::Message() << "resumed with EP " << ep);
      auto t = train::Trainer::resume(b, c.value(), config(1, Recipe::kBF16, ep, seed),
                                      dist_checks::corpus(), {&world});
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      const double got = t.value()->train_step().value().loss;
      if (ep == save_ep || (like_dp(ep) && like_dp(save_ep)))
        EXPECT_EQ(got, want);
      else
        EXPECT_LE(std::fabs(got - want), kLossBound * want);
    }
    {
      SCOPED_TRACE("resumed by one process");
      auto one = train::Trainer::resume(b, c.value(), config(n, Recipe::kBF16, 1, seed),
                                        dist_checks::corpus());
      ASSERT_TRUE(one.is_ok()) << one.status().message();
      const double got = one.value()->train_step().value().loss;
      if (like_dp(save_ep))
        EXPECT_EQ(got, want);
      else
        EXPECT_LE(std::fabs(got - want), kLossBound * want);
    }
    world.barrier();
    if (world.rank() == 0) std::filesystem::remove_all(root);
  }
}

TEST(EpTrain, BadLayoutsFailBeforeAnythingStarts) {
  Communicator& world = comm();
  Backend& b = world.backend();
  const ModelConfig model = model_with_12_experts();
  auto fails = [&](const ModelConfig& m, int64_t ep, const std::string& part) {
    auto t = train::Trainer::create(b, m, config(1, Recipe::kBF16, ep, 1), dist_checks::corpus(), nullptr,
                                    {&world});
    ASSERT_FALSE(t.is_ok()) << "EP " << ep;
    EXPECT_NE(t.status().message().find(part), std::string::npos) << t.status().message();
  };
  fails(model, world.size() + 1, "does not divide the " + std::to_string(world.size()) + " ranks");
  // --dispatch-dtype recipe: a quantized recipe's rows under expert parallelism only.
  auto dispatch_fails = [&](Recipe recipe, int64_t ep, const std::string& part) {
    train::TrainConfig c = config(1, recipe, ep, 1);
    c.dispatch_dtype = DispatchDtype::kRecipe;
    auto t = train::Trainer::create(b, model, c, dist_checks::corpus(), nullptr, {&world});
    ASSERT_FALSE(t.is_ok()) << recipe_name(recipe) << " EP " << ep;
    EXPECT_NE(t.status().message().find(part), std::string::npos) << t.status().message();
  };
  dispatch_fails(Recipe::kBF16, world.size(), "dispatch_dtype = recipe needs the mxfp8 or nvfp4");
  dispatch_fails(Recipe::kMxfp8, 1, "dispatch_dtype = recipe needs expert parallelism");
  if (world.size() >= 2) {
    ModelConfig odd = model;
    odd.num_experts = 2 * world.size() + 1;  // EP = world does not divide it
    if (odd.num_experts_per_tok > odd.num_experts) odd.num_experts_per_tok = 2;
    fails(odd, world.size(), "experts per layer");
    ModelConfig dense = model;
    dense.mlp_only_layers.clear();
    for (int64_t i = 0; i < dense.num_hidden_layers; ++i) dense.mlp_only_layers.push_back(i);
    fails(dense, world.size(), "without MoE layers");
  }
}

}  // namespace
}  // namespace packmoe::dist_test

int main(int argc, char** argv) {
  return packmoe::dist_test::run_all(argc, argv, packmoe::Device::kCPU);
}
