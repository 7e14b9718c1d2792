// Learning-rate schedule: linear warmup, then cosine decay to min_lr, then constant min_lr
// (Megatron's OptimizerParamScheduler with decay style "cosine" and init lr 0). Invariant: a pure
// function of the optimizer step number, so a resumed run gets exactly the lr it would have had.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace packmoe::train {

struct LrSchedule {
  double lr = 3e-3;       // peak, reached at the end of warmup
  double min_lr = 3e-4;   // floor of the cosine
  int64_t warmup_steps = 0;
  int64_t decay_steps = 1;  // the step at which the cosine reaches min_lr

  // lr of optimizer step `step` (steps count from 1; the first update is step 1):
  //   step <= W:            lr * step / W                                   (W = warmup_steps)
  //   W < step <= D:        min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (step - W) / (D - W)))
  //   step > max(W, D):     min_lr                                          (D = decay_steps)
  // computed in FP64. Step W gives lr, step D gives min_lr. With D <= W the cosine is empty.
  double at(int64_t step) const;
};

// Finite, 0 <= min_lr <= lr, warmup_steps >= 0, decay_steps >= 1; errors name the field.
Status validate(const LrSchedule& schedule);

}  // namespace packmoe::train
