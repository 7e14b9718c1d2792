// AdamW (decoupled weight decay, bias correction) on the FP32 masters of GroupedParams, followed
// by re-quantization of each primary weight. Invariant: every element is updated by adamw_update()
// below, a fixed sequence of exactly-rounded FP32 operations with step scalars rounded once on the
// host, so the CPU path and a CUDA kernel calling the same function produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/hd.h"
#include "nn/grouped_param.h"

namespace packmoe {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// The scalars of step t >= 1, each computed in FP64 and rounded once to FP32:
//   decay      = 1 - lr * weight_decay
//   one_minus_beta1 = 1 - beta1,  one_minus_beta2 = 1 - beta2
//   step_size  = lr / (1 - beta1^t)
//   sqrt_bias_correction2 = sqrt(1 - beta2^t)
struct AdamWStepScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float decay, step_size, sqrt_bias_correction2;
};
AdamWStepScalars adamw_step_scalars(const AdamWConfig& cfg, int64_t t);

// One element, PyTorch's AdamW order, every operation one FP32 rounding (no FMA contraction):
//   p = p * decay
//   m = beta1 * m + one_minus_beta1 * g
//   v = beta2 * v + one_minus_beta2 * (g * g)
//   p = p - step_size * (m / (sqrt(v) / sqrt_bias_correction2 + eps))
PACKMOE_HD void adamw_update(float& p, float& m, float& v, float g, const AdamWStepScalars& s) {
  p = p * s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) / s.sqrt_bias_correction2 + s.eps;
  p = p - s.step_size * (m / denom);
}

// First version: the update runs on the host (HostView: in place on the CPU backend, download /
// upload elsewhere); a device kernel calling adamw_update() comes later.
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
