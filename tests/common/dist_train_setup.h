// The small training set-up the Trainer's distributed tests share (tests/common/dist_train_checks.h,
// tests/dist/test_ep_train.cpp): a byte corpus of numbered lines, and 3 unclipped steps of 2 rows
// of 16 tokens (bitwise comparisons need an unclipped step: docs/dist.md).
#pragma once

#include <cstdint>
#include <string>

#include "train/trainer.h"

namespace packmoe::dist_checks {

inline train::TrainData corpus() {
  train::TrainData d;
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "line " + std::to_string(i * 7919 % 1013) + " of the packmoe dist corpus\n";
  io::TokenDataset tokens;
  for (unsigned char c : text) tokens.tokens.push_back(c);
  d.train = train::single_source(std::move(tokens));
  return d;
}

inline train::TrainConfig train_config(int64_t accum, Recipe recipe, uint64_t seed) {
  train::TrainConfig c;
  c.steps = 3;
  c.micro_batch_size = 2;
  c.seq_len = 16;
  c.grad_accum_steps = accum;
  c.warmup_steps = 1;
  c.eval_interval = 0;
  c.grad_clip = 0;
  c.seed = seed;
  c.precision.recipe.recipe = recipe;
  return c;
}

}  // namespace packmoe::dist_checks
