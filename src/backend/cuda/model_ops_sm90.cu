// CUDA kernels of the dense decoder ops (backend/ops/model.h), forward and backward, except the
// attention core (attention_sm90.cu). Invariant:
// each value is backend/ops/model.h's exact FP32 arithmetic (R32 = strided lanes + xor butterfly or 32
// explicit partials, maxima in index order, moe_exp_f32 / model_log_f32, --fmad=false), so every
// op writes the CPU reference's bytes, but for cross_entropy (an online max / sum in one read of
// the row, the hardware exp: deterministic, within a stated bound of the CPU). Bad ids / targets: a check kernel's flag is read back (one
// sync) and the CPU's error Status is returned before anything is written.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/kernels_common.cuh"
#include "backend/cuda/reduce_order.cuh"
#include "backend/ops/model.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;  // row kernels: 8 warps, one row each
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kColThreads = 1024;  // RMSNorm dweight: 32 R32 lanes x 32 columns
};

using cuda::blocks_for;

// ---- id / target range check --------------------------------------------------------------------

// Result of the check kernel, zeroed to {none, 0} before it runs.
struct IdCheck {
  uint32_t first_bad;  // smallest bad position, UINT32_MAX when none (T < 2^24)
  uint32_t valid;      // targets not equal to ignore_index (cross-entropy only)
};

// Integer atomics only: min and count do not depend on the order of the threads. `positions`
// (optional) receives t at t, the values of embedding_backward's sort.
__global__ void __launch_bounds__(Config::kThreads)
    check_ids_kernel(const int32_t* ids, int64_t tokens, int64_t vocab, bool has_ignore,
                     int32_t ignore_index, IdCheck* out, int32_t* positions) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const int32_t id = ids[t];
  if (positions) positions[t] = static_cast<int32_t>(t);
  if (has_ignore && id == ignore_index) return;
  if (id < 0 || id >= vocab)
    atomicMin(&out->first_bad, static_cast<uint32_t>(t));
  else if (has_ignore)
    atomicAdd(&out->valid, 1u);
}

// Runs the check and waits for it. Returns #non-ignored targets (tokens for ids), or the CPU
// reference's error Status (same words) for the first bad position. `ignore` is null for ids.
Result<int64_t> check_ids(CudaBackend& be, IdCheck* flag, const char* op, const int32_t* ids,
                          int64_t tokens, int64_t vocab, const int32_t* ignore,
                          int32_t* positions = nullptr) {
  PACKMOE_CUDA_CHECK(cudaMemsetAsync(&flag->first_bad, 0xFF, sizeof(uint32_t), be.stream()));
  PACKMOE_CUDA_CHECK(cudaMemsetAsync(&flag->valid, 0, sizeof(uint32_t), be.stream()));
  check_ids_kernel<<<blocks_for(tokens, Config::kThreads), Config::kThreads, 0, be.stream()>>>(
      ids, tokens, vocab, ignore != nullptr, ignore ? *ignore : 0, flag, positions);
  PACKMOE_CUDA_CHECK_LAUNCH();
  IdCheck h{};
  be.copy(&h, flag, sizeof h, Backend::CopyKind::kDeviceToHost);  // synchronizes
  if (h.first_bad == UINT32_MAX) return ignore ? static_cast<int64_t>(h.valid) : tokens;
  int32_t bad = 0;
  be.copy(&bad, ids + h.first_bad, sizeof bad, Backend::CopyKind::kDeviceToHost);
  const std::string where =
      " at position " + std::to_string(h.first_bad) + " outside [0, " + std::to_string(vocab) + ")";
  if (!ignore) return Status::error(std::string(op) + ": token id " + std::to_string(bad) + where);
  return Status::error(std::string(op) + ": target " + std::to_string(bad) + where +
                       " and not the ignore index " + std::to_string(*ignore));
}

