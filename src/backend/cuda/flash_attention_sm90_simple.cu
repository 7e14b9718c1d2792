// The shape checks, the backward preprocessing kernel and the simple exact FP32 attention path
// (flash_attention_sm90_simple.h). The simple kernels are plain CUDA (no tensor cores): one thread
// per output row, a fixed loop order, two passes over the keys (max, then sums), so the result of
// a row never depends on the other rows or on B.
#include <cmath>
#include <limits>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/flash_attention_sm90_simple.h"

namespace packmoe::cuda {
namespace {

constexpr int kMaxSimpleDim = 256;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float bf16_to_float(uint16_t x) {
  return __uint_as_float(static_cast<uint32_t>(x) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16(float x) {  // round to nearest even (finite x)
  const uint32_t u = __float_as_uint(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct SimpleArgs {
  int B, S, Hq, Hkv, D, group, S_pad;
  float scale;
};

// Dot product of two BF16 rows of length D in FP32, fixed order.
__device__ __forceinline__ float dot_bf16(const uint16_t* a, const uint16_t* b, int D) {
  float s = 0.0f;
  for (int d = 0; d < D; ++d) s = __fmaf_rn(bf16_to_float(a[d]), bf16_to_float(b[d]), s);
  return s;
}

__global__ void simple_forward_kernel(SimpleArgs a, const uint16_t* q, const uint16_t* k,
                                      const uint16_t* v, const int32_t* doc, uint16_t* o,
                                      float* lse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.B) * a.Hq * a.S) return;
  const int i = static_cast<int>(idx % a.S), h = static_cast<int>(idx / a.S % a.Hq);
  const int b = static_cast<int>(idx / a.S / a.Hq), g = h / a.group;
  const uint16_t* qi = q + ((static_cast<int64_t>(b) * a.S + i) * a.Hq + h) * a.D;
  const int j0 = doc ? doc[static_cast<int64_t>(b) * a.S + i] : 0;
  auto krow = [&](const uint16_t* t, int j) {
    return t + ((static_cast<int64_t>(b) * a.S + j) * a.Hkv + g) * a.D;
  };
  float mx = -INFINITY;
  for (int j = j0; j <= i; ++j) mx = fmaxf(mx, dot_bf16(qi, krow(k, j), a.D) * a.scale);
  float acc[kMaxSimpleDim];
  for (int d = 0; d < a.D; ++d) acc[d] = 0.0f;
  float sum = 0.0f;
  for (int j = j0; j <= i; ++j) {
    const float p = expf(dot_bf16(qi, krow(k, j), a.D) * a.scale - mx);
    sum += p;
    const uint16_t* vj = krow(v, j);
    for (int d = 0; d < a.D; ++d) acc[d] = __fmaf_rn(p, bf16_to_float(vj[d]), acc[d]);
  }
  uint16_t* oi = o + ((static_cast<int64_t>(b) * a.S + i) * a.Hq + h) * a.D;
  for (int d = 0; d < a.D; ++d) oi[d] = float_to_bf16(acc[d] / sum);
  lse[(static_cast<int64_t>(b) * a.Hq + h) * a.S + i] = mx + logf(sum);
}

// One warp per (b, h, row of S_pad): lanes take D / 32 strided elements, then a fixed shuffle tree.
__global__ void preprocess_kernel(SimpleArgs a, const uint16_t* o, const uint16_t* dout,
                                  const float* lse, const int32_t* doc, float* dl, float* lse2,
                                  int32_t* doc_pad) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(a.B) * a.Hq * a.S_pad) return;
  const int i = static_cast<int>(row % a.S_pad), h = static_cast<int>(row / a.S_pad % a.Hq);
  const int b = static_cast<int>(row / a.S_pad / a.Hq);
  float s = 0.0f;
  if (i < a.S) {
    const int64_t off = ((static_cast<int64_t>(b) * a.S + i) * a.Hq + h) * a.D;
    for (int d = lane; d < a.D; d += 32)
      s = __fmaf_rn(bf16_to_float(o[off + d]), bf16_to_float(dout[off + d]), s);
  }
  for (int x = 16; x > 0; x /= 2) s += __shfl_xor_sync(0xffffffffu, s, x);
  if (lane != 0) return;
  const int64_t lrow = (static_cast<int64_t>(b) * a.Hq + h) * a.S;
  dl[row] = s;
  lse2[row] = i < a.S ? lse[lrow + i] * kLog2e : INFINITY;
  if (h == 0)
    doc_pad[static_cast<int64_t>(b) * a.S_pad + i] =
        doc ? doc[static_cast<int64_t>(b) * a.S + min(i, a.S - 1)] : 0;
}

// dQ: one thread per (b, h, i).
__global__ void simple_dq_kernel(SimpleArgs a, const uint16_t* q, const uint16_t* k,
                                 const uint16_t* v, const uint16_t* dout, const float* dl,
                                 const float* lse2, const int32_t* doc_pad, float* dq) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.B) * a.Hq * a.S) return;
  const int i = static_cast<int>(idx % a.S), h = static_cast<int>(idx / a.S % a.Hq);
  const int b = static_cast<int>(idx / a.S / a.Hq), g = h / a.group;
  const int64_t qoff = ((static_cast<int64_t>(b) * a.S + i) * a.Hq + h) * a.D;
  const int64_t prow = (static_cast<int64_t>(b) * a.Hq + h) * a.S_pad + i;
  const float l2 = lse2[prow], di = dl[prow];
  float acc[kMaxSimpleDim];
  for (int d = 0; d < a.D; ++d) acc[d] = 0.0f;
  for (int j = doc_pad[static_cast<int64_t>(b) * a.S_pad + i]; j <= i; ++j) {
    const int64_t koff = ((static_cast<int64_t>(b) * a.S + j) * a.Hkv + g) * a.D;
    const float p = exp2f(dot_bf16(q + qoff, k + koff, a.D) * a.scale * kLog2e - l2);
    const float ds = p * (dot_bf16(dout + qoff, v + koff, a.D) - di);
    for (int d = 0; d < a.D; ++d) acc[d] = __fmaf_rn(ds, bf16_to_float(k[koff + d]), acc[d]);
  }
  for (int d = 0; d < a.D; ++d) dq[qoff + d] = acc[d] * a.scale;
}

