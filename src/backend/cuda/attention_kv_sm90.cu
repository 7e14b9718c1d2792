// CUDA attention_kv (backend/ops/model.h): new queries of one sequence over its KV cache, one warp
// per (query, head) row. Invariant: the CPU reference's bytes: each score is an R32 dot product
// (lane l takes d = l, l + 32, ..., then the butterfly), the max runs over keys in order, the
// exponentials' sum and the output's per-d sums use R32 lanes j % 32 in key order and the same
// tree, moe_exp_f32 and --fmad=false; the scores wait in the backend's workspace (Sq, Hq, Skv).
#include <cuda_runtime.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels_common.cuh"
#include "backend/cuda/reduce_order.cuh"
#include "backend/ops/model.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 128;  // 4 warps, one (query, head) row each
  static constexpr int kWarps = kThreads / 32;
};

__global__ void __launch_bounds__(Config::kThreads)
    attention_kv_kernel(const __grid_constant__ AttentionKvArgs a, float* scores) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * Config::kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim;
  if (row >= a.queries * Hq) return;  // the whole warp leaves together
  const int64_t i = row / Hq, h = row % Hq, g = h / (Hq / Hkv);
  const int64_t n = a.keys - a.queries + i + 1;  // keys [0, n)
  const uint16_t* q = a.q + (i * Hq + h) * D;    // (D)
  float* p = scores + row * a.keys;              // (Skv) this row's scores, then exponentials

  float m = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* k = a.k + (j * Hkv + g) * D;  // (D)
    float part = 0.0f;
    for (int64_t d = lane; d < D; d += 32) part = part + bf16_to_f32(q[d]) * bf16_to_f32(k[d]);
    const float s = r32_butterfly(part) * a.scale;
    if (lane == 0) p[j] = s;
    m = (j == 0 || s > m) ? s : m;
  }
  __syncwarp();
  float lsum = 0.0f;  // lane l: keys j = l, l + 32, ... in order
  for (int64_t j = lane; j < n; j += 32) {
    const float e = moe_exp_f32(p[j] - m);
    p[j] = e;
    lsum = lsum + e;
  }
  const float l = r32_butterfly(lsum);
  __syncwarp();
  uint16_t* o = a.o + (i * Hq + h) * D;  // (D)
  for (int64_t d = lane; d < D; d += 32) {
    float acc[32];  // the R32 lanes of this d's sum over keys
#pragma unroll
    for (int u = 0; u < 32; ++u) acc[u] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
#pragma unroll
      for (int u = 0; u < 32; ++u) {
        const int64_t j = j0 + u;
        if (j < n) acc[u] = acc[u] + p[j] * bf16_to_f32(a.v[(j * Hkv + g) * D + d]);
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2)
#pragma unroll
      for (int u = 0; u < off; ++u) acc[u] = acc[u] + acc[u + off];
    o[d] = f32_to_bf16(acc[0] / l);
  }
}

}  // namespace

Status attention_kv_sm90(CudaBackend& be, const AttentionKvArgs& a) {
  const int64_t rows = a.queries * a.q_heads;
  float* scores = static_cast<float*>(be.workspace(static_cast<size_t>(rows * a.keys) * sizeof(float)));
  attention_kv_kernel<<<cuda::blocks_for(rows, Config::kWarps), Config::kThreads, 0, be.stream()>>>(
      a, scores);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
