// AdamW over GroupedParams: host scalars, one backend adamw call per param, re-quantization.
#include "optim/adamw.h"

#include <cmath>

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

void AdamW::add(GroupedParam& param, bool weight_decay) {
  const GroupedStorage& master = param.master();
  ParamState st{&param, weight_decay,
                GroupedStorage(master.memory(), master.layout(), master.groups(),
                               master.bytes_per_group()),
                GroupedStorage(master.memory(), master.layout(), master.groups(),
                               master.bytes_per_group())};
  st.exp_avg.zero();
  st.exp_avg_sq.zero();
  states_.push_back(std::move(st));
}

void AdamW::set_steps(int64_t t) {
  PACKMOE_CHECK(t >= 0, "AdamW step count " << t << " is negative");
  t_ = t;
}

void AdamW::step(float grad_scale) {
  for (const ParamState& st : states_)
    PACKMOE_CHECK(st.param->grad_state() == GradState::kSettled,
                  "AdamW step with a delayed wgrad pending: run backward_dw first");
  ++t_;
  for (ParamState& st : states_) {
    const GroupedStorage& master = st.param->master();
    AdamWArgs a;
    a.scalars = adamw_param_scalars(cfg_, t_, st.weight_decay, grad_scale);
    a.param = segments<float>(master);
    a.exp_avg = segments<float>(st.exp_avg);
    a.exp_avg_sq = segments<float>(st.exp_avg_sq);
    a.grad = segments<const float>(st.param->main_grad());
    check_op(ops::adamw(master.memory(), a), "adamw");
    st.param->requantize_from_master();
  }
}

}  // namespace packmoe
