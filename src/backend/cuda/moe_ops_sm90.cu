// CUDA kernels of the MoE non-GEMM ops (backend/ops/moe.h): router softmax / top-k, aux loss,
// permute, SwiGLU, unpermute + combine, forward and backward. Invariant: every value is the exact
// FP32 arithmetic of backend/ops/moe.h (moe_exp_f32, R32 = warp-strided lanes + xor butterfly, sequential
// sums over k, nvcc --fmad=false), so each op writes the CPU reference's bytes. Index arrays that
// the CPU checks with PACKMOE_CHECK trap the kernel here (the next sync aborts the process).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/reduce_order.cuh"
#include "backend/ops/moe.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;               // every kernel: 8 warps
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kChunk = 8;                   // elements per thread in the row kernels
  static constexpr int kAuxExperts = 8;              // experts per CTA in the pbar column sums
  static constexpr int kAuxSmemBins = 8 * 1024;  // k * E counters privatised in shared memory
  static_assert(kThreads == kAuxExperts * 32, "pbar CTA: 8 experts x 32 R32 lanes");
};

unsigned grid_for(int64_t n, int64_t per) {
  const int64_t b = (n + per - 1) / per;
  PACKMOE_CHECK(b > 0 && b < (int64_t{1} << 31), "grid of " << b << " blocks is too large");
  return static_cast<unsigned>(b);
}

bool aligned_to(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

// Calls f with a null pointer whose type is float (F32) or uint16_t (BF16 bits), so a generic
// lambda can pick the kernel instantiation of a run-time dtype.
template <typename F>
void with_elem(DType t, F&& f) {
  if (t == DType::kF32)
    f(static_cast<float*>(nullptr));
  else
    f(static_cast<uint16_t*>(nullptr));
}
template <typename Tag>
using elem_t = std::remove_pointer_t<Tag>;

// ---- element codecs: BF16 widens exactly, narrows once with the shared RNE f32_to_bf16 ----------

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return bf16_to_f32(v);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return f32_to_bf16(v);
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

// A chunk is Config::kChunk = 8 consecutive elements of one row (the last chunk of a row may be
// shorter: `valid`). kVec: the chunk is full and 16-byte aligned, so it moves as one or two
// 16-byte accesses (8 BF16 = 16 B, 8 F32 = 32 B).
template <typename T, bool kVec>
__device__ __forceinline__ void load_chunk(const T* p, float (&v)[Config::kChunk], int valid) {
  if constexpr (kVec) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    if constexpr (std::is_same_v<T, float>) {
      const uint4 a = __ldg(q);
      const uint4 b = __ldg(q + 1);
      v[0] = __uint_as_float(a.x), v[1] = __uint_as_float(a.y);
      v[2] = __uint_as_float(a.z), v[3] = __uint_as_float(a.w);
      v[4] = __uint_as_float(b.x), v[5] = __uint_as_float(b.y);
      v[6] = __uint_as_float(b.z), v[7] = __uint_as_float(b.w);
    } else {
      const uint4 a = __ldg(q);
      v[0] = bf16_lo(a.x), v[1] = bf16_hi(a.x), v[2] = bf16_lo(a.y), v[3] = bf16_hi(a.y);
      v[4] = bf16_lo(a.z), v[5] = bf16_hi(a.z), v[6] = bf16_lo(a.w), v[7] = bf16_hi(a.w);
    }
  } else {
#pragma unroll
    for (int j = 0; j < Config::kChunk; ++j) v[j] = j < valid ? to_f32(p[j]) : 0.0f;
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store_chunk(T* p, const float (&v)[Config::kChunk], int valid) {
  if constexpr (kVec) {
    uint4* q = reinterpret_cast<uint4*>(p);
    if constexpr (std::is_same_v<T, float>) {
      q[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                        __float_as_uint(v[3]));
      q[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                        __float_as_uint(v[7]));
    } else {
      q[0] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]),
                        pack_bf16(v[6], v[7]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < Config::kChunk; ++j)
      if (j < valid) p[j] = from_f32<T>(v[j]);
  }
}

// Flat thread index -> (row, chunk) of a (rows, cols) matrix cut into 8-element chunks.
struct ChunkPos {
  int64_t row;
  int64_t col;  // first element of the chunk
  int valid;
};
__device__ __forceinline__ bool chunk_pos(int64_t rows, int64_t cols, ChunkPos& pos) {
  const int64_t cpr = (cols + Config::kChunk - 1) / Config::kChunk;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cpr) return false;
  pos.row = i / cpr;
  pos.col = (i - pos.row * cpr) * Config::kChunk;
  const int64_t left = cols - pos.col;
  pos.valid = left < Config::kChunk ? static_cast<int>(left) : Config::kChunk;
  return true;
}

