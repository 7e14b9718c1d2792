// AdamW over GroupedParams: host scalars, the per-group elementwise update, re-quantization.
#include "optim/adamw.h"

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

void AdamW::add(GroupedParam& param) {
  const GroupedStorage& master = param.master();
  ParamState st{&param,
                GroupedStorage(master.memory(), master.layout(), master.groups(),
                               master.bytes_per_group()),
                GroupedStorage(master.memory(), master.layout(), master.groups(),
                               master.bytes_per_group())};
  st.exp_avg.zero();
  st.exp_avg_sq.zero();
  states_.push_back(std::move(st));
}

void AdamW::step() {
  for (const ParamState& st : states_)
    PACKMOE_CHECK(st.param->grad_state() == GradState::kSettled,
                  "AdamW step with a delayed wgrad pending: run backward_dw first");
  ++t_;
  const AdamWStepScalars s = adamw_step_scalars(cfg_, t_);
  for (ParamState& st : states_) {
    GroupedStorage& master = st.param->master();
    const GroupedStorage& grad = st.param->main_grad();
    const size_t bytes = master.bytes_per_group();
    const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
    for (int64_t e = 0; e < master.groups(); ++e) {
      HostView p(master.memory(), master.group(e), bytes, HostView::Access::kReadWrite);
      HostView g(grad.memory(), grad.group(e), bytes, HostView::Access::kRead);
      HostView m(st.exp_avg.memory(), st.exp_avg.group(e), bytes, HostView::Access::kReadWrite);
      HostView v(st.exp_avg_sq.memory(), st.exp_avg_sq.group(e), bytes,
                 HostView::Access::kReadWrite);
      float* pp = p.as<float>();
      const float* gp = g.as<float>();
      float* mp = m.as<float>();
      float* vp = v.as<float>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) adamw_update(pp[i], mp[i], vp[i], gp[i], s);
    }
    st.param->requantize_from_master();
  }
}

}  // namespace packmoe
