// Entries of the elementwise op family (backend/ops/elementwise.h): the segment checks, once, then
// the backend's implementation.
#include "backend/ops/elementwise.h"

#include <string>

#include "backend/backend.h"

namespace packmoe {

Status validate_segments(size_t groups, int64_t n, std::initializer_list<size_t> counts,
                         std::initializer_list<int64_t> lengths, const char* what) {
  if (n < 0) return Status::error(std::string(what) + ": negative segment length");
  for (size_t c : counts)
    if (c != groups)
      return Status::error(std::string(what) + ": " + std::to_string(c) + " segments where " +
                           std::to_string(groups) + " were expected");
  for (int64_t l : lengths)
    if (l != n)
      return Status::error(std::string(what) + ": segments of " + std::to_string(l) + " and " +
                           std::to_string(n) + " elements");
  return Status::ok();
}

namespace ops {

Status cast_f32_to_bf16(Backend& b, const Segments<const float>& src, const Segments<uint16_t>& dst) {
  PACKMOE_RETURN_IF_ERROR(
      validate_segments(src.ptr.size(), src.n, {dst.ptr.size()}, {dst.n}, "cast_f32_to_bf16"));
  return b.kernels().elementwise->cast_f32_to_bf16(b, src, dst);
}

Status add_f32(Backend& b, const Segments<float>& dst, const Segments<const float>& src) {
  PACKMOE_RETURN_IF_ERROR(
      validate_segments(dst.ptr.size(), dst.n, {src.ptr.size()}, {src.n}, "add_f32"));
  return b.kernels().elementwise->add_f32(b, dst, src);
}

Status add_f32_out(Backend& be, const Segments<const float>& a, const Segments<const float>& b,
                   const Segments<float>& out) {
  PACKMOE_RETURN_IF_ERROR(validate_segments(a.ptr.size(), a.n, {b.ptr.size(), out.ptr.size()},
                                            {b.n, out.n}, "add_f32_out"));
  return be.kernels().elementwise->add_f32_out(be, a, b, out);
}

Status adamw(Backend& b, const AdamWArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_segments(
      a.param.ptr.size(), a.param.n,
      {a.exp_avg.ptr.size(), a.exp_avg_sq.ptr.size(), a.grad.ptr.size()},
      {a.exp_avg.n, a.exp_avg_sq.n, a.grad.n}, "adamw"));
  if (!a.bf16.ptr.empty())
    PACKMOE_RETURN_IF_ERROR(validate_segments(a.param.ptr.size(), a.param.n, {a.bf16.ptr.size()},
                                              {a.bf16.n}, "adamw bf16 output"));
  if (a.amax && (a.bf16.ptr.size() != 1 || a.amax_span <= 0 || a.amax_first < 0))
    return Status::error("adamw amax: needs the bf16 output, one segment and amax_span > 0");
  return b.kernels().elementwise->adamw(b, a);
}

Status nvfp4_decode_scales(Backend& b, const float* amax, float* decode, int64_t groups) {
  if (groups < 0) return Status::error("nvfp4_decode_scales: negative group count");
  return b.kernels().elementwise->nvfp4_decode_scales(b, amax, decode, groups);
}

Status sum_squares(Backend& b, const Segments<const float>& x, double* out) {
  PACKMOE_RETURN_IF_ERROR(validate_segments(x.ptr.size(), x.n, {}, {}, "sum_squares"));
  return b.kernels().elementwise->sum_squares(b, x, out);
}

}  // namespace ops
}  // namespace packmoe