// ---- router top-k --------------------------------------------------------------------------------

// Candidate of a warp arg-max: (key, idx), idx < 0 = none. `better` is the CPU's order: key
// descending, then index ascending; being total on distinct indices, an xor butterfly leaves the
// same winner in every lane whatever the pairing.
struct Cand {
  float key;
  int idx;
  float val;  // carried along (the probability of the pick)
};
__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  if (a.idx < 0) return false;
  if (b.idx < 0) return true;
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}
__device__ __forceinline__ Cand warp_best(Cand c) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    Cand o;
    o.key = __shfl_xor_sync(kFullMask, c.key, off);
    o.idx = __shfl_xor_sync(kFullMask, c.idx, off);
    o.val = __shfl_xor_sync(kFullMask, c.val, off);
    if (better(o, c)) c = o;
  }
  return c;
}
// NaN probabilities sort below every probability (moe_ops_cpu.cpp's topk_key).
__device__ __forceinline__ float topk_key(float p) { return p == p ? p : -1.0f; }

// One warp per token. kPer > 0: the row lives in registers (E <= 32 kPer, element i of lane l is
// expert l + 32 i); kPer == 0: any E, the lane's own probs entries in global memory serve as the
// row (each lane only ever re-reads what it wrote itself).
template <int kPer>
__global__ void __launch_bounds__(Config::kThreads)
    router_topk_kernel(const __grid_constant__ RouterTopkArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (t >= a.tokens) return;  // whole warps leave together
  const int E = static_cast<int>(a.experts);
  const int k = static_cast<int>(a.top_k);
  const float* z = a.logits + t * E;  // (E)
  float* p = a.probs + t * E;         // (E)
  constexpr int kRegs = kPer > 0 ? kPer : 1;
  float v[kRegs];

  // m: the CPU's sequential `m = z[e] > m ? z[e] : m` from z[0] is z[0] when that is NaN, else the
  // FIRST expert holding the maximum of the non-NaN values (strict >), signed zero included.
  Cand mc{0.0f, -1, 0.0f};
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      v[i] = e < E ? z[e] : 0.0f;
      if (e < E && v[i] == v[i] && (mc.idx < 0 || v[i] > mc.key)) mc = Cand{v[i], e, 0.0f};
    }
  } else {
    for (int e = lane; e < E; e += 32) {
      const float x = z[e];
      if (x == x && (mc.idx < 0 || x > mc.key)) mc = Cand{x, e, 0.0f};
    }
  }
  mc = warp_best(mc);
  const float z0 = z[0];
  const float m = z0 != z0 ? z0 : mc.key;

  // x = e^(z - m); s = R32 sum (lane l adds experts l, l + 32, ... in order, from +0).
  float acc = 0.0f;
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < E) {
        v[i] = moe_exp_f32(v[i] - m);
        acc = acc + v[i];
      }
  } else {
    for (int e = lane; e < E; e += 32) {
      const float x = moe_exp_f32(z[e] - m);
      p[e] = x;
      acc = acc + x;
    }
  }
  const float s = r32_butterfly(acc);
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (e < E) {
        v[i] = v[i] / s;
        p[e] = v[i];
      }
    }
  } else {
    for (int e = lane; e < E; e += 32) p[e] = p[e] / s;
  }

  // Pick j = the best expert strictly after pick j - 1 in the total order, like the CPU's
  // selection sort; all lanes know every pick after the butterfly.
  int32_t* idx = a.idx + t * k;  // (k)
  float* w = a.w + t * k;        // (k)
  Cand prev{0.0f, -1, 0.0f};
  float sum = 0.0f;  // sequential sum_j p_j, identical in every lane
  for (int j = 0; j < k; ++j) {
    Cand c{0.0f, -1, 0.0f};
    auto consider = [&](int e, float pe) {
      const float key = topk_key(pe);
      if (j > 0 && !(key < prev.key || (key == prev.key && e > prev.idx))) return;
      if (c.idx < 0 || key > c.key) c = Cand{key, e, pe};  // e ascends within a lane
    };
    if constexpr (kPer > 0) {
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (lane + 32 * i < E) consider(lane + 32 * i, v[i]);
    } else {
      for (int e = lane; e < E; e += 32) consider(e, p[e]);
    }
    c = warp_best(c);
    prev = c;
    sum = sum + c.val;
    if (lane == 0) {
      idx[j] = c.idx;
      w[j] = c.val;
    }
  }
  if (a.norm_topk_prob) {
    __syncwarp();  // orders lane 0's w stores before the other lanes read them
    for (int j = lane; j < k; j += 32) w[j] = w[j] / sum;
  }
}

