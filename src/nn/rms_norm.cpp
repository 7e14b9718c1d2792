// RmsNorm layer over the backend's rms_norm / rms_norm_backward ops.
#include "nn/rms_norm.h"

#include "nn/layer_ops.h"

namespace packmoe {

RmsNorm::RmsNorm(Backend& backend, Layout layout, float eps, const Tensor& init)
    : backend_(&backend),
      eps_(eps),
      param_(backend, QuantRecipe{Recipe::kBF16, false, 0}, PrimaryWeight::kHighPrecision, layout,
             as_single_group(init)) {}

Tensor RmsNorm::forward(const Tensor& x) { return run_forward(x, DType::kF32); }

Tensor RmsNorm::forward_bf16(const Tensor& x) { return run_forward(x, DType::kBF16); }

Tensor RmsNorm::backward(const Tensor& dy) { return run_backward(dy, nullptr); }

Tensor RmsNorm::backward(const Tensor& dy, const Tensor& residual_grad) {
  return run_backward(dy, &residual_grad);
}

Tensor RmsNorm::run_forward(const Tensor& x, DType dtype) {
  const int64_t D = dim();
  PACKMOE_CHECK(x.dtype() == DType::kF32 && x.dim(-1) == D,
                "RmsNorm forward: x must be F32 with last dim " << D << ", got "
                                                               << shape_string(x.shape()));
  const int64_t N = x.numel() / D;
  x_ = x;
  rstd_ = Tensor::empty(*backend_, DType::kF32, {N});
  Tensor y = Tensor::empty(*backend_, dtype, x.shape());
  RmsNormArgs a;
  a.rows = N;
  a.dim = D;
  a.eps = eps_;
  a.x = x.data_as<const float>();
  a.weight = f32_weight(param_);
  if (dtype == DType::kBF16)
    a.y_bf16 = y.data_as<uint16_t>();
  else
    a.y = y.data_as<float>();
  a.rstd = rstd_.data_as<float>();
  check_op(ops::rms_norm(*backend_, a), "rms_norm");
  return y;
}

Tensor RmsNorm::run_backward(const Tensor& dy, const Tensor* residual_grad) {
  const int64_t D = dim();
  PACKMOE_CHECK(x_.data() != nullptr, "RmsNorm backward without a forward");
  PACKMOE_CHECK(dy.dtype() == DType::kF32 && dy.numel() == x_.numel(),
                "RmsNorm backward: dy must be F32 shaped like x");
  PACKMOE_CHECK(!residual_grad ||
                    (residual_grad->dtype() == DType::kF32 && residual_grad->numel() == x_.numel()),
                "RmsNorm backward: residual_grad must be F32 shaped like x");
  const int64_t N = x_.numel() / D;
  Tensor dx = Tensor::empty(*backend_, DType::kF32, x_.shape());
  // The op writes dweight: straight into a main_grad of stale values, else a sum to add.
  const bool overwrite = param_.take_grad_write() == GradWrite::kOverwrite;
  const Tensor dweight = overwrite ? Tensor::view(f32_grad(param_), DType::kF32, {D},
                                                  backend_->device())
                                   : Tensor::empty(*backend_, DType::kF32, {D});
  RmsNormBackwardArgs a;
  a.rows = N;
  a.dim = D;
  a.x = x_.data_as<const float>();
  a.weight = f32_weight(param_);
  a.rstd = rstd_.data_as<const float>();
  a.dy = dy.data_as<const float>();
  a.dx = dx.data_as<float>();
  a.dweight = dweight.data_as<float>();
  if (residual_grad) a.dresidual = residual_grad->data_as<const float>();
  check_op(ops::rms_norm_backward(*backend_, a), "rms_norm_backward");
  if (!overwrite)
    add_into(*backend_, Tensor::view(f32_grad(param_), DType::kF32, {D}, backend_->device()),
             dweight);
  release();
  return dx;
}

void RmsNorm::release() { x_ = rstd_ = Tensor{}; }

}  // namespace packmoe