// Workspace carving: each piece 256-byte aligned.
class Carve {
 public:
  template <typename T>
  size_t add(int64_t count) {
    const size_t at = bytes_;
    bytes_ = (bytes_ + static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

// ---- embedding ----------------------------------------------------------------------------------

// out[t] = table[ids[t]] in units U (float4 when H % 4 == 0 and both bases are 16-byte aligned).
template <typename U>
__global__ void __launch_bounds__(Config::kThreads)
    embedding_kernel(const int32_t* ids, int64_t tokens, int64_t units_per_row, const U* table,
                     U* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * units_per_row) return;
  const int64_t t = i / units_per_row;
  out[i] = table[static_cast<int64_t>(ids[t]) * units_per_row + (i - t * units_per_row)];
}

// After the stable sort of (id, t) by id: the thread of a segment's first position p sums column h
// of its tokens in sorted (= increasing t) order from +0 and adds the sum onto dtable; the others
// return.
__global__ void __launch_bounds__(Config::kThreads)
    embedding_backward_kernel(const uint32_t* sorted_ids, const int32_t* sorted_t, int64_t tokens,
                              int64_t hidden, const float* dout, float* dtable) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int64_t p = i / hidden, h = i - p * hidden;
  const uint32_t v = sorted_ids[p];
  if (p > 0 && sorted_ids[p - 1] == v) return;
  float* dst = dtable + static_cast<int64_t>(v) * hidden + h;
  float acc = 0.0f;
  for (int64_t q = p; q < tokens && sorted_ids[q] == v; ++q)
    acc = acc + dout[static_cast<int64_t>(sorted_t[q]) * hidden + h];
  *dst = *dst + acc;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// One warp per row; y (F32) or y_bf16 (the RNE of the same FP32 value, core/codecs.h).
__global__ void __launch_bounds__(Config::kThreads)
    rms_norm_kernel(const __grid_constant__ RmsNormArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (r >= a.rows) return;
  const int64_t D = a.dim;
  const float* x = a.x + r * D;  // (D)
  float acc = 0.0f;
  for (int64_t d = lane; d < D; d += 32) acc = acc + x[d] * x[d];
  const float ss = r32_butterfly(acc);
  const float rstd = 1.0f / sqrtf(ss / static_cast<float>(D) + a.eps);
  if (lane == 0) a.rstd[r] = rstd;
  if (a.y) {
    float* y = a.y + r * D;  // (D)
    for (int64_t d = lane; d < D; d += 32) y[d] = (x[d] * rstd) * a.weight[d];
  } else {
    uint16_t* y = a.y_bf16 + r * D;  // (D)
    for (int64_t d = lane; d < D; d += 32) y[d] = f32_to_bf16((x[d] * rstd) * a.weight[d]);
  }
}

// dx: one warp per row; n and g recomputed in each pass (pointwise, same bits). With dresidual,
// t is rounded by its own multiply (__fmul_rn, never contracted into the add) and added with
// __fadd_rn: the CPU's two roundings whatever --fmad says.
__global__ void __launch_bounds__(Config::kThreads)
    rms_norm_backward_dx_kernel(const __grid_constant__ RmsNormBackwardArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (r >= a.rows) return;
  const int64_t D = a.dim;
  const float* x = a.x + r * D;    // (D)
  const float* dy = a.dy + r * D;  // (D)
  float* dx = a.dx + r * D;        // (D)
  const float rstd = a.rstd[r];
  float acc = 0.0f;
  for (int64_t d = lane; d < D; d += 32) acc = acc + (dy[d] * a.weight[d]) * (x[d] * rstd);
  const float c = r32_butterfly(acc) / static_cast<float>(D);
  const float* dres = a.dresidual ? a.dresidual + r * D : nullptr;  // (D)
  for (int64_t d = lane; d < D; d += 32) {
    const float n = x[d] * rstd, g = dy[d] * a.weight[d];
    const float t = __fmul_rn(g - n * c, rstd);
    dx[d] = dres ? __fadd_rn(dres[d], t) : t;
  }
}

// dweight, stage 1: CTA (column block of 32, row block b of kReduceRowBlock rows); warp w is R32
// lane w over the block's rows (r = b0 + w, b0 + w + 32, ...), lane x its column, so each warp
// load is 32 contiguous floats; the tree runs in shared memory. partial: (blocks, D).
__global__ void __launch_bounds__(Config::kColThreads)
    rms_norm_dweight_blocks_kernel(const __grid_constant__ RmsNormBackwardArgs a, float* partial) {
  __shared__ float red[32][33];
  const int x = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t D = a.dim;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * 32 + x;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * kReduceRowBlock;
  const int64_t end = a.rows - b0 < kReduceRowBlock ? a.rows : b0 + kReduceRowBlock;
  auto term = [&](int64_t r) { return a.dy[r * D + d] * (a.x[r * D + d] * a.rstd[r]); };
  float acc = 0.0f;
  if (d < D) {
    int64_t r = b0 + w;
    for (; r + 96 < end; r += 128) {  // four rows' loads in flight ahead of the ordered adds
      const float t0 = term(r), t1 = term(r + 32), t2 = term(r + 64), t3 = term(r + 96);
      acc = acc + t0;
      acc = acc + t1;
      acc = acc + t2;
      acc = acc + t3;
    }
    for (; r < end; r += 32) acc = acc + term(r);
  }
  red[w][x] = acc;
  __syncthreads();
  for (int off = 16; off >= 1; off /= 2) {
    if (w < off) red[w][x] = red[w][x] + red[w + off][x];
    __syncthreads();
  }
  if (w == 0 && d < D) partial[blockIdx.y * D + d] = red[0][x];
}

// dweight, stage 2: one thread per column, the block partials in block order from +0.
__global__ void __launch_bounds__(Config::kThreads)
    rms_norm_dweight_sum_kernel(const float* partial, int64_t blocks, int64_t D, float* dweight) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) acc = acc + partial[b * D + d];
  dweight[d] = acc;
}

