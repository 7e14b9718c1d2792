// CUDA causal GQA attention core (backend/ops/model.h), forward and backward, writing the CPU
// reference's bytes. head_dim <= 128: the tiled kernels of attention_sm90_kernels.cuh (register
// blocked exact R32 dots, lane-by-lane passes over keys); larger head_dim (<= 512): one warp per
// output row with 32 partial vectors in shared memory. Both are exact; on an H200 the tiled ones
// run the forward 17-20x and the backward 6-8x faster (bench/attention.cpp, D = 128). Invariant:
// --fmad=false, no atomics, every reduction in backend/ops/model.h's order.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/cuda/attention_sm90_kernels.cuh"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels_common.cuh"
#include "backend/ops/model.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;  // Dl kernel: 8 warps, one row each
  static constexpr int kWarps = kThreads / 32;
  // One-warp-per-row kernels: 32 R32 partial vectors of D floats per warp in shared memory (the
  // R32 sums over keys / query pairs), and q / k rows as kPer = ceil(D / 32) registers per lane.
  static constexpr int kMaxHeadDim = 512;
  static constexpr int kAttnSmemTarget = 64 * 1024;  // per CTA; one warp may exceed it
  static constexpr int kAttnMaxWarps = 8;
  static_assert(kMoeReduceLanes == 32, "R32 is one warp");
  static_assert(kMaxHeadDim % 32 == 0 && kMaxHeadDim / 32 <= 16, "kPer stays in registers");
  static_assert(attn::kMaxHeadDim <= kMaxHeadDim, "the tiled kernels cover a prefix of head_dim");
};

constexpr unsigned kFullMask = 0xFFFFFFFFu;
using cuda::blocks_for;

// R32 second stage on one warp (lane l adds lane l ^ off, off = 16 .. 1): lanes below off form
// backend/ops/moe.h's tree, the others the same sums with swapped operands, so every lane ends with the
// tree's value.
__device__ __forceinline__ float r32_butterfly(float acc) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) acc = acc + __shfl_xor_sync(kFullMask, acc, off);
  return acc;
}

// Two independent butterflies interleaved (their shuffles overlap).
__device__ __forceinline__ void r32_butterfly2(float& a, float& b) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    const float oa = __shfl_xor_sync(kFullMask, a, off);
    const float ob = __shfl_xor_sync(kFullMask, b, off);
    a = a + oa;
    b = b + ob;
  }
}

// ---- one warp per row (head_dim > attn::kMaxHeadDim) --------------------------------------------
//
// One warp per output row. Lane l owns dims d = l + 32 t (t < kPer): dot products over d are R32
// by construction (strided partial, butterfly), and every lane then holds the same score, so the
// sequential max and the exponentials are computed redundantly in each lane. The R32 sums over
// keys (or query pairs) n of vectors keep 32 partial vectors acc[n % 32][d] in shared memory
// (each lane touches only its own d: no synchronisation), reduced by the tree at the end.

struct AttnDims {
  int64_t S, Hq, Hkv, D, group;
  __device__ int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * Hq + h) * D; }
  __device__ int64_t kv(int64_t b, int64_t j, int64_t g) const {
    return ((b * S + j) * Hkv + g) * D;
  }
  __device__ int64_t row(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * S + i; }
};

template <int kPer>
__device__ __forceinline__ void load_row(const float* p, int D, int lane, float (&v)[kPer]) {
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + 32 * t;
    v[t] = d < D ? __ldg(p + d) : 0.0f;
  }
}

// Lane partial of R32 sum_d a[d] * b[d] (b from global memory).
template <int kPer>
__device__ __forceinline__ float dot_partial(const float (&a)[kPer], const float* b, int D,
                                             int lane) {
  float acc = 0.0f;
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + 32 * t;
    if (d < D) acc = acc + a[t] * __ldg(b + d);
  }
  return acc;
}

template <int kPer>
__device__ __forceinline__ void acc_zero(float* acc, int D, int lane) {
  for (int c = 0; c < 32; ++c)
#pragma unroll
    for (int t = 0; t < kPer; ++t)
      if (lane + 32 * t < D) acc[c * D + lane + 32 * t] = 0.0f;
}