// One warp per token. The k-term scalars (S, c, d) are sequential over j, so every lane computes
// them redundantly from broadcast loads; the E outputs are lane-strided.
__global__ void __launch_bounds__(Config::kThreads)
    router_topk_backward_kernel(const __grid_constant__ RouterTopkBackwardArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (t >= a.tokens) return;
  const int E = static_cast<int>(a.experts);
  const int k = static_cast<int>(a.top_k);
  const float* p = a.probs + t * E;      // (E)
  const int32_t* idx = a.idx + t * k;    // (k)
  const float* dw = a.dw + t * k;        // (k)
  float* dz = a.dlogits + t * E;         // (E)
  for (int j = 0; j < k; ++j)
    if (idx[j] < 0 || idx[j] >= E) __trap();
  float sum = 0.0f, c = 0.0f, d = 0.0f;
  if (a.norm_topk_prob) {
    for (int j = 0; j < k; ++j) sum = sum + p[idx[j]];
    for (int j = 0; j < k; ++j) c = c + dw[j] * (p[idx[j]] / sum);
    for (int j = 0; j < k; ++j) d = d + ((dw[j] - c) / sum) * p[idx[j]];
  } else {
    for (int j = 0; j < k; ++j) d = d + dw[j] * p[idx[j]];
  }
  for (int e = lane; e < E; e += 32) dz[e] = p[e] * -d;
  __syncwarp();  // the selected experts' values below replace the ones just stored
  for (int j = lane; j < k; j += 32) {
    const float g = a.norm_topk_prob ? (dw[j] - c) / sum : dw[j];
    dz[idx[j]] = p[idx[j]] * (g - d);
  }
}

// ---- aux loss ------------------------------------------------------------------------------------

// Workspace of the aux-loss forward: cnt (k, E) and a CTA ticket, zeroed before the launch; pbar
// (E) written by the CTAs.
struct AuxWorkspace {
  uint32_t* cnt;     // (k * E)
  uint32_t* ticket;  // (1)
  float* pbar;       // (E)
};

// Histogram of idx into `cnt`: per (j, e) when per_choice, else per e. Shared-memory bins when
// they fit (integer sums are order-free, so privatisation changes nothing).
__device__ void aux_histogram(const int32_t* idx, int64_t T, int64_t E, int64_t k, bool per_choice,
                              bool smem_bins, uint32_t* bins_smem, uint32_t* cnt) {
  const int64_t bins = per_choice ? k * E : E;
  const int64_t slots = T * k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (smem_bins) {
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) bins_smem[b] = 0;
    __syncthreads();
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < slots;
       i += stride) {
    const int32_t e = idx[i];
    if (e < 0 || e >= E) __trap();
    const int64_t b = per_choice ? (i % k) * E + e : e;
    if (smem_bins)
      atomicAdd(&bins_smem[b], 1u);
    else
      atomicAdd(&cnt[b], 1u);
  }
  if (smem_bins) {
    __syncthreads();
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x)
      if (bins_smem[b]) atomicAdd(&cnt[b], bins_smem[b]);
  }
}

