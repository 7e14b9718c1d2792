// DenseMlp forward / backward over two BF16 linears and the swiglu ops.
#include "nn/dense_mlp.h"

#include "nn/layer_ops.h"

namespace packmoe {

DenseMlp::DenseMlp(Backend& backend, Layout layout, bool grad_accum_fusion, const Tensor& gate_up,
                   const Tensor& down)
    : backend_(&backend),
      gate_up_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(gate_up)),
      down_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(down)) {}

Tensor DenseMlp::forward(const Tensor& x) {
  const int64_t T = x.dim(0);
  h_ = gate_up_.forward(x, {T});  // (T, 2I)
  Tensor y = down_.forward(swiglu(), {T});  // (T, H)
  if (recompute_swiglu_) down_.release_input();
  return y;
}

Tensor DenseMlp::swiglu() const {
  const int64_t T = h_.dim(0), I = down_.param().k();
  Tensor a = Tensor::empty(*backend_, DType::kBF16, {T, I});
  SwigluArgs s;
  s.rows = T;
  s.ffn = I;
  s.in_dtype = DType::kF32;
  s.in = h_.data();
  s.out_dtype = DType::kBF16;
  s.out = a.data();
  check_op(ops::swiglu(*backend_, s), "swiglu");
  return a;
}

void DenseMlp::release() {
  gate_up_.release_input();
  down_.release_input();
  h_ = Tensor{};
}

Tensor DenseMlp::backward(const Tensor& dy) {
  Backend& b = *backend_;
  PACKMOE_CHECK(h_.data() != nullptr, "DenseMlp backward without a forward");
  const int64_t T = h_.dim(0), I = down_.param().k();
  if (recompute_swiglu_) down_.restore_input(swiglu());
  const Tensor da = down_.backward(to_bf16(b, dy), GradAccum::kAccumulate);  // (T, I) F32
  const Tensor dh = Tensor::empty(b, DType::kBF16, {T, 2 * I});
  SwigluBackwardArgs s;
  s.rows = T;
  s.ffn = I;
  s.in_dtype = DType::kF32;
  s.in = h_.data();
  s.dout_dtype = DType::kF32;
  s.dout = da.data();
  s.din_dtype = DType::kBF16;
  s.din = dh.data();
  check_op(ops::swiglu_backward(b, s), "swiglu_backward");
  h_ = Tensor{};
  return gate_up_.backward(dh, GradAccum::kAccumulate);  // (T, H)
}

}  // namespace packmoe
