// Shared Trainer test helpers (header-only): the fortunes corpus and the tiny preset, small run
// configs, and a Trace of everything a run produces as bytes (losses, grad norms, eval losses,
// sampler position, FP32 masters, AdamW moments, SR offsets) with a bitwise comparison. Used by
// tests/e2e: "bitwise" always means equal bytes, never a tolerance.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "io/text_corpus.h"
#include "train/trainer.h"

namespace packmoe::train::testing {

// The default corpus (scripts/install-deps.sh installs it). A machine without it (the GPU machine)
// skips the tests that need it, with the loader's message, rather than training on other text
// with other margins: every TEST that calls corpus() starts with PACKMOE_SKIP_WITHOUT_CORPUS().
inline const Result<io::TextCorpus>& loaded_corpus() {
  static const Result<io::TextCorpus> c = io::load_text_corpus();
  return c;
}

#define PACKMOE_SKIP_WITHOUT_CORPUS()                                                        \
  if (!::packmoe::train::testing::loaded_corpus().is_ok())                                   \
  GTEST_SKIP() << ::packmoe::train::testing::loaded_corpus().status().message()

inline const TrainData& corpus() {
  static const TrainData data = [] {
    const Result<io::TextCorpus>& c = loaded_corpus();
    PACKMOE_CHECK(c.is_ok(), c.status().message());
    TrainData d;
    d.train = single_source(c.value().train, static_cast<uint32_t>('\n'));
    d.validation = single_source(c.value().validation, static_cast<uint32_t>('\n'));
    return d;
  }();
  return data;
}

inline ModelConfig tiny() { return model_config_preset("tiny").value(); }

// Small shapes so a whole test folder runs in minutes on 2 cores.
inline TrainConfig small_run(Recipe recipe, Layout layout) {
  TrainConfig c;
  c.steps = 30;
  c.micro_batch_size = 4;
  c.seq_len = 32;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.warmup_steps = 5;
  c.eval_interval = 10;
  c.eval_batches = 2;
  c.seed = 7;
  c.precision.recipe.recipe = recipe;
  c.precision.layout = layout;
  return c;
}

inline std::unique_ptr<Trainer> make_trainer(const TrainConfig& config,
                                             const ModelConfig& model = tiny()) {
  Result<std::unique_ptr<Trainer>> t =
      Trainer::create(cpu_backend(), model, config, TrainData(corpus()));
  PACKMOE_CHECK(t.is_ok(), t.status().message());
  return std::move(t.value());
}

// Everything a run produces, as bytes.
struct Trace {
  std::vector<double> losses, grad_norms, eval_losses;
  SamplerState sampler;  // of the train sampler at the end
  int64_t step = 0, optimizer_steps = 0;
  std::vector<std::vector<uint8_t>> masters, exp_avg, exp_avg_sq;
};

inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

// The trainer's state (not its history) into `trace`.
inline void capture_state(Trainer& t, Trace* trace) {
  trace->sampler = t.train_sampler().state();
  trace->step = t.step();
  trace->optimizer_steps = t.optimizer().steps();
  trace->masters.clear();
  trace->exp_avg.clear();
  trace->exp_avg_sq.clear();
  for (const auto& [name, tensor] : t.snapshot().masters) trace->masters.push_back(bytes_of(tensor));
  const FullOptimizerState state = t.optimizer().gather_state();
  auto bytes = [](const std::vector<float>& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    return std::vector<uint8_t>(p, p + v.size() * sizeof(float));
  };
  for (size_t i = 0; i < state.exp_avg.size(); ++i) {
    trace->exp_avg.push_back(bytes(state.exp_avg[i]));
    trace->exp_avg_sq.push_back(bytes(state.exp_avg_sq[i]));
  }
}

// Trains `steps` more steps, appending to `trace`; evaluates after the steps in `eval_after`.
inline void train(Trainer& t, int64_t steps, Trace* trace,
                  const std::vector<int64_t>& eval_after = {}) {
  for (int64_t i = 0; i < steps; ++i) {
    Result<StepResult> r = t.train_step();
    PACKMOE_CHECK(r.is_ok(), r.status().message());
    trace->losses.push_back(r.value().loss);
    trace->grad_norms.push_back(r.value().grad_norm);
    for (int64_t e : eval_after) {
      if (e != r.value().step) continue;
      Result<EvalResult> ev = t.evaluate();
      PACKMOE_CHECK(ev.is_ok(), ev.status().message());
      trace->eval_losses.push_back(ev.value().loss);
    }
  }
  capture_state(t, trace);
}

// A fresh run of `steps` steps.
inline Trace run(const TrainConfig& config, int64_t steps,
                 const std::vector<int64_t>& eval_after = {}) {
  std::unique_ptr<Trainer> t = make_trainer(config);
  Trace trace;
  train(*t, steps, &trace, eval_after);
  return trace;
}

inline bool same_bytes(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// Everything but the eval losses (a run with evaluations equals one without).
inline void expect_bitwise_equal(const Trace& a, const Trace& b) {
  EXPECT_TRUE(same_bytes(a.losses, b.losses));
  EXPECT_TRUE(same_bytes(a.grad_norms, b.grad_norms));
  EXPECT_EQ(a.sampler.consumed, b.sampler.consumed);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps);
  ASSERT_EQ(a.masters.size(), b.masters.size());
  for (size_t i = 0; i < a.masters.size(); ++i)
    EXPECT_EQ(a.masters[i], b.masters[i]) << "master " << i;
  ASSERT_EQ(a.exp_avg.size(), b.exp_avg.size());
  for (size_t i = 0; i < a.exp_avg.size(); ++i) {
    EXPECT_EQ(a.exp_avg[i], b.exp_avg[i]) << "exp_avg " << i;
    EXPECT_EQ(a.exp_avg_sq[i], b.exp_avg_sq[i]) << "exp_avg_sq " << i;
  }
}

}  // namespace packmoe::train::testing
