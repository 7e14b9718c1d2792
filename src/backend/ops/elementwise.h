// Elementwise ops over segment lists: a grouped buffer is one packed allocation or E separate
// ones, so every op takes G pointers of `n` elements each and runs as one call over all of them.
// Invariant: each element's result is the exact FP32 arithmetic written here (no FMA), so the CPU
// and CUDA backends write the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/hd.h"
#include "core/status.h"
#include "core/tensor.h"

namespace packmoe {

// G segments of n elements: ptr[g] .. ptr[g] + n.
template <typename T>
struct Segments {
  std::vector<T*> ptr;
  int64_t n = 0;
};

// One segment: n elements at p, or a whole tensor (its data as T, numel elements).
template <typename T>
Segments<T> one_segment(T* p, int64_t n) {
  return Segments<T>{{p}, n};
}
template <typename T>
Segments<T> one_segment(const Tensor& t) {
  return one_segment(static_cast<T*>(t.data()), t.numel());
}

// The scalars of AdamW step t >= 1, each computed in FP64 and rounded once to FP32:
//   decay = 1 - lr * weight_decay; one_minus_beta{1,2} = 1 - beta{1,2};
//   step_size = lr / (1 - beta1^t); sqrt_bias_correction2 = sqrt(1 - beta2^t)
// grad_scale multiplies the gradient first (global grad-norm clipping: min(1, max_norm / (norm +
// 1e-6)), 1 when not clipping, which leaves every bit unchanged).
struct AdamWStepScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float decay, step_size, sqrt_bias_correction2;
  float grad_scale = 1.0f;
};

// One element, PyTorch's AdamW order, every operation one FP32 rounding (no FMA contraction):
//   g = g * grad_scale
//   p = p * decay
//   m = beta1 * m + one_minus_beta1 * g
//   v = beta2 * v + one_minus_beta2 * (g * g)
//   p = p - step_size * (m / (sqrt(v) / sqrt_bias_correction2 + eps))
PACKMOE_HD void adamw_update(float& p, float& m, float& v, float g, const AdamWStepScalars& s) {
  g = g * s.grad_scale;
  p = p * s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) / s.sqrt_bias_correction2 + s.eps;
  p = p - s.step_size * (m / denom);
}

struct AdamWArgs {
  AdamWStepScalars scalars;
  Segments<float> param;       // FP32 master, updated in place
  Segments<float> exp_avg;     // m, in place
  Segments<float> exp_avg_sq;  // v, in place
  Segments<const float> grad;  // main_grad
  // Optional (no pointers: none): bf16[i] = f32_to_bf16(updated param[i]) (RNE), the bytes
  // cast_f32_to_bf16 of the updated param would write, in the same pass.
  Segments<uint16_t> bf16;
  // Optional, with bf16 and ONE segment (null: none): for each element i of the segment,
  // amax[(amax_first + i) / amax_span] = the NaN-ignoring max of itself and |bf16[i]|
  // (formats/mxfp8_math.h amax_update), amax zeroed by the caller: an NVFP4 weight's per-expert
  // amax (amax_span = N * K elements per expert, amax_first = the segment's first element in the
  // packed param) from the pass that writes its BF16 image, so the quantizer need not read it again.
  float* amax = nullptr;
  int64_t amax_span = 0, amax_first = 0;
};

// Sum of squares for the global gradient norm, in FP64 (each x * x is exact in FP64: 24-bit
// significands multiply into 48 bits). Each segment is cut into chunks of kSumSquaresChunk
// elements (the last may be shorter); a chunk's sum is the R32 sum of reduce_order.h over its
// elements' squares, in FP64. The chunk sums, in (segment, chunk) order, are cut into groups of
// kSumSquaresGroup (the last may be shorter); a group's sum is the R32 sum of its chunk sums; the
// result is the R32 sum of the group sums. All in FP64. Zero segments or n = 0 give +0. (The
// chunk is short enough that a 100M-parameter model's gradient has thousands of chunks for the
// GPU's warps to share; the groups keep every sequential chain short for a 3B model's 10^5 or so
// chunks; with at most kSumSquaresGroup chunks the last level adds +0 to the one group sum.)
inline constexpr int64_t kSumSquaresChunk = 4096;
inline constexpr int64_t kSumSquaresGroup = 1024;

// Same segment count and length everywhere; touches no memory.
Status validate_segments(size_t groups, int64_t n, std::initializer_list<size_t> counts,
                         std::initializer_list<int64_t> lengths, const char* what);

// CPU reference (host pointers).
Status cast_f32_to_bf16_cpu(const Segments<const float>& src, const Segments<uint16_t>& dst);
Status add_f32_cpu(const Segments<float>& dst, const Segments<const float>& src);  // dst += src
// out = a + b (out may be a or b: each element is read before it is written).
Status add_f32_out_cpu(const Segments<const float>& a, const Segments<const float>& b,
                       const Segments<float>& out);
Status adamw_cpu(const AdamWArgs& args);
// out[0] = the sum of squares above (out is host memory here).
Status sum_squares_cpu(const Segments<const float>& x, double* out);
// decode[g] = nvfp4_decode_scale(amax[g]) for g < groups.
Status nvfp4_decode_scales_cpu(const float* amax, float* decode, int64_t groups);

// ---- entries: validate once, then run the backend's implementation (backend/ops/elementwise.cpp)
class Backend;
namespace ops {
Status cast_f32_to_bf16(Backend& b, const Segments<const float>& src, const Segments<uint16_t>& dst);
Status add_f32(Backend& b, const Segments<float>& dst, const Segments<const float>& src);
// out = a + b, out-of-place (the residual stream: no copy of a first).
Status add_f32_out(Backend& be, const Segments<const float>& a, const Segments<const float>& b,
                   const Segments<float>& out);
Status adamw(Backend& b, const AdamWArgs& args);
// decode[g] = nvfp4_decode_scale(amax[g]) for g < groups (the backend's memory).
Status nvfp4_decode_scales(Backend& b, const float* amax, float* decode, int64_t groups);
// out[0] (the backend's memory) = the sum of squares above.
Status sum_squares(Backend& b, const Segments<const float>& x, double* out);
}  // namespace ops

// One device's implementation of the family; every pointer is set (backend/cpu/cpu_kernels.cpp,
// backend/cuda/cuda_kernels.cu). Arguments arrive validated.
struct ElementwiseKernels {
  Status (*cast_f32_to_bf16)(Backend&, const Segments<const float>&, const Segments<uint16_t>&);
  Status (*add_f32)(Backend&, const Segments<float>&, const Segments<const float>&);
  Status (*add_f32_out)(Backend&, const Segments<const float>&, const Segments<const float>&,
                        const Segments<float>&);
  Status (*adamw)(Backend&, const AdamWArgs&);
  Status (*nvfp4_decode_scales)(Backend&, const float*, float*, int64_t);
  Status (*sum_squares)(Backend&, const Segments<const float>&, double*);
};

}  // namespace packmoe
