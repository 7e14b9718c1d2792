// AdamW step scalars: computed in FP64 on the host, rounded once to FP32.
#include "optim/adamw.h"

#include <cmath>

#include "core/check.h"

namespace packmoe {

AdamWStepScalars adamw_step_scalars(const AdamWConfig& cfg, int64_t t) {
  PACKMOE_CHECK(t >= 1, "AdamW steps count from 1");
  const double lr = cfg.lr, b1 = cfg.beta1, b2 = cfg.beta2;
  AdamWStepScalars s;
  s.beta1 = cfg.beta1;
  s.beta2 = cfg.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - b1);
  s.one_minus_beta2 = static_cast<float>(1.0 - b2);
  s.eps = cfg.eps;
  s.decay = static_cast<float>(1.0 - lr * static_cast<double>(cfg.weight_decay));
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, static_cast<double>(t))));
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(1.0 - std::pow(b2, static_cast<double>(t))));
  return s;
}

AdamWStepScalars adamw_param_scalars(const AdamWConfig& cfg, int64_t t, bool weight_decay,
                                     float grad_scale) {
  AdamWConfig c = cfg;
  if (!weight_decay) c.weight_decay = 0.0f;
  AdamWStepScalars s = adamw_step_scalars(c, t);
  s.grad_scale = grad_scale;
  return s;
}

}  // namespace packmoe
