// AdamW (decoupled weight decay, bias correction) on the FP32 masters of GroupedParams, followed
// by re-quantization of each primary weight. Invariant: every element is updated by adamw_update()
// (backend/elementwise.h), a fixed sequence of exactly-rounded FP32 operations whose step scalars
// are rounded once on the host, so every backend's adamw op writes the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/elementwise.h"
#include "nn/grouped_param.h"

namespace packmoe {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// The scalars of step t (backend/elementwise.h has the struct and the per-element formula).
AdamWStepScalars adamw_step_scalars(const AdamWConfig& cfg, int64_t t);

// The update of a param is ONE backend adamw call over its E groups (either layout), in the
// memory of the param's backend.
class AdamW {
 public:
  explicit AdamW(const AdamWConfig& cfg) : cfg_(cfg) {}

  // Registers a param that has its master. Its moments exp_avg and exp_avg_sq, (E, N, K) F32
  // zeros, live in the param's memory and layout.
  void add(GroupedParam& param);
  // t += 1; for every param: master updated from main_grad (needs no pending wgrad), then
  // requantize_from_master().
  void step();
  int64_t steps() const { return t_; }

 private:
  struct ParamState {
    GroupedParam* param;
    GroupedStorage exp_avg;     // (E, N, K) F32
    GroupedStorage exp_avg_sq;  // (E, N, K) F32
  };
  AdamWConfig cfg_;
  int64_t t_ = 0;
  std::vector<ParamState> states_;
};

}  // namespace packmoe