// ---- RoPE ---------------------------------------------------------------------------------------

// One thread per (t, head, i < D/2); the pair is read before it is written, so in may equal out.
template <bool kInverse>
__global__ void __launch_bounds__(Config::kThreads)
    rope_kernel(const __grid_constant__ RopeArgs a) {
  const int64_t half = a.head_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.tokens * a.heads * half) return;
  const int64_t i = idx % half, th = idx / half, t = th / a.heads;
  const float c = a.cos[t * half + i], s = a.sin[t * half + i];
  const float* in = a.in + th * a.head_dim;  // (D)
  float* out = a.out + th * a.head_dim;      // (D)
  const float x0 = in[i], x1 = in[i + half];
  if (!kInverse) {
    out[i] = x0 * c - x1 * s;
    out[i + half] = x1 * c + x0 * s;
  } else {
    out[i] = x0 * c + x1 * s;
    out[i + half] = x1 * c - x0 * s;
  }
}

// ---- cross-entropy ------------------------------------------------------------------------------

constexpr int kCeThreads = 512;  // one row per CTA: 16 warps
constexpr int kCeWarps = kCeThreads / 32;

// The hardware exp (ex2.approx: about 2 ulp, subnormals flushed): the kernel is bound by the
// exponentials as much as by the bytes, and its results are held to a bound, not to the CPU's bits.
__device__ __forceinline__ float ce_exp(float x) { return __expf(x); }

// (m, s) of a running softmax: s = sum of exp(x - m) over the values seen. A rescale when the
// maximum grows is one extra rounding; NaN inputs make s NaN (loss and dlogits NaN, never a
// silently finite value). An empty part is (-Inf, 0).
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = (s == 0.0f ? 0.0f : s * ce_exp(m - x)) + 1.0f;
    m = x;
  } else {
    s = s + ce_exp(x - m);
  }
}

// Merges part b into a. Commutative bit for bit (max and IEEE + and * are), so a butterfly leaves
// every lane with the same value.
__device__ __forceinline__ void online_merge(float& m, float& s, float mb, float sb) {
  const float M = mb > m ? mb : m;
  const float ta = s == 0.0f ? 0.0f : s * ce_exp(m - M);
  const float tb = sb == 0.0f ? 0.0f : sb * ce_exp(mb - M);
  m = M;
  s = ta + tb;
}

__device__ __forceinline__ void online_butterfly(float& m, float& s) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    const float mo = __shfl_xor_sync(kFullMask, m, off);
    const float so = __shfl_xor_sync(kFullMask, s, off);
    online_merge(m, s, mo, so);
  }
}

// Each thread takes groups of 4 consecutive logits (group u = elements 4u .. 4u + 3 < V), groups
// tid, tid + 512, ...: float4 loads and 8-byte BF16 stores when V % 4 == 0 and both bases are
// 16-byte aligned, else 4 scalar accesses; the same elements in the same order either way, so the
// alignment does not change a bit.
template <bool kVec4>
__device__ __forceinline__ void ce_load(const float* z, int64_t V, int64_t u, float (&x)[4]) {
  if constexpr (kVec4) {
    const float4 v = reinterpret_cast<const float4*>(z)[u];
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = 4 * u + j < V ? z[4 * u + j] : 0.0f;
  }
}

template <bool kVec4>
__device__ __forceinline__ void ce_store(uint16_t* d, int64_t V, int64_t u,
                                         const uint16_t (&y)[4]) {
  if constexpr (kVec4) {
    uint2 w;
    w.x = static_cast<uint32_t>(y[0]) | (static_cast<uint32_t>(y[1]) << 16);
    w.y = static_cast<uint32_t>(y[2]) | (static_cast<uint32_t>(y[3]) << 16);
    reinterpret_cast<uint2*>(d)[u] = w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * u + j < V) d[4 * u + j] = y[j];
  }
}

