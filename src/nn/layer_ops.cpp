// Helpers of nn/layer_ops.h: each is one backend op over the whole tensor.
#include "nn/layer_ops.h"

namespace packmoe {
Tensor to_bf16(Backend& b, const Tensor& x) {
  PACKMOE_CHECK(x.dtype() == DType::kF32, "to_bf16 expects F32");
  Tensor y = Tensor::empty(b, DType::kBF16, x.shape());
  check_op(ops::cast_f32_to_bf16(b, one_segment<const float>(x), one_segment<uint16_t>(y)), "cast to bf16");
  return y;
}

void add_into(Backend& b, const Tensor& dst, const Tensor& src) {
  PACKMOE_CHECK(dst.dtype() == DType::kF32 && src.dtype() == DType::kF32 &&
                    dst.numel() == src.numel(),
                "add_into: F32 tensors of equal size, got " << shape_string(dst.shape()) << " and "
                                                            << shape_string(src.shape()));
  check_op(ops::add_f32(b, one_segment<float>(dst), one_segment<const float>(src)), "add");
}

Tensor add(Backend& b, const Tensor& x, const Tensor& y) {
  PACKMOE_CHECK(x.dtype() == DType::kF32 && y.dtype() == DType::kF32 && x.numel() == y.numel(),
                "add: F32 tensors of equal size, got " << shape_string(x.shape()) << " and "
                                                       << shape_string(y.shape()));
  Tensor out = Tensor::empty(b, DType::kF32, x.shape());
  check_op(ops::add_f32_out(b, one_segment<const float>(x), one_segment<const float>(y),
                            one_segment<float>(out)),
           "add");
  return out;
}

Tensor as_single_group(const Tensor& w) {
  PACKMOE_CHECK(w.rank() == 1 || w.rank() == 2, "a dense weight is 1-D or 2-D");
  return w.rank() == 1 ? w.reshaped({1, 1, w.dim(0)}) : w.reshaped({1, w.dim(0), w.dim(1)});
}

GroupedLinearConfig dense_linear_config(Layout layout, bool grad_accum_fusion) {
  GroupedLinearConfig c;
  c.recipe = QuantRecipe{Recipe::kBF16, false, 0};
  c.primary = PrimaryWeight::kHighPrecision;
  c.layout = layout;
  c.grad_accum_fusion = grad_accum_fusion;
  c.delay_wgrad = false;
  c.out_dtype = DType::kF32;
  return c;
}

const float* f32_weight(const GroupedParam& p) {
  PACKMOE_CHECK(p.experts() == 1, "f32_weight of a multi-group param");
  return static_cast<const float*>(p.fp32_weight().group(0));
}

float* f32_grad(const GroupedParam& p) {
  PACKMOE_CHECK(p.experts() == 1, "f32_grad of a multi-group param");
  return static_cast<float*>(p.main_grad().group(0));
}

}  // namespace packmoe