// CTA b: histogram share, then pbar of experts [8 b, 8 b + 8): thread (y, x) is R32 lane y of
// expert 8 b + x, so a warp reads 4 rows x 32 contiguous bytes. The last CTA to finish forms aux.
__global__ void __launch_bounds__(Config::kThreads)
    aux_loss_kernel(const __grid_constant__ AuxLossArgs a, AuxWorkspace ws, bool smem_bins) {
  extern __shared__ uint32_t bins_smem[];
  __shared__ float red[32][Config::kAuxExperts + 1];
  __shared__ bool is_last;
  const int64_t T = a.tokens, E = a.experts, k = a.top_k;
  aux_histogram(a.idx, T, E, k, /*per_choice=*/true, smem_bins, bins_smem, ws.cnt);

  const int x = threadIdx.x % Config::kAuxExperts;
  const int y = threadIdx.x / Config::kAuxExperts;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * Config::kAuxExperts + x;
  float acc = 0.0f;
  if (e < E) {
    int64_t t = y;
    // Four loads in flight ahead of the four dependent adds.
    for (; t + 96 < T; t += 128) {
      const float p0 = __ldg(a.probs + t * E + e);
      const float p1 = __ldg(a.probs + (t + 32) * E + e);
      const float p2 = __ldg(a.probs + (t + 64) * E + e);
      const float p3 = __ldg(a.probs + (t + 96) * E + e);
      acc = acc + p0;
      acc = acc + p1;
      acc = acc + p2;
      acc = acc + p3;
    }
    for (; t < T; t += 32) acc = acc + __ldg(a.probs + t * E + e);
  }
  red[y][x] = acc;
  __syncthreads();
  for (int off = 16; off >= 1; off /= 2) {  // backend/ops/moe.h's tree, lane[y] += lane[y + off]
    if (y < off) red[y][x] = red[y][x] + red[y + off][x];
    __syncthreads();
  }
  if (y == 0 && e < E) ws.pbar[e] = red[0][x] / static_cast<float>(T);

  // Last-CTA pattern: every thread fences its global writes (pbar, cnt atomics) before the ticket.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ws.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last || threadIdx.x >= 32) return;
  __threadfence();
  const int lane = threadIdx.x;
  float sum = 0.0f;
  for (int64_t i = lane; i < k * E; i += 32) {
    // L2 reads (ld.cg): other CTAs wrote these, this SM's L1 may not have seen them.
    const float f = static_cast<float>(__ldcg(ws.cnt + i)) / static_cast<float>(T);
    sum = sum + f * __ldcg(ws.pbar + i % E);
  }
  sum = r32_butterfly(sum);
  if (lane == 0) *a.aux = static_cast<float>(E) * sum;
}

// Backward, pass 1: cnt_e over all tokens (a grid-wide dependency of pass 2).
__global__ void __launch_bounds__(Config::kThreads)
    aux_count_kernel(const int32_t* idx, int64_t T, int64_t E, int64_t k, bool smem_bins,
                     uint32_t* cnt) {
  extern __shared__ uint32_t bins_smem[];
  aux_histogram(idx, T, E, k, /*per_choice=*/false, smem_bins, bins_smem, cnt);
}

// Backward, pass 2: one warp per token; q[e] is recomputed from cnt wherever used (same bits).
__global__ void __launch_bounds__(Config::kThreads)
    aux_loss_backward_kernel(const __grid_constant__ AuxLossBackwardArgs a, const uint32_t* cnt) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (t >= a.tokens) return;
  const int64_t E = a.experts;
  const float fT = static_cast<float>(a.tokens);
  const float daux_e = a.daux * static_cast<float>(E);
  auto q = [&](int64_t e) { return (daux_e * (static_cast<float>(cnt[e]) / fT)) / fT; };
  const float* p = a.probs + t * E;  // (E)
  float* dz = a.dlogits + t * E;     // (E)
  float acc = 0.0f;
  for (int64_t e = lane; e < E; e += 32) acc = acc + p[e] * q(e);
  const float d = r32_butterfly(acc);
  for (int64_t e = lane; e < E; e += 32) dz[e] = dz[e] + p[e] * (q(e) - d);
}

// ---- permute -------------------------------------------------------------------------------------

// The padding part of permute and unpermute_backward: CTAs [0, pad_blocks) give a warp to each
// row r of out (M rows of `len` elements); a row that no pair feeds (row_slot[r] < 0: expert
// padding) gets zeros, the others are written by the pairs' warps. A bad row_slot traps.
template <typename T>
__device__ __forceinline__ void zero_padding_row(const int32_t* row_slot, int64_t rows,
                                                 int64_t slots, T* out, int64_t len) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int32_t slot = __ldg(row_slot + r);
  if (slot < -1 || slot >= slots) __trap();
  if (slot >= 0) return;
  for (int64_t c = threadIdx.x & 31; c < len; c += 32) out[r * len + c] = T{};
}

// A byte copy in units U (16, 4 or 2 bytes: the widest that divides the row and both bases), in
// one launch of two parts: zero_padding_row, then a warp per token t copies x[t] to its k rows
// dest[t, j] (x[t] leaves DRAM once; the later copies read it from L1).
template <typename U>
__global__ void __launch_bounds__(Config::kThreads)
    permute_kernel(const __grid_constant__ PermuteArgs a, int64_t units_per_row, unsigned pad_blocks) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t k = a.top_k;
  U* xp = static_cast<U*>(a.xp);
  if (blockIdx.x < pad_blocks)
    return zero_padding_row(a.row_slot, a.rows, a.tokens * k, xp, units_per_row);
  const int64_t t = static_cast<int64_t>(blockIdx.x - pad_blocks) * Config::kWarps + warp;
  if (t >= a.tokens) return;
  const U* x_t = static_cast<const U*>(a.x) + t * units_per_row;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t r = __ldg(a.dest + t * k + j);
    if (r < 0 || r >= a.rows) __trap();
    U* xp_r = xp + r * units_per_row;