// acc[n % 32][d] += w * x[d]; x given per lane as registers.
template <int kPer>
__device__ __forceinline__ void acc_add(float* acc, int64_t n, float w, const float (&x)[kPer],
                                        int D, int lane) {
  float* row = acc + (n & 31) * D;
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + 32 * t;
    if (d < D) row[d] = row[d] + w * x[t];
  }
}

// The tree over the 32 partial vectors (acc[c] += acc[c + off] for c < off); the sum lands in
// acc[0].
template <int kPer>
__device__ __forceinline__ void acc_tree(float* acc, int D, int lane) {
  for (int off = 16; off >= 1; off /= 2)
    for (int c = 0; c < off; ++c)
#pragma unroll
      for (int t = 0; t < kPer; ++t) {
        const int d = lane + 32 * t;
        if (d < D) acc[c * D + d] = acc[c * D + d] + acc[(c + off) * D + d];
      }
}

// Global warp -> query row, longest rows (largest i) first; consecutive warps take consecutive
// heads of one (b, i), so a GQA group's warps read the same keys.
struct QueryRow {
  int64_t b, h, i;
};
__device__ __forceinline__ bool query_row(int64_t warp, int64_t B, int64_t Hq, int64_t S,
                                          QueryRow& r) {
  if (warp >= B * Hq * S) return false;
  const int64_t bh = warp % (B * Hq);
  r = QueryRow{bh / Hq, bh % Hq, S - 1 - warp / (B * Hq)};
  return true;
}

__device__ __forceinline__ int64_t global_warp() {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

template <int kPer>
__global__ void __launch_bounds__(Config::kAttnMaxWarps * 32)
    attention_kernel(const __grid_constant__ AttentionArgs a) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31;
  QueryRow r;
  if (!query_row(global_warp(), a.batch, a.q_heads, a.seq, r)) return;
  const AttnDims L{a.seq, a.q_heads, a.kv_heads, a.head_dim, a.q_heads / a.kv_heads};
  const int D = static_cast<int>(a.head_dim);
  const int64_t g = r.h / L.group;
  float* acc = smem + (threadIdx.x >> 5) * 32 * D;  // (32, D) R32 partials over keys
  float q[kPer];
  load_row(a.q + L.q(r.b, r.i, r.h), D, lane, q);
  auto score = [&](int64_t j) {
    return r32_butterfly(dot_partial(q, a.k + L.kv(r.b, j, g), D, lane)) * a.scale;
  };
  float m = 0.0f;
  for (int64_t j = 0; j <= r.i; ++j) {
    const float s = score(j);
    m = (j == 0 || s > m) ? s : m;
  }
  acc_zero<kPer>(acc, D, lane);
  float lsum = 0.0f;  // R32 lane `lane` of l: the keys j with j % 32 == lane
  for (int64_t j = 0; j <= r.i; ++j) {
    const float p = moe_exp_f32(score(j) - m);
    if ((j & 31) == lane) lsum = lsum + p;
    float v[kPer];
    load_row(a.v + L.kv(r.b, j, g), D, lane, v);
    acc_add(acc, j, p, v, D, lane);
  }
  const float l = r32_butterfly(lsum);
  acc_tree<kPer>(acc, D, lane);
  float* o = a.o + L.q(r.b, r.i, r.h);  // (D)
#pragma unroll
  for (int t = 0; t < kPer; ++t)
    if (lane + 32 * t < D) o[lane + 32 * t] = acc[lane + 32 * t] / l;
  if (lane == 0) {
    a.row_max[L.row(r.b, r.h, r.i)] = m;
    a.row_sum[L.row(r.b, r.h, r.i)] = l;
  }
}

// Dl_i = R32 sum_d do_i[d] * o_i[d], one warp per row, stored in (B, Hq, S) order.
__global__ void __launch_bounds__(Config::kThreads)
    attention_dl_kernel(const __grid_constant__ AttentionBackwardArgs a, float* dl) {
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  const int64_t S = a.seq, Hq = a.q_heads, D = a.head_dim;
  if (w >= a.batch * Hq * S) return;
  const int64_t b = w / (Hq * S), h = (w / S) % Hq, i = w % S;
  const int64_t off = ((b * S + i) * Hq + h) * D;
  float acc = 0.0f;
  for (int64_t d = lane; d < D; d += 32) acc = acc + a.dout[off + d] * a.o[off + d];
  acc = r32_butterfly(acc);
  if (lane == 0) dl[w] = acc;
}

