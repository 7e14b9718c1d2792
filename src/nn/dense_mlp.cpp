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
  Backend& b = *backend_;
  const int64_t T = x.dim(0), I = down_.param().k();
  h_ = gate_up_.forward(x, {T});  // (T, 2I)
  const Tensor a = Tensor::empty(b, DType::kBF16, {T, I});
  SwigluArgs s;
  s.rows = T;
  s.ffn = I;
  s.in_dtype = DType::kF32;
  s.in = h_.data();
  s.out_dtype = DType::kBF16;
  s.out = a.data();
  check_op(ops::swiglu(b, s), "swiglu");
  return down_.forward(a, {T});  // (T, H)
}

Tensor DenseMlp::backward(const Tensor& dy) {
  Backend& b = *backend_;
  PACKMOE_CHECK(h_.data() != nullptr, "DenseMlp backward without a forward");
  const int64_t T = h_.dim(0), I = down_.param().k();
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