#pragma unroll 4
    for (int64_t c = lane; c < units_per_row; c += 32) xp_r[c] = __ldg(x_t + c);
  }
}

// dx[t] = sequential sum_j dxp[dest[t, j]], from +0.
template <typename TIn, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    permute_backward_kernel(const __grid_constant__ PermuteBackwardArgs a) {
  ChunkPos pos;
  if (!chunk_pos(a.tokens, a.hidden, pos)) return;
  const int64_t H = a.hidden, k = a.top_k;
  const TIn* dxp = static_cast<const TIn*>(a.dxp);
  float acc[Config::kChunk];
#pragma unroll
  for (int q = 0; q < Config::kChunk; ++q) acc[q] = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t r = __ldg(a.dest + pos.row * k + j);
    if (r < 0 || r >= a.rows) __trap();
    float v[Config::kChunk];
    load_chunk<TIn, kVec>(dxp + r * H + pos.col, v, pos.valid);
#pragma unroll
    for (int q = 0; q < Config::kChunk; ++q) acc[q] = acc[q] + v[q];
  }
  store_chunk<float, kVec>(a.dx + pos.row * H + pos.col, acc, pos.valid);
}

// ---- SwiGLU --------------------------------------------------------------------------------------

// Whether `row` is below the optional device row count (SwigluArgs::rows_device); a count outside
// [0, rows] traps, as the CPU's check aborts.
__device__ __forceinline__ bool row_in_use(const int64_t* rows_device, int64_t rows, int64_t row) {
  if (rows_device == nullptr) return true;
  const int64_t m = __ldg(rows_device);
  if (m < 0 || m > rows) __trap();
  return row < m;
}

template <typename TIn, typename TOut, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    swiglu_kernel(const __grid_constant__ SwigluArgs a) {
  ChunkPos pos;
  if (!chunk_pos(a.rows, a.ffn, pos) || !row_in_use(a.rows_device, a.rows, pos.row)) return;
  const int64_t F = a.ffn;
  const TIn* in = static_cast<const TIn*>(a.in) + pos.row * 2 * F + pos.col;  // gate; up at + F
  float g[Config::kChunk], u[Config::kChunk], o[Config::kChunk];
  load_chunk<TIn, kVec>(in, g, pos.valid);
  load_chunk<TIn, kVec>(in + F, u, pos.valid);
#pragma unroll
  for (int q = 0; q < Config::kChunk; ++q) {
    const float s = moe_sigmoid_f32(g[q]);
    o[q] = (g[q] * s) * u[q];
  }
  store_chunk<TOut, kVec>(static_cast<TOut*>(a.out) + pos.row * F + pos.col, o, pos.valid);
}

template <typename TIn, typename TDout, typename TDin, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    swiglu_backward_kernel(const __grid_constant__ SwigluBackwardArgs a) {
  ChunkPos pos;
  if (!chunk_pos(a.rows, a.ffn, pos) || !row_in_use(a.rows_device, a.rows, pos.row)) return;
  const int64_t F = a.ffn;
  const TIn* in = static_cast<const TIn*>(a.in) + pos.row * 2 * F + pos.col;
  float g[Config::kChunk], u[Config::kChunk], o[Config::kChunk];
  load_chunk<TIn, kVec>(in, g, pos.valid);
  load_chunk<TIn, kVec>(in + F, u, pos.valid);
  load_chunk<TDout, kVec>(static_cast<const TDout*>(a.dout) + pos.row * F + pos.col, o, pos.valid);
  float dg[Config::kChunk], du[Config::kChunk];
#pragma unroll
  for (int q = 0; q < Config::kChunk; ++q) {
    const float s = moe_sigmoid_f32(g[q]);
    dg[q] = (o[q] * u[q]) * (s * (1.0f + g[q] * (1.0f - s)));
    du[q] = o[q] * (g[q] * s);
  }
  TDin* din = static_cast<TDin*>(a.din) + pos.row * 2 * F + pos.col;
  store_chunk<TDin, kVec>(din, dg, pos.valid);
  store_chunk<TDin, kVec>(din + F, du, pos.valid);
}

// ---- unpermute + combine -------------------------------------------------------------------------

