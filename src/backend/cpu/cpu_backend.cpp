// CPU backend: 64-byte aligned host memory; ops delegate to the formats/ reference code.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "formats/swizzle.h"

namespace packmoe {

// The process-wide CPU backend (base code such as nn/ and io/ allocates host memory from it).
Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

void* CpuBackend::allocate(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  PACKMOE_CHECK(p != nullptr, "out of host memory allocating " << bytes << " bytes");
  return p;
}

void CpuBackend::deallocate(void* ptr) { std::free(ptr); }

void CpuBackend::copy(void* dst, const void* src, size_t bytes, CopyKind) {
  if (bytes) std::memcpy(dst, src, bytes);
}

void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

double CpuBackend::time_ms(const std::function<void()>& body, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) body();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    body();
    auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

Status CpuBackend::quantize_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg,
                                  const Mxfp8Outputs& out) {
  return quantize_mxfp8_cpu(in, cfg, out);
}

Status CpuBackend::dequantize_mxfp8(const Mxfp8Copy& q, DType out_dtype,
                                    const std::vector<void*>& out) {
  return dequantize_mxfp8_cpu(q, out_dtype, out);
}

Status CpuBackend::quantize_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg,
                                  const Nvfp4Outputs& out) {
  return quantize_nvfp4_cpu(in, cfg, out);
}

Status CpuBackend::dequantize_nvfp4(const Nvfp4Copy& q, DType out_dtype,
                                    const std::vector<void*>& out) {
  return dequantize_nvfp4_cpu(q, out_dtype, out);
}

Status CpuBackend::nvfp4_amax(const GroupedMatrices& in, float* amax) {
  return nvfp4_amax_cpu(in, amax);
}

Status CpuBackend::weight_2d_columnwise(const Weight2dCopies& w) {
  return weight_2d_columnwise_cpu(w);
}

Status CpuBackend::swizzle_scales(const void* compact, int64_t rows, int64_t cols, bool transpose,
                                  void* swizzled) {
  if (rows <= 0 || cols <= 0) return Status::error("swizzle_scales: empty scale matrix");
  swizzle_scales_cpu(static_cast<const uint8_t*>(compact), rows, cols, transpose,
                     static_cast<uint8_t*>(swizzled));
  return Status::ok();
}

Status CpuBackend::grouped_gemm(const GroupedGemmArgs& args) { return grouped_gemm_cpu(args); }

Status CpuBackend::router_topk(const RouterTopkArgs& a) { return router_topk_cpu(a); }
Status CpuBackend::router_topk_backward(const RouterTopkBackwardArgs& a) {
  return router_topk_backward_cpu(a);
}
Status CpuBackend::aux_loss(const AuxLossArgs& a) { return aux_loss_cpu(a); }
Status CpuBackend::aux_loss_backward(const AuxLossBackwardArgs& a) { return aux_loss_backward_cpu(a); }
Status CpuBackend::permute(const PermuteArgs& a) { return permute_cpu(a); }
Status CpuBackend::permute_backward(const PermuteBackwardArgs& a) { return permute_backward_cpu(a); }
Status CpuBackend::swiglu(const SwigluArgs& a) { return swiglu_cpu(a); }
Status CpuBackend::swiglu_backward(const SwigluBackwardArgs& a) { return swiglu_backward_cpu(a); }
Status CpuBackend::unpermute(const UnpermuteArgs& a) { return unpermute_cpu(a); }
Status CpuBackend::unpermute_backward(const UnpermuteBackwardArgs& a) {
  return unpermute_backward_cpu(a);
}
Status CpuBackend::routing_plan(const RoutingPlanArgs& a) { return routing_plan_cpu(a); }
Status CpuBackend::cast_f32_to_bf16(const Segments<const float>& src,
                                    const Segments<uint16_t>& dst) {
  return cast_f32_to_bf16_cpu(src, dst);
}
Status CpuBackend::add_f32(const Segments<float>& dst, const Segments<const float>& src) {
  return add_f32_cpu(dst, src);
}
Status CpuBackend::adamw(const AdamWArgs& a) { return adamw_cpu(a); }
Status CpuBackend::nvfp4_decode_scales(const float* amax, float* decode, int64_t groups) {
  return nvfp4_decode_scales_cpu(amax, decode, groups);
}
Status CpuBackend::sum_squares(const Segments<const float>& x, double* out) {
  return sum_squares_cpu(x, out);
}
Status CpuBackend::embedding(const EmbeddingArgs& a) { return embedding_cpu(a); }
Status CpuBackend::embedding_backward(const EmbeddingBackwardArgs& a) {
  return embedding_backward_cpu(a);
}
Status CpuBackend::rms_norm(const RmsNormArgs& a) { return rms_norm_cpu(a); }
Status CpuBackend::rms_norm_backward(const RmsNormBackwardArgs& a) {
  return rms_norm_backward_cpu(a);
}
Status CpuBackend::rope(const RopeArgs& a) { return rope_cpu(a); }
Status CpuBackend::rope_backward(const RopeArgs& a) { return rope_backward_cpu(a); }
Status CpuBackend::attention(const AttentionArgs& a) { return attention_cpu(a); }
Status CpuBackend::attention_backward(const AttentionBackwardArgs& a) {
  return attention_backward_cpu(a);
}
Status CpuBackend::cross_entropy(const CrossEntropyArgs& a) { return cross_entropy_cpu(a); }
Status CpuBackend::cross_entropy_backward(const CrossEntropyBackwardArgs& a) {
  return cross_entropy_backward_cpu(a);
}

}  // namespace packmoe