// One CTA per token row: pass 1 reads the row once for (m, s) (then the warp butterflies and
// warp 0 merges the 16 warps in a fixed tree), the loss uses the target logit; pass 2 reads it
// again and writes dlogits. Row-local and in a fixed order: deterministic and batch-invariant. An
// ignored row is not read.
template <bool kVec4>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_kernel(const __grid_constant__ CrossEntropyArgs a) {
  __shared__ float part_m[kCeWarps], part_s[kCeWarps];
  const int64_t t = blockIdx.x;
  const int64_t V = a.vocab, groups = (V + 3) / 4;
  const float* z = a.logits + t * V;  // (V)
  const int32_t tgt = a.targets[t];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint16_t* dz = a.dlogits == nullptr ? nullptr : a.dlogits + t * V;  // (V)
  if (tgt == a.ignore_index) {  // uniform over the CTA: loss +0, dlogits +0, the row unread
    if (threadIdx.x == 0) a.loss[t] = 0.0f;
    if (dz != nullptr)
      for (int64_t u = threadIdx.x; u < groups; u += kCeThreads) {
        const uint16_t y[4] = {};
        ce_store<kVec4>(dz, V, u, y);
      }
    return;
  }

  float m = -f32_from_bits(0x7F800000u), s = 0.0f;
  for (int64_t u = threadIdx.x; u < groups; u += kCeThreads) {
    float x[4];
    ce_load<kVec4>(z, V, u, x);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (kVec4 || 4 * u + j < V) online_add(m, s, x[j]);
  }
  online_butterfly(m, s);
  if (lane == 0) {
    part_m[warp] = m;
    part_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kCeWarps ? part_m[lane] : -f32_from_bits(0x7F800000u);
    s = lane < kCeWarps ? part_s[lane] : 0.0f;
    online_butterfly(m, s);
    if (lane == 0) {
      part_m[0] = m;
      part_s[0] = s;
      a.loss[t] = model_log_f32(s) - (z[tgt] - m);
    }
  }
  if (dz == nullptr) return;
  __syncthreads();
  m = part_m[0];
  s = part_s[0];
  const float g = a.grad_scale, inv_s = 1.0f / s;
  for (int64_t u = threadIdx.x; u < groups; u += kCeThreads) {
    float x[4];
    uint16_t y[4];
    ce_load<kVec4>(z, V, u, x);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t e = 4 * u + j;
      const float p = ce_exp(x[j] - m) * inv_s;
      y[j] = f32_to_bf16((e == tgt ? p - 1.0f : p) * g);
    }
    ce_store<kVec4>(dz, V, u, y);
  }
}

// loss = (R32 sum_t token_loss) / float(n), +0 when n = 0; one warp.
__global__ void cross_entropy_mean_kernel(const float* token_loss, int64_t tokens, int64_t n,
                                          float* loss) {
  const int lane = threadIdx.x;
  float acc = 0.0f;
  for (int64_t t = lane; t < tokens; t += 32) acc = acc + token_loss[t];
  const float sum = r32_butterfly(acc);
  if (lane == 0) *loss = n == 0 ? 0.0f : sum / static_cast<float>(n);
}

}  // namespace