// P_ij and dS_ij (backend/ops/model.h) from the lane partials of q_i . k_j and do_i . v_j.
struct PairTerms {
  float P, dS;
};
__device__ __forceinline__ PairTerms pair_terms(float qk, float dov, float scale, float row_max,
                                                float row_sum, float dl) {
  r32_butterfly2(qk, dov);
  const float P = moe_exp_f32(qk * scale - row_max) / row_sum;
  return PairTerms{P, P * (dov - dl)};
}

// dq_i = (R32 sum_{j <= i} dS_ij k_j) * scale, one warp per query row.
template <int kPer>
__global__ void __launch_bounds__(Config::kAttnMaxWarps * 32)
    attention_dq_kernel(const __grid_constant__ AttentionBackwardArgs a, const float* dl) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31;
  QueryRow r;
  if (!query_row(global_warp(), a.batch, a.q_heads, a.seq, r)) return;
  const AttnDims L{a.seq, a.q_heads, a.kv_heads, a.head_dim, a.q_heads / a.kv_heads};
  const int D = static_cast<int>(a.head_dim);
  const int64_t g = r.h / L.group, row = L.row(r.b, r.h, r.i);
  float* acc = smem + (threadIdx.x >> 5) * 32 * D;  // (32, D)
  float q[kPer], dout[kPer];
  load_row(a.q + L.q(r.b, r.i, r.h), D, lane, q);
  load_row(a.dout + L.q(r.b, r.i, r.h), D, lane, dout);
  const float row_max = a.row_max[row], row_sum = a.row_sum[row], dl_i = dl[row];
  acc_zero<kPer>(acc, D, lane);
  for (int64_t j = 0; j <= r.i; ++j) {
    const float* k = a.k + L.kv(r.b, j, g);
    const PairTerms pt =
        pair_terms(dot_partial(q, k, D, lane), dot_partial(dout, a.v + L.kv(r.b, j, g), D, lane),
                   a.scale, row_max, row_sum, dl_i);
    float kr[kPer];
    load_row(k, D, lane, kr);
    acc_add(acc, j, pt.dS, kr, D, lane);
  }
  acc_tree<kPer>(acc, D, lane);
  float* dq = a.dq + L.q(r.b, r.i, r.h);  // (D)
#pragma unroll
  for (int t = 0; t < kPer; ++t)
    if (lane + 32 * t < D) dq[lane + 32 * t] = acc[lane + 32 * t] * a.scale;
}

// dk_j, dv_j: one warp per (b, KV head g, key j), longest (smallest j) first; the pairs n = (h, i)
// run h ascending over g's query heads, then i = j .. S-1, R32 over n.
template <int kPer>
__global__ void __launch_bounds__(Config::kAttnMaxWarps * 32)
    attention_dkv_kernel(const __grid_constant__ AttentionBackwardArgs a, const float* dl) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31;
  const int64_t w = global_warp();
  const int64_t BG = a.batch * a.kv_heads, S = a.seq;
  if (w >= BG * S) return;
  const int64_t j = w / BG, b = (w % BG) / a.kv_heads, g = w % a.kv_heads;
  const AttnDims L{S, a.q_heads, a.kv_heads, a.head_dim, a.q_heads / a.kv_heads};
  const int D = static_cast<int>(a.head_dim);
  float* acc_k = smem + (threadIdx.x >> 5) * 64 * D;  // (32, D)
  float* acc_v = acc_k + 32 * D;                      // (32, D)
  float k[kPer], v[kPer];
  load_row(a.k + L.kv(b, j, g), D, lane, k);
  load_row(a.v + L.kv(b, j, g), D, lane, v);
  acc_zero<kPer>(acc_k, D, lane);
  acc_zero<kPer>(acc_v, D, lane);
  int64_t n = 0;
  for (int64_t h = g * L.group; h < (g + 1) * L.group; ++h)
    for (int64_t i = j; i < S; ++i, ++n) {
      float q[kPer], dout[kPer];
      load_row(a.q + L.q(b, i, h), D, lane, q);
      load_row(a.dout + L.q(b, i, h), D, lane, dout);
      float qk = 0.0f, dov = 0.0f;
#pragma unroll
      for (int t = 0; t < kPer; ++t)
        if (lane + 32 * t < D) {
          qk = qk + q[t] * k[t];
          dov = dov + dout[t] * v[t];
        }
      const int64_t row = L.row(b, h, i);
      const PairTerms pt = pair_terms(qk, dov, a.scale, a.row_max[row], a.row_sum[row], dl[row]);
      acc_add(acc_k, n, pt.dS, q, D, lane);
      acc_add(acc_v, n, pt.P, dout, D, lane);
    }
  acc_tree<kPer>(acc_k, D, lane);
  acc_tree<kPer>(acc_v, D, lane);
  float* dk = a.dk + L.kv(b, j, g);  // (D)
  float* dv = a.dv + L.kv(b, j, g);  // (D)