// y[t] = sequential sum_j w[t, j] * yp[dest[t, j]], from +0, rounded once to y's dtype.
template <typename TYp, typename TY, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    unpermute_kernel(const __grid_constant__ UnpermuteArgs a) {
  ChunkPos pos;
  if (!chunk_pos(a.tokens, a.hidden, pos)) return;
  const int64_t H = a.hidden, k = a.top_k;
  const TYp* yp = static_cast<const TYp*>(a.yp);
  float acc[Config::kChunk];
#pragma unroll
  for (int q = 0; q < Config::kChunk; ++q) acc[q] = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t r = __ldg(a.dest + pos.row * k + j);
    if (r < 0 || r >= a.rows) __trap();
    const float wj = __ldg(a.w + pos.row * k + j);
    float v[Config::kChunk];
    load_chunk<TYp, kVec>(yp + r * H + pos.col, v, pos.valid);
#pragma unroll
    for (int q = 0; q < Config::kChunk; ++q) acc[q] = acc[q] + wj * v[q];
  }
  store_chunk<TY, kVec>(static_cast<TY*>(a.y) + pos.row * H + pos.col, acc, pos.valid);
}

// One launch, two parts: zero_padding_row, then a warp per pair (t, j), r = dest[t, j],
// reads dy[t] and yp[r] once and writes dyp[r] = w[t, j] * dy[t] and dw[t, j] = R32 sum_h dy[t, h] *
// yp[r, h]. kVec (dy, yp and dyp rows of whole 16-byte-aligned 8-element chunks): lane l takes
// elements 8l .. 8l + 7 of each 256-element slice with wide accesses, and the products pass through
// shared memory so that lane s still adds h = s, s + 32, s + 64, ... in order: the R32 sum's bits.
template <typename TYp, typename TDy, typename TDyp, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    unpermute_backward_kernel(const __grid_constant__ UnpermuteBackwardArgs a, unsigned pad_blocks) {
  constexpr int kSlice = 32 * Config::kChunk;  // elements a warp handles per wide step
  __shared__ float products[Config::kWarps][kSlice];
  const int64_t H = a.hidden, k = a.top_k;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  TDyp* dyp = static_cast<TDyp*>(a.dyp);
  if (blockIdx.x < pad_blocks) return zero_padding_row(a.row_slot, a.rows, a.tokens * k, dyp, H);
  const int64_t pair = static_cast<int64_t>(blockIdx.x - pad_blocks) * Config::kWarps + warp;
  if (pair >= a.tokens * k) return;
  const int64_t t = pair / k;
  const int32_t r = __ldg(a.dest + pair);
  if (r < 0 || r >= a.rows) __trap();
  const float wj = __ldg(a.w + pair);
  const TDy* dy_t = static_cast<const TDy*>(a.dy) + t * H;  // (H)
  const TYp* yp_r = static_cast<const TYp*>(a.yp) + r * H;  // (H)
  TDyp* dyp_r = dyp + r * H;                                 // (H)
  float acc = 0.0f;
  int64_t h0 = 0;  // elements done by the wide path
  if constexpr (kVec) {
    float* prod = products[warp];
    for (; h0 + kSlice <= H; h0 += kSlice) {
      float u[Config::kChunk], v[Config::kChunk], g[Config::kChunk];
      load_chunk<TDy, true>(dy_t + h0 + Config::kChunk * lane, u, Config::kChunk);
      load_chunk<TYp, true>(yp_r + h0 + Config::kChunk * lane, v, Config::kChunk);
#pragma unroll
      for (int q = 0; q < Config::kChunk; ++q) {
        g[q] = wj * u[q];
        prod[Config::kChunk * lane + q] = u[q] * v[q];
      }
      store_chunk<TDyp, true>(dyp_r + h0 + Config::kChunk * lane, g, Config::kChunk);
      __syncwarp();
#pragma unroll
      for (int m = 0; m < Config::kChunk; ++m) acc = acc + prod[lane + 32 * m];
      __syncwarp();
    }
  }
  for (int64_t h = h0 + lane; h < H; h += 32) {
    const float u = to_f32(dy_t[h]);
    dyp_r[h] = from_f32<TDyp>(wj * u);
    acc = acc + u * to_f32(yp_r[h]);
  }
  acc = r32_butterfly(acc);
  if (lane == 0) a.dw[pair] = acc;
}

// The row kernels' vector path: every row a whole number of 16-byte-aligned 8-element chunks.
bool rows_vectorizable(int64_t cols, std::initializer_list<const void*> ptrs) {
  if (cols % Config::kChunk != 0) return false;
  for (const void* p : ptrs)
    if (!aligned_to(p, 16)) return false;
  return true;
}

}  // namespace

