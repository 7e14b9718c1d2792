// Entries of the quantize op family (backend/ops/quantize.h): the formats' argument checks, once,
// then the backend's implementation. (The CPU implementations are the formats' reference functions,
// which also check their arguments because io/ and the tests call them directly.)
#include "backend/ops/quantize.h"

#include "backend/backend.h"

namespace packmoe {
namespace ops {

Status quantize_mxfp8(Backend& b, const GroupedMatrices& in, const Mxfp8Config& cfg,
                      const Mxfp8Outputs& out) {
  PACKMOE_RETURN_IF_ERROR(validate_mxfp8(in, cfg, out));
  return b.kernels().quantize->quantize_mxfp8(b, in, cfg, out);
}

Status dequantize_mxfp8(Backend& b, const Mxfp8Copy& q, DType out_dtype,
                        const std::vector<void*>& out) {
  PACKMOE_RETURN_IF_ERROR(validate_mxfp8_copy(q, out_dtype, out));
  return b.kernels().quantize->dequantize_mxfp8(b, q, out_dtype, out);
}

Status quantize_nvfp4(Backend& b, const GroupedMatrices& in, const Nvfp4Config& cfg,
                      const Nvfp4Outputs& out) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4(in, cfg, out));
  return b.kernels().quantize->quantize_nvfp4(b, in, cfg, out);
}

Status dequantize_nvfp4(Backend& b, const Nvfp4Copy& q, DType out_dtype,
                        const std::vector<void*>& out) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4_copy(q, out_dtype, out));
  return b.kernels().quantize->dequantize_nvfp4(b, q, out_dtype, out);
}

Status nvfp4_amax(Backend& b, const GroupedMatrices& in, float* amax) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4_amax(in, amax));
  return b.kernels().quantize->nvfp4_amax(b, in, amax);
}

Status weight_2d_columnwise(Backend& b, const Weight2dCopies& w) {
  PACKMOE_RETURN_IF_ERROR(validate_weight_2d_columnwise(w));
  return b.kernels().quantize->weight_2d_columnwise(b, w);
}

Status swizzle_scales(Backend& b, const void* compact, int64_t rows, int64_t cols, bool transpose,
                      void* swizzled) {
  if (rows <= 0 || cols <= 0) return Status::error("swizzle_scales: empty scale matrix");
  return b.kernels().quantize->swizzle_scales(b, compact, rows, cols, transpose, swizzled);
}

}  // namespace ops
}  // namespace packmoe