#pragma unroll
  for (int t = 0; t < kPer; ++t) {
    const int d = lane + 32 * t;
    if (d < D) {
      dk[d] = acc_k[d] * a.scale;
      dv[d] = acc_v[d];
    }
  }
}

// Calls f(std::integral_constant<int, kPer>) with the smallest kPer in {1, 2, 4, 8, 16} such that
// 32 kPer >= D (D <= kMaxHeadDim, checked by the caller).
template <typename F>
void with_per_lane(int64_t D, F&& f) {
  if (D <= 32)
    f(std::integral_constant<int, 1>{});
  else if (D <= 64)
    f(std::integral_constant<int, 2>{});
  else if (D <= 128)
    f(std::integral_constant<int, 4>{});
  else if (D <= 256)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 16>{});
}

Status check_head_dim(const char* op, int64_t D) {
  if (D > Config::kMaxHeadDim)
    return Status::error(std::string(op) + ": D (head_dim) = " + std::to_string(D) +
                         " exceeds the CUDA kernel's limit of " +
                         std::to_string(Config::kMaxHeadDim));
  return Status::ok();
}

// Launches `kernel` with one warp per row and `vectors` (32, D) partial arrays per warp in dynamic
// shared memory, as many warps per CTA as fit the target.
template <typename Kernel, typename Args>
void launch_attn(CudaBackend& be, Kernel kernel, int64_t rows, int64_t D, int vectors,
                 const Args& a, const float* dl) {
  const size_t per_warp =
      static_cast<size_t>(vectors) * 32 * static_cast<size_t>(D) * sizeof(float);
  int warps = static_cast<int>(Config::kAttnSmemTarget / per_warp);
  warps = warps < 1 ? 1 : warps > Config::kAttnMaxWarps ? Config::kAttnMaxWarps : warps;
  const size_t smem = per_warp * warps;
  if (smem > 48 * 1024)
    PACKMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
  if constexpr (std::is_same_v<Args, AttentionArgs>)
    kernel<<<blocks_for(rows, warps), warps * 32, smem, be.stream()>>>(a);
  else
    kernel<<<blocks_for(rows, warps), warps * 32, smem, be.stream()>>>(a, dl);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

// ---- tiled kernels: dispatch --------------------------------------------------------------------

// Calls f(attn::Geo<Dp>{}) for the smallest padded head dim Dp holding D (D <= 128).
template <typename F>
void with_geo(int64_t D, F&& f) {
  if (D <= 16)
    f(attn::Geo<16>{});
  else if (D <= 32)
    f(attn::Geo<32>{});
  else if (D <= 64)
    f(attn::Geo<64>{});
  else
    f(attn::Geo<128>{});
}

// Heads per CTA: the largest power of two dividing the GQA group, at most 8 (so >= 8 positions).
int heads_per_cta(int64_t Hq, int64_t Hkv) {
  const int64_t group = Hq / Hkv;
  int hc = 1;
  while (hc < 8 && group % (2 * hc) == 0) hc *= 2;
  return hc;
}

// One tiled launch: 256 threads, dynamic shared memory above the 48 KB default (the attribute is
// set on every call: it is per device and costs a host call, not a device operation).
template <auto kKernel, typename Params>
void launch_tiled(CudaBackend& be, int64_t blocks, int smem_floats, const Params& p) {
  const size_t smem = static_cast<size_t>(smem_floats) * sizeof(float);
  PACKMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  kKernel<<<static_cast<unsigned>(blocks), attn::kThreads, smem, be.stream()>>>(p);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

template <typename P>
void fill_query_tiling(P& p, int64_t B, int64_t S, int64_t Hq, int64_t Hkv) {
  p.heads_per_cta = heads_per_cta(Hq, Hkv);
  p.pos_per_cta = attn::kRows / p.heads_per_cta;
  p.i_tiles = static_cast<int>((S + p.pos_per_cta - 1) / p.pos_per_cta);
  p.head_blocks = static_cast<int>(Hq / p.heads_per_cta);
}

bool tiled(int64_t D) { return D <= attn::kMaxHeadDim; }

}  // namespace

Status attention_sm90(CudaBackend& be, const AttentionArgs& a) {
  PACKMOE_RETURN_IF_ERROR(check_head_dim("attention", a.head_dim));
  if (tiled(a.head_dim)) {
    attn::FwdParams p{};
    p.a = a;
    fill_query_tiling(p, a.batch, a.seq, a.q_heads, a.kv_heads);
    const int64_t blocks = static_cast<int64_t>(p.i_tiles) * a.batch * p.head_blocks;
    with_geo(a.head_dim, [&](auto geo) {
      using G = decltype(geo);
      launch_tiled<attn::attention_fwd_kernel<G::kDp>>(be, blocks, attn::FwdSmem<G>::kFloats, p);
    });
    return Status::ok();
  }
  const int64_t rows = a.batch * a.q_heads * a.seq;
  with_per_lane(a.head_dim, [&](auto per) {
    launch_attn(be, attention_kernel<decltype(per)::value>, rows, a.head_dim, 1, a, nullptr);
  });
  return Status::ok();
}

Status attention_backward_sm90(CudaBackend& be, const AttentionBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(check_head_dim("attention_backward", a.head_dim));
  const int64_t rows = a.batch * a.q_heads * a.seq;
  auto* dl =
      static_cast<float*>(be.workspace(static_cast<size_t>(rows) * sizeof(float)));  // (B, Hq, S)
  attention_dl_kernel<<<blocks_for(rows, Config::kWarps), Config::kThreads, 0, be.stream()>>>(a,
                                                                                              dl);
  PACKMOE_CUDA_CHECK_LAUNCH();
  if (tiled(a.head_dim)) {
    attn::BwdParams p{};
    p.a = a;
    p.dl = dl;
    fill_query_tiling(p, a.batch, a.seq, a.q_heads, a.kv_heads);
    const int64_t keys_per_tile = 32 * attn::DkvSmem<attn::Geo<16>>::kBR;
    p.u_tiles = static_cast<int>((a.seq + keys_per_tile - 1) / keys_per_tile);
    const int64_t dq_blocks = static_cast<int64_t>(p.i_tiles) * a.batch * p.head_blocks;
    const int64_t dkv_blocks = static_cast<int64_t>(p.u_tiles) * a.batch * a.kv_heads * 32;
    with_geo(a.head_dim, [&](auto geo) {
      using G = decltype(geo);
      launch_tiled<attn::attention_dq_kernel<G::kDp>>(be, dq_blocks, attn::DqSmem<G>::kFloats, p);
      constexpr int kDkvFloats = attn::DkvSmem<G>::kFloats;
      launch_tiled<attn::attention_dkv_kernel<G::kDp>>(be, dkv_blocks, kDkvFloats, p);
    });
    return Status::ok();
  }
  with_per_lane(a.head_dim, [&](auto per) {
    constexpr int kPer = decltype(per)::value;
    launch_attn(be, attention_dq_kernel<kPer>, rows, a.head_dim, 1, a, dl);
    launch_attn(be, attention_dkv_kernel<kPer>, a.batch * a.kv_heads * a.seq, a.head_dim, 2, a, dl);
  });
  return Status::ok();
}

}  // namespace packmoe