// dK, dV: one thread per (b, g, j); query heads of the group, then queries, in order.
__global__ void simple_dkv_kernel(SimpleArgs a, const uint16_t* q, const uint16_t* k,
                                  const uint16_t* v, const uint16_t* dout, const float* dl,
                                  const float* lse2, const int32_t* doc_pad, float* dk, float* dv) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.B) * a.Hkv * a.S) return;
  const int j = static_cast<int>(idx % a.S), g = static_cast<int>(idx / a.S % a.Hkv);
  const int b = static_cast<int>(idx / a.S / a.Hkv);
  const int64_t koff = ((static_cast<int64_t>(b) * a.S + j) * a.Hkv + g) * a.D;
  float acc_k[kMaxSimpleDim], acc_v[kMaxSimpleDim];
  for (int d = 0; d < a.D; ++d) acc_k[d] = acc_v[d] = 0.0f;
  for (int h = g * a.group; h < (g + 1) * a.group; ++h)
    for (int i = j; i < a.S && doc_pad[static_cast<int64_t>(b) * a.S_pad + i] <= j; ++i) {
      const int64_t qoff = ((static_cast<int64_t>(b) * a.S + i) * a.Hq + h) * a.D;
      const int64_t prow = (static_cast<int64_t>(b) * a.Hq + h) * a.S_pad + i;
      const float p = exp2f(dot_bf16(q + qoff, k + koff, a.D) * a.scale * kLog2e - lse2[prow]);
      const float ds = p * (dot_bf16(dout + qoff, v + koff, a.D) - dl[prow]);
      for (int d = 0; d < a.D; ++d) {
        acc_v[d] = __fmaf_rn(p, bf16_to_float(dout[qoff + d]), acc_v[d]);
        acc_k[d] = __fmaf_rn(ds, bf16_to_float(q[qoff + d]), acc_k[d]);
      }
    }
  for (int d = 0; d < a.D; ++d) {
    dk[koff + d] = acc_k[d] * a.scale;
    dv[koff + d] = acc_v[d];
  }
}

