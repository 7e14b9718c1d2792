// AdamW's settings and the scalars of one step (decoupled weight decay, bias correction). The
// optimizer that holds the FP32 masters and moments is dist/dist_optimizer.h, for 1..N ranks.
// Invariant: every element is updated by adamw_update() (backend/ops/elementwise.h), a fixed
// sequence of exactly-rounded FP32 operations whose step scalars are rounded once on the host
// here, so every backend's adamw op writes the same bits.
#pragma once

#include <cstdint>

#include "backend/ops/elementwise.h"

namespace packmoe {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // applied to the params registered with weight_decay = true
};

// The scalars of step t (backend/ops/elementwise.h has the struct and the per-element formula).
AdamWStepScalars adamw_step_scalars(const AdamWConfig& cfg, int64_t t);
// The scalars of step t for one param: without weight decay (decay = 1 exactly: norms) unless
// weight_decay, the gradient multiplied by grad_scale (the clip coefficient). The optimizer takes
// its scalars from here.
AdamWStepScalars adamw_param_scalars(const AdamWConfig& cfg, int64_t t, bool weight_decay,
                                     float grad_scale);

}  // namespace packmoe
