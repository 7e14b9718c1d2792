// The whole tiny Qwen3-MoE Model (embedding, attention, norms, router, experts, LM head: every
// parameter a GroupedParam, dense ones with E = 1) trained by DistOptimizer under Local and MPI:
// each rank's micro-batch loss, the masters and every primary weight equal one process
// accumulating all ranks' micro-batches under the same optimizer over one rank, bitwise, for one
// recipe per gather mode, with each gradient bucket's reduce-scatter started during backward (the
// grad-ready hook). Norms and the embedding table, which layers read in FP32
// (NamedParam::reads_fp32), run as WeightForm::kFp32 (full FP32 replicas refreshed by an FP32
// all-gather).
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dist_optimizer_harness.h"
#include "nn/model.h"
#include "train/model_config.h"
#include "train/trainer.h"

namespace packmoe::dist_checks {
namespace {

ModelConfig tiny() { return train::model_config_preset("tiny").value(); }

// Micro-batch (s, i): B = 2 rows of S = 16 random bytes, each row's targets its next tokens.
Batch micro_batch(uint64_t seed, int s, int i) {
  std::mt19937_64 rng = rng_for(seed, s, i, 11);
  std::uniform_int_distribution<int32_t> token(0, 255);
  Batch b;
  b.batch = 2;
  b.seq = 16;
  for (int64_t r = 0; r < b.batch; ++r) {
    std::vector<int32_t> row(b.seq + 1);
    for (int32_t& t : row) t = token(rng);
    b.inputs.insert(b.inputs.end(), row.begin(), row.end() - 1);
    b.targets.insert(b.targets.end(), row.begin() + 1, row.end());
  }
  return b;
}

// A model copy with no optimizer of its own: kFp32 params keep their FP32 weight as a replica
// (from the init), which write_weights refreshes.
void hold_replicas(Model& m) {
  for (const NamedParam& p : m.params())
    if (p.reads_fp32) p.param->keep_fp32_replica();
}

// The weights of the optimizer's masters (one per param, host F32) written into such a copy as
// the optimizer's BF16 gather writes them: replicas and the primary made from each, the other
// primaries from bf16(master).
void write_weights(Model& m, const std::vector<std::vector<float>>& masters) {
  for (size_t p = 0; p < m.params().size(); ++p) {
    GroupedParam& param = *m.params()[p].param;
    if (!m.params()[p].reads_fp32) {
      write_primary_from_master(param, masters[p]);
      continue;
    }
    const DeviceBuffer f32 = upload(masters[p]);
    param.write_fp32_replica(static_cast<const float*>(f32.get()));
    param.write_primary_from_replica();
  }
}

std::vector<std::vector<uint8_t>> model_primaries(const Model& m) {
  std::vector<std::vector<uint8_t>> out;
  for (const NamedParam& p : m.params())
    for (const NamedStorage& s : p.param->weight_components()) out.push_back(s.storage->download());
  return out;
}

struct ModelCase {
  const char* name;
  ModelPrecision precision;
  GatherMode mode;
};

TEST(DistModel, TinyModelEqualsOneProcessAccumulatingEveryRanksMicroBatch) {
  const int world = comm().size();
  Backend& b = comm().backend();
  const ModelCase cases[] = {
      {"bf16",
       {{Recipe::kBF16, false, 5}, PrimaryWeight::kHighPrecision, Layout::kSingle, true},
       GatherMode::kBf16},
      {"mxfp8_2d",
       {{Recipe::kMxfp8, true, 5}, PrimaryWeight::kLowPrecision, Layout::kDiscrete, true},
       GatherMode::kLowp},
      {"nvfp4",
       {{Recipe::kNvfp4, false, 5}, PrimaryWeight::kLowPrecision, Layout::kSingle, true},
       GatherMode::kReuseGradBuffer}};
  const ModelConfig config = tiny();
  const ModelWeights init = random_model_weights(config, g_seed);
  for (const ModelCase& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " / " + std::string(gather_mode_name(c.mode)));
    // The reference: micro-batch i in model copy i (its own SR streams), gradients summed into
    // copy 0 in index order, a 1-rank optimizer there, its masters' weights written into the
    // others.
    std::vector<std::unique_ptr<Model>> ref;
    for (int i = 0; i < world; ++i)
      ref.push_back(std::make_unique<Model>(b, config, c.precision, init));
    SingleRankOptimizer ref_opt(b, train::optimizer_params(*ref[0]), kAdamW);
    for (int i = 1; i < world; ++i) hold_replicas(*ref[i]);

    Model model(b, config, c.precision, init);
    const std::vector<DistParam> params = train::optimizer_params(model);
    DistOptimizer opt(comm(), params, {kAdamW, c.mode, int64_t{1} << 14});
    EXPECT_GT(opt.plan().buckets().size(), 2u);
    // Each bucket's reduce-scatter starts during backward once its gradients are final.
    model.set_grad_ready_hook([&opt](size_t p) { opt.grad_ready(static_cast<int>(p)); });

    const float scale = 1.0f / static_cast<float>(world);
    for (int s = 0; s < 3; ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      std::vector<ForwardLosses> ref_losses;
      ref_opt->prepare_forward();
      ref_opt->prepare_backward();
      for (int i = 0; i < world; ++i) {
        if (i > 0) ref[i]->zero_grad();
        ref_losses.push_back(ref[i]->forward(micro_batch(g_seed, s, i), scale).value());
        ref[i]->backward();
      }
      for (size_t p = 0; p < ref[0]->params().size(); ++p)
        for (int i = 1; i < world; ++i)
          add_f32(ref[0]->params()[p].param->main_grad(), ref[i]->params()[p].param->main_grad());
      const double ref_norm = ref_opt->step().grad_norm;
      const FullOptimizerState ref_state = ref_opt->gather_state();
      for (int i = 1; i < world; ++i) write_weights(*ref[i], ref_state.master);
      ref_opt->prepare_forward();

      opt.prepare_forward();
      opt.prepare_backward(/*last_of_step=*/true);
      const ForwardLosses mine =
          model.forward(micro_batch(g_seed, s, comm().rank()), opt.loss_scale(1)).value();
      model.backward();
      EXPECT_TRUE(opt.grad_buffer().reducing());
      const DistStepResult r = opt.step();
      EXPECT_EQ(mine.lm_loss, ref_losses[comm().rank()].lm_loss);
      EXPECT_EQ(mine.aux_loss, ref_losses[comm().rank()].aux_loss);
      EXPECT_LE(std::fabs(r.grad_norm - ref_norm) / ref_norm, 1e-12);
      compare_shard(
          opt, opt.master_shard(), [&](int p) { return ref_state.master[p]; }, true, "master");
      opt.prepare_forward();
      EXPECT_TRUE(model_primaries(model) == model_primaries(*ref[0])) << "primary weights";
      for (size_t p = 0; p < params.size(); ++p) {  // the replicas are the whole masters
        const GroupedParam& replica = *params[p].param;
        if (params[p].form != WeightForm::kFp32) continue;
        EXPECT_TRUE(floats_of(replica.fp32_weight()) == ref_state.master[p])
            << model.params()[p].name;
      }
    }
  }
}

}  // namespace
}  // namespace packmoe::dist_checks

int main(int argc, char** argv) {
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