Status router_topk_sm90(CudaBackend& be, const RouterTopkArgs& a) {
  const unsigned grid = grid_for(a.tokens, Config::kWarps);
  const int64_t E = a.experts;
  if (E <= 32)
    router_topk_kernel<1><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  else if (E <= 64)
    router_topk_kernel<2><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  else if (E <= 128)
    router_topk_kernel<4><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  else if (E <= 256)
    router_topk_kernel<8><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  else
    router_topk_kernel<0><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status router_topk_backward_sm90(CudaBackend& be, const RouterTopkBackwardArgs& a) {
  router_topk_backward_kernel<<<grid_for(a.tokens, Config::kWarps), Config::kThreads, 0,
                                be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status aux_loss_sm90(CudaBackend& be, const AuxLossArgs& a) {
  const int64_t E = a.experts, bins = a.top_k * a.experts;
  // Layout: cnt (k E) | ticket | pad | pbar (E); cnt and ticket start zeroed.
  const size_t zeroed = static_cast<size_t>(bins + 1) * sizeof(uint32_t);
  const size_t pbar_at = (zeroed + 15) / 16 * 16;
  auto* base = static_cast<uint8_t*>(be.workspace(pbar_at + static_cast<size_t>(E) * sizeof(float)));
  AuxWorkspace ws{reinterpret_cast<uint32_t*>(base), reinterpret_cast<uint32_t*>(base) + bins,
                  reinterpret_cast<float*>(base + pbar_at)};
  PACKMOE_CUDA_CHECK(cudaMemsetAsync(base, 0, zeroed, be.stream()));
  const bool smem_bins = bins <= Config::kAuxSmemBins;
  const size_t smem = smem_bins ? static_cast<size_t>(bins) * sizeof(uint32_t) : 0;
  aux_loss_kernel<<<grid_for(E, Config::kAuxExperts), Config::kThreads, smem, be.stream()>>>(
      a, ws, smem_bins);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status aux_loss_backward_sm90(CudaBackend& be, const AuxLossBackwardArgs& a) {
  const int64_t E = a.experts;
  auto* cnt = static_cast<uint32_t*>(be.workspace(static_cast<size_t>(E) * sizeof(uint32_t)));
  PACKMOE_CUDA_CHECK(cudaMemsetAsync(cnt, 0, static_cast<size_t>(E) * sizeof(uint32_t), be.stream()));
  const bool smem_bins = E <= Config::kAuxSmemBins;
  const size_t smem = smem_bins ? static_cast<size_t>(E) * sizeof(uint32_t) : 0;
  // Enough CTAs to stream idx, few enough that flushing shared bins stays cheap.
  const int64_t slots = a.tokens * a.top_k;
  const int64_t want = (slots + 4 * Config::kThreads - 1) / (4 * Config::kThreads);
  const unsigned count_grid =
      static_cast<unsigned>(want < 2 * int64_t{be.sm_count()} ? want : 2 * int64_t{be.sm_count()});
  aux_count_kernel<<<count_grid, Config::kThreads, smem, be.stream()>>>(a.idx, a.tokens, E, a.top_k,
                                                                     smem_bins, cnt);
  PACKMOE_CUDA_CHECK_LAUNCH();
  aux_loss_backward_kernel<<<grid_for(a.tokens, Config::kWarps), Config::kThreads, 0, be.stream()>>>(
      a, cnt);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status permute_sm90(CudaBackend& be, const PermuteArgs& a) {
  const int64_t row_bytes = static_cast<int64_t>(dtype_bytes_for(a.dtype, a.hidden));
  const unsigned pad_blocks = grid_for(a.rows, Config::kWarps);
  const unsigned token_blocks = grid_for(a.tokens, Config::kWarps);
  PACKMOE_CHECK(uint64_t{pad_blocks} + token_blocks < (uint64_t{1} << 31), "grid too large");
  auto launch = [&](auto unit) {
    using U = decltype(unit);
    const int64_t upr = row_bytes / static_cast<int64_t>(sizeof(U));
    permute_kernel<U><<<pad_blocks + token_blocks, Config::kThreads, 0, be.stream()>>>(a, upr, pad_blocks);
  };
  auto fits = [&](uintptr_t u) {
    return row_bytes % static_cast<int64_t>(u) == 0 && aligned_to(a.x, u) && aligned_to(a.xp, u);
  };
  if (fits(16))
    launch(uint4{});
  else if (fits(4))
    launch(uint32_t{});
  else
    launch(uint16_t{});  // BF16 rows of odd length: 2 bytes always divide
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status permute_backward_sm90(CudaBackend& be, const PermuteBackwardArgs& a) {
  const int64_t chunks = a.tokens * ((a.hidden + Config::kChunk - 1) / Config::kChunk);
  const unsigned grid = grid_for(chunks, Config::kThreads);
  const bool vec = rows_vectorizable(a.hidden, {a.dxp, a.dx});
  with_elem(a.dxp_dtype, [&](auto in) {
    using TIn = elem_t<decltype(in)>;
    if (vec)
      permute_backward_kernel<TIn, true><<<grid, Config::kThreads, 0, be.stream()>>>(a);
    else
      permute_backward_kernel<TIn, false><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  });
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status swiglu_sm90(CudaBackend& be, const SwigluArgs& a) {
  const int64_t chunks = a.rows * ((a.ffn + Config::kChunk - 1) / Config::kChunk);
  const unsigned grid = grid_for(chunks, Config::kThreads);
  const bool vec = rows_vectorizable(a.ffn, {a.in, a.out});
  with_elem(a.in_dtype, [&](auto in) {
    with_elem(a.out_dtype, [&](auto out) {
      using TIn = elem_t<decltype(in)>;
      using TOut = elem_t<decltype(out)>;
      if (vec)
        swiglu_kernel<TIn, TOut, true><<<grid, Config::kThreads, 0, be.stream()>>>(a);
      else
        swiglu_kernel<TIn, TOut, false><<<grid, Config::kThreads, 0, be.stream()>>>(a);
    });
  });
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status swiglu_backward_sm90(CudaBackend& be, const SwigluBackwardArgs& a) {
  const int64_t chunks = a.rows * ((a.ffn + Config::kChunk - 1) / Config::kChunk);
  const unsigned grid = grid_for(chunks, Config::kThreads);
  const bool vec = rows_vectorizable(a.ffn, {a.in, a.dout, a.din});
  with_elem(a.in_dtype, [&](auto in) {
    with_elem(a.dout_dtype, [&](auto dout) {
      with_elem(a.din_dtype, [&](auto din) {
        using TIn = elem_t<decltype(in)>;
        using TDout = elem_t<decltype(dout)>;
        using TDin = elem_t<decltype(din)>;
        if (vec)
          swiglu_backward_kernel<TIn, TDout, TDin, true>
              <<<grid, Config::kThreads, 0, be.stream()>>>(a);
        else
          swiglu_backward_kernel<TIn, TDout, TDin, false>
              <<<grid, Config::kThreads, 0, be.stream()>>>(a);
      });
    });
  });
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status unpermute_sm90(CudaBackend& be, const UnpermuteArgs& a) {
  const int64_t chunks = a.tokens * ((a.hidden + Config::kChunk - 1) / Config::kChunk);
  const unsigned grid = grid_for(chunks, Config::kThreads);
  const bool vec = rows_vectorizable(a.hidden, {a.yp, a.y});
  with_elem(a.yp_dtype, [&](auto yp) {
    with_elem(a.y_dtype, [&](auto y) {
      using TYp = elem_t<decltype(yp)>;
      using TY = elem_t<decltype(y)>;
      if (vec)
        unpermute_kernel<TYp, TY, true><<<grid, Config::kThreads, 0, be.stream()>>>(a);
      else
        unpermute_kernel<TYp, TY, false><<<grid, Config::kThreads, 0, be.stream()>>>(a);
    });
  });
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status unpermute_backward_sm90(CudaBackend& be, const UnpermuteBackwardArgs& a) {
  const unsigned pad_blocks = grid_for(a.rows, Config::kWarps);
  const unsigned pair_blocks = grid_for(a.tokens * a.top_k, Config::kWarps);
  PACKMOE_CHECK(uint64_t{pad_blocks} + pair_blocks < (uint64_t{1} << 31), "grid too large");
  const unsigned grid = pad_blocks + pair_blocks;
  const bool vec = rows_vectorizable(a.hidden, {a.dy, a.yp, a.dyp});
  with_elem(a.yp_dtype, [&](auto yp) {
    with_elem(a.dy_dtype, [&](auto dy) {
      with_elem(a.dyp_dtype, [&](auto dyp) {
        using TYp = elem_t<decltype(yp)>;
        using TDy = elem_t<decltype(dy)>;
        using TDyp = elem_t<decltype(dyp)>;
        if (vec)
          unpermute_backward_kernel<TYp, TDy, TDyp, true>
              <<<grid, Config::kThreads, 0, be.stream()>>>(a, pad_blocks);
        else
          unpermute_backward_kernel<TYp, TDy, TDyp, false>
              <<<grid, Config::kThreads, 0, be.stream()>>>(a, pad_blocks);
      });
    });
  });
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