Status embedding_sm90(CudaBackend& be, const EmbeddingArgs& a) {
  auto* flag = static_cast<IdCheck*>(be.workspace(sizeof(IdCheck)));
  const Result<int64_t> ok = check_ids(be, flag, "embedding", a.ids, a.tokens, a.vocab, nullptr);
  if (!ok.is_ok()) return ok.status();
  const bool vec = a.hidden % 4 == 0 && cuda::aligned16(a.table) && cuda::aligned16(a.out);
  if (vec) {
    const int64_t upr = a.hidden / 4;
    embedding_kernel<float4>
        <<<blocks_for(a.tokens * upr, Config::kThreads), Config::kThreads, 0, be.stream()>>>(
            a.ids, a.tokens, upr, reinterpret_cast<const float4*>(a.table),
            reinterpret_cast<float4*>(a.out));
  } else {
    embedding_kernel<float>
        <<<blocks_for(a.tokens * a.hidden, Config::kThreads), Config::kThreads, 0, be.stream()>>>(
            a.ids, a.tokens, a.hidden, a.table, a.out);
  }
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status embedding_backward_sm90(CudaBackend& be, const EmbeddingBackwardArgs& a) {
  const int T = static_cast<int>(a.tokens);  // < 2^24 (validated)
  int bits = 1;
  while ((int64_t{1} << bits) < a.vocab) ++bits;
  // Workspace: flag | positions (T) | sorted ids (T) | sorted positions (T) | sort scratch.
  size_t sort_bytes = 0;
  PACKMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), T, 0, bits,
      be.stream()));
  Carve c;
  const size_t flag_at = c.add<IdCheck>(1), pos_at = c.add<int32_t>(T),
               keys_at = c.add<uint32_t>(T), vals_at = c.add<int32_t>(T),
               sort_at = c.add<uint8_t>(static_cast<int64_t>(sort_bytes));
  void* ws = be.workspace(c.bytes());
  int32_t* positions = at<int32_t>(ws, pos_at);
  const Result<int64_t> ok = check_ids(be, at<IdCheck>(ws, flag_at), "embedding_backward", a.ids,
                                       a.tokens, a.vocab, nullptr, positions);
  if (!ok.is_ok()) return ok.status();
  // Radix sort is stable: within one id the positions stay in increasing t.
  uint32_t* keys = at<uint32_t>(ws, keys_at);
  int32_t* vals = at<int32_t>(ws, vals_at);
  PACKMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(at<void>(ws, sort_at), sort_bytes,
                                                     reinterpret_cast<const uint32_t*>(a.ids), keys,
                                                     positions, vals, T, 0, bits, be.stream()));
  embedding_backward_kernel<<<blocks_for(a.tokens * a.hidden, Config::kThreads), Config::kThreads,
                              0, be.stream()>>>(keys, vals, a.tokens, a.hidden, a.dout, a.dtable);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status rms_norm_sm90(CudaBackend& be, const RmsNormArgs& a) {
  rms_norm_kernel<<<blocks_for(a.rows, Config::kWarps), Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status rms_norm_backward_sm90(CudaBackend& be, const RmsNormBackwardArgs& a) {
  rms_norm_backward_dx_kernel<<<blocks_for(a.rows, Config::kWarps), Config::kThreads, 0,
                                be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  const int64_t blocks = (a.rows + kReduceRowBlock - 1) / kReduceRowBlock;
  if (blocks > 65535)
    return Status::error("rms_norm_backward: " + std::to_string(a.rows) + " rows exceed " +
                         std::to_string(65535 * kReduceRowBlock) + " (the dweight grid)");
  auto* partial = static_cast<float*>(be.workspace(blocks * a.dim * sizeof(float)));  // (blocks, D)
  rms_norm_dweight_blocks_kernel<<<dim3(blocks_for(a.dim, 32), static_cast<unsigned>(blocks)),
                                   Config::kColThreads, 0, be.stream()>>>(a, partial);
  PACKMOE_CUDA_CHECK_LAUNCH();
  rms_norm_dweight_sum_kernel<<<blocks_for(a.dim, Config::kThreads), Config::kThreads, 0,
                                be.stream()>>>(partial, blocks, a.dim, a.dweight);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status rope_sm90(CudaBackend& be, const RopeArgs& a, bool inverse) {
  const unsigned grid = blocks_for(a.tokens * a.heads * (a.head_dim / 2), Config::kThreads);
  if (inverse)
    rope_kernel<true><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  else
    rope_kernel<false><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status cross_entropy_sm90(CudaBackend& be, const CrossEntropyArgs& a) {
  const Result<int64_t> n =
      check_ids(be, static_cast<IdCheck*>(be.workspace(sizeof(IdCheck))), "cross_entropy",
                a.targets, a.tokens, a.vocab, &a.ignore_index);
  if (!n.is_ok()) return n.status();
  const bool vec = a.vocab % 4 == 0 && cuda::aligned16(a.logits) &&
                   (a.dlogits == nullptr || cuda::aligned16(a.dlogits));
  const unsigned grid = static_cast<unsigned>(a.tokens);  // < 2^24 (validated)
  if (vec)
    cross_entropy_kernel<true><<<grid, kCeThreads, 0, be.stream()>>>(a);
  else
    cross_entropy_kernel<false><<<grid, kCeThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status cross_entropy_mean_sm90(CudaBackend& be, const CrossEntropyMeanArgs& a) {
  cross_entropy_mean_kernel<<<1, 32, 0, be.stream()>>>(a.token_loss, a.tokens, a.valid, a.loss);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
