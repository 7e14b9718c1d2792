// CPU reference of the elementwise ops (backend/ops/elementwise.h), OpenMP over segments and elements.
#include <algorithm>
#include <string>
#include <vector>

#include "backend/ops/elementwise.h"
#include "backend/reduce_order.h"
#include "core/codecs.h"
#include "formats/mxfp8_math.h"
#include "formats/nvfp4_math.h"

namespace packmoe {

Status cast_f32_to_bf16_cpu(const Segments<const float>& src, const Segments<uint16_t>& dst) {
  const int64_t groups = static_cast<int64_t>(src.ptr.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < src.n; ++i) dst.ptr[g][i] = f32_to_bf16(src.ptr[g][i]);
  return Status::ok();
}

Status add_f32_cpu(const Segments<float>& dst, const Segments<const float>& src) {
  const int64_t groups = static_cast<int64_t>(dst.ptr.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < dst.n; ++i) dst.ptr[g][i] = dst.ptr[g][i] + src.ptr[g][i];
  return Status::ok();
}

Status add_f32_out_cpu(const Segments<const float>& a, const Segments<const float>& b,
                       const Segments<float>& out) {
  const int64_t groups = static_cast<int64_t>(out.ptr.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < out.n; ++i) out.ptr[g][i] = a.ptr[g][i] + b.ptr[g][i];
  return Status::ok();
}

Status adamw_cpu(const AdamWArgs& a) {
  const int64_t groups = static_cast<int64_t>(a.param.ptr.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < a.param.n; ++i)
      adamw_update(a.param.ptr[g][i], a.exp_avg.ptr[g][i], a.exp_avg_sq.ptr[g][i], a.grad.ptr[g][i],
                   a.scalars);
  if (!a.bf16.ptr.empty())
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < a.param.n; ++i) {
        a.bf16.ptr[g][i] = f32_to_bf16(a.param.ptr[g][i]);
        if (a.amax) {
          float& slot = a.amax[(a.amax_first + i) / a.amax_span];
          slot = amax_update(slot, bf16_to_f32(a.bf16.ptr[g][i]));
        }
      }
  return Status::ok();
}

Status sum_squares_cpu(const Segments<const float>& x, double* out) {
  const int64_t chunks_per_segment = (x.n + kSumSquaresChunk - 1) / kSumSquaresChunk;
  const int64_t chunks = static_cast<int64_t>(x.ptr.size()) * chunks_per_segment;
  std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = x.ptr[c / chunks_per_segment] + (c % chunks_per_segment) * kSumSquaresChunk;
    const int64_t n = std::min(kSumSquaresChunk, x.n - (c % chunks_per_segment) * kSumSquaresChunk);
    partial[c] = sum_r32<double>(n, [&](int64_t i) {
      const double v = p[i];
      return v * v;
    });
  }
  const int64_t groups = (chunks + kSumSquaresGroup - 1) / kSumSquaresGroup;
  *out = sum_r32<double>(groups, [&](int64_t g) {
    const int64_t first = g * kSumSquaresGroup;
    return sum_r32<double>(std::min(kSumSquaresGroup, chunks - first),
                           [&](int64_t c) { return partial[first + c]; });
  });
  return Status::ok();
}

Status nvfp4_decode_scales_cpu(const float* amax, float* decode, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) decode[g] = nvfp4_decode_scale(amax[g]);
  return Status::ok();
}

}  // namespace packmoe