SimpleArgs simple_args(const FlashAttentionShape& s) {
  return {static_cast<int>(s.batch),
          static_cast<int>(s.seq),
          static_cast<int>(s.q_heads),
          static_cast<int>(s.kv_heads),
          static_cast<int>(s.head_dim),
          static_cast<int>(s.q_heads / s.kv_heads),
          static_cast<int>((s.seq + 127) / 128 * 128),
          s.scale};
}

unsigned blocks(int64_t threads, int per_block) {
  return static_cast<unsigned>((threads + per_block - 1) / per_block);
}

}  // namespace

Status flash_check_shape(const FlashAttentionShape& s) {
  if (s.batch < 0 || s.seq < 0 || s.q_heads <= 0 || s.kv_heads <= 0 || s.q_heads % s.kv_heads != 0)
    return Status::error("flash attention: q_heads (" + std::to_string(s.q_heads) +
                         ") must be a positive multiple of kv_heads (" +
                         std::to_string(s.kv_heads) + ")");
  if (s.head_dim <= 0 || s.head_dim > kMaxSimpleDim || s.head_dim % 2 != 0)
    return Status::error("flash attention: head_dim " + std::to_string(s.head_dim) +
                         " unsupported (even, at most 256)");
  if (!(s.scale > 0.0f) || !std::isfinite(s.scale))
    return Status::error("flash attention: scale must be positive and finite");
  const int64_t padded = (s.seq + 127) / 128 * 128;
  if (s.batch * padded * s.q_heads * s.head_dim >= (int64_t{1} << 31) ||
      s.batch * s.q_heads * padded >= (int64_t{1} << 31) / 32)
    return Status::error("flash attention: tensors past 2^31 elements are unsupported");
  return Status::ok();
}

void flash_backward_preprocess(const FlashAttentionShape& s, const uint16_t* o,
                               const uint16_t* dout, const float* lse, const int32_t* doc_start,
                               float* dl, float* lse2, int32_t* doc_pad, cudaStream_t stream) {
  const SimpleArgs a = simple_args(s);
  const int64_t threads = int64_t{32} * a.B * a.Hq * a.S_pad;
  preprocess_kernel<<<blocks(threads, 256), 256, 0, stream>>>(a, o, dout, lse, doc_start, dl, lse2,
                                                              doc_pad);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

void flash_simple_forward(const FlashAttentionShape& s, const uint16_t* q, const uint16_t* k,
                          const uint16_t* v, const int32_t* doc_start, uint16_t* o, float* lse,
                          cudaStream_t stream) {
  const SimpleArgs a = simple_args(s);
  simple_forward_kernel<<<blocks(int64_t{a.B} * a.Hq * a.S, 128), 128, 0, stream>>>(
      a, q, k, v, doc_start, o, lse);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

void flash_simple_backward(const FlashAttentionShape& s, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, const uint16_t* dout, const float* dl,
                           const float* lse2, const int32_t* doc_pad, float* dq, float* dk,
                           float* dv, cudaStream_t stream) {
  const SimpleArgs a = simple_args(s);
  simple_dq_kernel<<<blocks(int64_t{a.B} * a.Hq * a.S, 128), 128, 0, stream>>>(a, q, k, v, dout, dl,
                                                                               lse2, doc_pad, dq);
  PACKMOE_CUDA_CHECK_LAUNCH();
  simple_dkv_kernel<<<blocks(int64_t{a.B} * a.Hkv * a.S, 128), 128, 0, stream>>>(
      a, q, k, v, dout, dl, lse2, doc_pad, dk, dv);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace packmoe::cuda
