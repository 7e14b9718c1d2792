// AdamW (decoupled weight decay, bias correction) on the FP32 masters of GroupedParams, followed
// by re-quantization of each primary weight. Invariant: every element is updated by adamw_update()
// (backend/ops/elementwise.h), a fixed sequence of exactly-rounded FP32 operations whose step scalars
// are rounded once on the host, so every backend's adamw op writes the same bits. Its whole state
// is (step count, lr, each param's exp_avg / exp_avg_sq): what a checkpoint saves and restores.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/ops/elementwise.h"
#include "nn/grouped_param.h"

namespace packmoe {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // applied to the params added with weight_decay = true
};

// The scalars of step t (backend/ops/elementwise.h has the struct and the per-element formula).
AdamWStepScalars adamw_step_scalars(const AdamWConfig& cfg, int64_t t);
// The scalars of step t for one param: without weight decay (decay = 1 exactly: norms) unless
// weight_decay, the gradient multiplied by grad_scale (the clip coefficient). Every optimizer
// over GroupedParams takes its scalars from here.
AdamWStepScalars adamw_param_scalars(const AdamWConfig& cfg, int64_t t, bool weight_decay,
                                     float grad_scale);

// The update of a param is ONE backend adamw call over its E groups (either layout), in the
// memory of the param's backend.
class AdamW {
 public:
  struct ParamState {
    GroupedParam* param;
    bool weight_decay;          // false: decay = 1 exactly (norms)
    GroupedStorage exp_avg;     // (E, N, K) F32
    GroupedStorage exp_avg_sq;  // (E, N, K) F32
  };

  explicit AdamW(const AdamWConfig& cfg) : cfg_(cfg) {}

  // Registers a param that has its master. Its moments exp_avg and exp_avg_sq, (E, N, K) F32
  // zeros, live in the param's memory and layout.
  void add(GroupedParam& param, bool weight_decay = true);
  // The learning rate of the next step (an LR schedule sets it before every step).
  void set_lr(float lr) { cfg_.lr = lr; }
  float lr() const { return cfg_.lr; }
  // t += 1; for every param: the gradient is main_grad x grad_scale (the clip coefficient; 1
  // leaves every bit as without it), the master is updated (needs no pending wgrad), then
  // requantize_from_master() (one quantize launch per packed weight).
  void step(float grad_scale = 1.0f);

  // Checkpoint state: steps taken, and each param's moments in the order of add(). set_steps and
  // writes through states() restore them (moments keep their param's memory and layout).
  int64_t steps() const { return t_; }
  void set_steps(int64_t t);
  const std::vector<ParamState>& states() const { return states_; }
  std::vector<ParamState>& states() { return states_; }

 private:
  AdamWConfig cfg_;
  int64_t t_ = 0;
  std::vector<ParamState> states_;
};

}  // namespace packmoe
