// Activation recomputation against none on a tiny random model (header-only; tests/unit and
// tests/cuda): the same seed, data and steps with --recompute none, selective and full through the
// Trainer; every step's loss, aux loss and grad norm and the final FP32 masters and AdamW moments
// must be the same bytes. The independent reference is the none run: a recomputed op that read
// other bytes, or router statistics counted twice, changes a loss, a norm or a weight.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/trainer_trace.h"
#include "nn/recompute.h"
#include "train/trainer.h"

namespace packmoe::testing {

struct RecomputeCase {
  Recipe recipe;
  int64_t grad_accum;
  bool tied;
  bool dense_layer;   // layer 1 a dense MLP (else both layers MoE)
  bool document_mask;  // rows of several documents (doc_start in the attention core)
};

// A readable test name, e.g. mxfp8_accum2_tied_dense_docmask.
inline std::string recompute_case_name(const ::testing::TestParamInfo<RecomputeCase>& info) {
  const RecomputeCase& p = info.param;
  return std::string(recipe_name(p.recipe)) + "_accum" + std::to_string(p.grad_accum) +
         (p.tied ? "_tied" : "_untied") + (p.dense_layer ? "_dense" : "_moe") +
         (p.document_mask ? "_docmask" : "");
}

// 2 layers, 4 experts top-2, GQA, the aux loss on (shared router statistics).
inline ModelConfig recompute_model(const RecomputeCase& p) {
  ModelConfig c;
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  if (p.dense_layer) c.mlp_only_layers = {1};
  c.tie_word_embeddings = p.tied;
  c.router_aux_loss_coef = 0.01;
  c.initializer_range = 0.2;
  return c;
}

// Random documents of 5..40 tokens.
inline train::TrainData random_documents(uint32_t seed, int64_t vocab, bool document_mask) {
  std::mt19937 rng(seed);
  io::TokenDataset d;
  d.source = "random";
  d.doc_offsets.push_back(0);
  for (int doc = 0; doc < 60; ++doc) {
    const int len = 5 + static_cast<int>(rng() % 36);
    for (int i = 0; i < len; ++i) d.tokens.push_back(static_cast<uint32_t>(rng() % vocab));
    d.doc_offsets.push_back(d.tokens.size());
  }
  train::TrainData data;
  data.train = train::single_source(std::move(d));
  if (document_mask) data.train_stream.document_mask = train::DocumentMask::kIndex;
  return data;
}

struct RecomputeTrace {
  train::testing::Trace trace;  // losses, grad norms, masters, moments
  std::vector<double> aux_losses;
};

inline RecomputeTrace recompute_run(Backend& backend, const RecomputeCase& p, Recompute mode,
                                    uint32_t seed, int64_t steps) {
  const ModelConfig model = recompute_model(p);
  train::TrainConfig c;
  c.steps = steps;
  c.micro_batch_size = 2;
  c.seq_len = 32;
  c.grad_accum_steps = p.grad_accum;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.warmup_steps = 1;
  c.eval_interval = 0;
  c.seed = seed;
  c.precision.recipe.recipe = p.recipe;
  c.recompute = mode;
  Result<std::unique_ptr<train::Trainer>> t = train::Trainer::create(
      backend, model, c, random_documents(seed, model.vocab_size, p.document_mask));
  PACKMOE_CHECK(t.is_ok(), t.status().message());
  EXPECT_EQ(t.value()->model().recompute(), mode);
  RecomputeTrace out;
  for (int64_t i = 0; i < steps; ++i) {
    Result<train::StepResult> r = t.value()->train_step();
    PACKMOE_CHECK(r.is_ok(), r.status().message());
    out.trace.losses.push_back(r.value().loss);
    out.trace.grad_norms.push_back(r.value().grad_norm);
    out.aux_losses.push_back(r.value().aux_loss);
  }
  train::testing::capture_state(*t.value(), &out.trace);
  return out;
}

// Selective and full against none: the same bytes everywhere.
inline void expect_recompute_bitwise(Backend& backend, const RecomputeCase& p, int64_t steps) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const RecomputeTrace none = recompute_run(backend, p, Recompute::kNone, seed, steps);
  for (Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(mode == Recompute::kFull ? "full" : "selective");
    const RecomputeTrace r = recompute_run(backend, p, mode, seed, steps);
    EXPECT_TRUE(train::testing::same_bytes(r.aux_losses, none.aux_losses));
    train::testing::expect_bitwise_equal(r.trace, none.trace);
  }
}

}  // namespace packmoe::testing
