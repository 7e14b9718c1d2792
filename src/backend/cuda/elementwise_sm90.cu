// CUDA elementwise ops over segment lists (backend/ops/elementwise.h): cast F32 -> BF16, add F32
// (in place and out = a + b), AdamW, NVFP4 decode scales, sum of squares. One launch covers every
// segment of a call (a pointer table, inline or uploaded). Invariant: the CPU reference's bytes: each element goes through the
// same PACKMOE_HD function (nvcc --fmad=false, IEEE div / sqrt) and sum_squares keeps its chunk /
// R32 / sequential order; 16-byte accesses only change how elements move, never their arithmetic.
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/reduce_order.cuh"
#include "backend/ops/elementwise.h"
#include "backend/ops/moe.h"
#include "core/codecs.h"
#include "formats/mxfp8_math.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kInline = 8;  // segments per table carried in the kernel parameters
};

// kTables pointer columns of G segments each. Up to kInline segments travel inline (the kernel
// parameter is __grid_constant__, so run-time indexing reads parameter memory in place); more are
// uploaded as one (kTables, G) array.
template <int kTables>
struct SegTable {
  void* const* uploaded;  // (kTables, G) device memory, or null when inline
  void* local[kTables][Config::kInline];
  int64_t groups;  // G
  int64_t n;       // elements per segment
  __device__ __forceinline__ void* get(int table, int64_t g) const {
    return uploaded ? uploaded[table * groups + g] : local[table][g];
  }
};

template <int kTables>
SegTable<kTables> make_table(CudaBackend& be, const std::array<std::vector<void*>, kTables>& cols,
                             int64_t n) {
  SegTable<kTables> t{};
  t.groups = static_cast<int64_t>(cols[0].size());
  t.n = n;
  if (t.groups <= Config::kInline) {
    t.uploaded = nullptr;
    for (int c = 0; c < kTables; ++c)
      for (int64_t g = 0; g < t.groups; ++g) t.local[c][g] = cols[c][g];
  } else {
    std::vector<void*> flat;
    flat.reserve(kTables * t.groups);
    for (int c = 0; c < kTables; ++c) flat.insert(flat.end(), cols[c].begin(), cols[c].end());
    t.uploaded = static_cast<void* const*>(be.upload(flat.data(), flat.size() * sizeof(void*)));
  }
  return t;
}

template <typename T>
std::vector<void*> as_void(const std::vector<T*>& v) {
  std::vector<void*> out;
  out.reserve(v.size());
  for (T* p : v) out.push_back(const_cast<void*>(static_cast<const void*>(p)));
  return out;
}

// Whether every pointer of every column is 16-byte aligned: then each full chunk (which starts at
// a multiple of kVec elements of a segment) moves as 16-byte accesses.
template <typename... V>
bool all_aligned16(const V&... cols) {
  bool ok = true;
  auto check = [&](const auto& col) {
    for (const auto* p : col) ok = ok && (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
  };
  (check(cols), ...);
  return ok;
}

unsigned grid_for(int64_t n, int64_t per) {
  const int64_t b = (n + per - 1) / per;
  PACKMOE_CHECK(b > 0 && b < (int64_t{1} << 31), "grid of " << b << " blocks is too large");
  return static_cast<unsigned>(b);
}

// Flat thread -> (segment g, first element, valid elements) for chunks of kV elements.
template <int kV>
__device__ __forceinline__ bool seg_chunk(int64_t groups, int64_t n, int64_t& g, int64_t& first,
                                          int& valid) {
  const int64_t cps = (n + kV - 1) / kV;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups * cps) return false;
  g = i / cps;
  first = (i - g * cps) * kV;
  const int64_t left = n - first;
  valid = left < kV ? static_cast<int>(left) : kV;
  return true;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}

// Tables: 0 src (F32), 1 dst (BF16). 8 elements: two 16-byte loads, one 16-byte store.
__global__ void __launch_bounds__(Config::kThreads)
    cast_f32_to_bf16_kernel(const __grid_constant__ SegTable<2> t, bool vec) {
  int64_t g, first;
  int valid;
  if (!seg_chunk<8>(t.groups, t.n, g, first, valid)) return;
  const float* src = static_cast<const float*>(t.get(0, g)) + first;
  uint16_t* dst = static_cast<uint16_t*>(t.get(1, g)) + first;
  if (vec && valid == 8) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(src));
    const float4 b = __ldg(reinterpret_cast<const float4*>(src) + 1);
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w),
                                                pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
  } else {
    for (int j = 0; j < valid; ++j) dst[j] = f32_to_bf16(src[j]);
  }
}

// Tables: 0 dst (F32, in place), 1 src (F32).
__global__ void __launch_bounds__(Config::kThreads)
    add_f32_kernel(const __grid_constant__ SegTable<2> t, bool vec) {
  int64_t g, first;
  int valid;
  if (!seg_chunk<4>(t.groups, t.n, g, first, valid)) return;
  float* dst = static_cast<float*>(t.get(0, g)) + first;
  const float* src = static_cast<const float*>(t.get(1, g)) + first;
  if (vec && valid == 4) {
    float4 d = *reinterpret_cast<const float4*>(dst);
    const float4 s = *reinterpret_cast<const float4*>(src);
    d.x = d.x + s.x, d.y = d.y + s.y, d.z = d.z + s.z, d.w = d.w + s.w;
    *reinterpret_cast<float4*>(dst) = d;
  } else {
    for (int j = 0; j < valid; ++j) dst[j] = dst[j] + src[j];
  }
}

// Tables: 0 a (F32), 1 b (F32), 2 out (F32; may be a or b, so plain loads, no __ldg).
__global__ void __launch_bounds__(Config::kThreads)
    add_f32_out_kernel(const __grid_constant__ SegTable<3> t, bool vec) {
  int64_t g, first;
  int valid;
  if (!seg_chunk<4>(t.groups, t.n, g, first, valid)) return;
  const float* a = static_cast<const float*>(t.get(0, g)) + first;
  const float* b = static_cast<const float*>(t.get(1, g)) + first;
  float* out = static_cast<float*>(t.get(2, g)) + first;
  if (vec && valid == 4) {
    const float4 x = *reinterpret_cast<const float4*>(a);
    const float4 y = *reinterpret_cast<const float4*>(b);
    *reinterpret_cast<float4*>(out) = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  } else {
    for (int j = 0; j < valid; ++j) out[j] = a[j] + b[j];
  }
}

// AdamWArgs::amax: the per-expert amax of the BF16 image (null: none).
struct ImageAmax {
  float* amax = nullptr;
  int64_t span = 0, first = 0;
};

__device__ __forceinline__ void publish_amax(float* slot, unsigned bits) {
  if (bits != 0) atomicMax(reinterpret_cast<unsigned*>(slot), bits);
}

// A thread's share of the image amax: `local`, the NaN-ignoring max of |bf16(x)| over its
// elements of expert e0 (the expert of its first element); an element of a later expert (a
// thread straddling two) is published at once.
struct ThreadAmax {
  int64_t e0 = -1;  // -1: a thread without elements
  float local = 0.0f;
  __device__ __forceinline__ void take(const ImageAmax& am, int64_t i, float x) {
    const float b = amax_update(0.0f, bf16_to_f32(f32_to_bf16(x)));
    const int64_t e = (am.first + i) / am.span;
    if (e == e0)
      local = b > local ? b : local;
    else
      publish_amax(am.amax + e, __float_as_uint(b));
  }
};

// The block's values per expert: a max over each warp's lanes of one expert, over the warps in
// shared memory, then one atomicMax per expert and block (the values are non-negative and not
// NaN, so their IEEE order is their unsigned bit order). Every thread of the block calls it.
__device__ __forceinline__ void block_amax(const ImageAmax& am, const ThreadAmax& t) {
  __shared__ int64_t warp_expert[Config::kWarps];
  __shared__ unsigned warp_bits[Config::kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned same = __match_any_sync(0xFFFFFFFFu, static_cast<unsigned long long>(t.e0));
  const unsigned bits = __reduce_max_sync(same, __float_as_uint(t.local));
  const bool leader = lane == __ffs(same) - 1;
  if (lane == 0) warp_expert[warp] = t.e0, warp_bits[warp] = bits;  // the lane-0 group's
  else if (leader && t.e0 >= 0) publish_amax(am.amax + t.e0, bits);  // a warp's later expert
  __syncthreads();
  if (warp == 0 && lane < Config::kWarps) {
    constexpr unsigned kLanes = (1u << Config::kWarps) - 1;
    const int64_t e = warp_expert[lane];
    const unsigned group = __match_any_sync(kLanes, static_cast<unsigned long long>(e));
    const unsigned v = __reduce_max_sync(group, warp_bits[lane]);
    if (lane == __ffs(group) - 1 && e >= 0) publish_amax(am.amax + e, v);
  }
}

// Tables: 0 param, 1 exp_avg, 2 exp_avg_sq (all in place), 3 grad, with kBf16 4 the param's BF16
// image (written), and then optionally its per-expert amax (block_amax: every thread stays).
template <bool kBf16>
__global__ void __launch_bounds__(Config::kThreads)
    adamw_kernel(const __grid_constant__ SegTable<kBf16 ? 5 : 4> t, AdamWStepScalars s, bool vec,
                 ImageAmax am) {
  int64_t g = 0, first = 0;
  int valid = 0;
  const bool with_amax = kBf16 && am.amax != nullptr;
  ThreadAmax ta;
  if (seg_chunk<4>(t.groups, t.n, g, first, valid)) {
    float* p = static_cast<float*>(t.get(0, g)) + first;
    float* m = static_cast<float*>(t.get(1, g)) + first;
    float* v = static_cast<float*>(t.get(2, g)) + first;
    const float* gr = static_cast<const float*>(t.get(3, g)) + first;
    if (with_amax) ta.e0 = (am.first + first) / am.span;
    if (vec && valid == 4) {
      float4 p4 = *reinterpret_cast<const float4*>(p);
      float4 m4 = *reinterpret_cast<const float4*>(m);
      float4 v4 = *reinterpret_cast<const float4*>(v);
      const float4 g4 = *reinterpret_cast<const float4*>(gr);
      adamw_update(p4.x, m4.x, v4.x, g4.x, s);
      adamw_update(p4.y, m4.y, v4.y, g4.y, s);
      adamw_update(p4.z, m4.z, v4.z, g4.z, s);
      adamw_update(p4.w, m4.w, v4.w, g4.w, s);
      *reinterpret_cast<float4*>(p) = p4;
      *reinterpret_cast<float4*>(m) = m4;
      *reinterpret_cast<float4*>(v) = v4;
      if constexpr (kBf16) {
        *reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.get(4, g)) + first) =
            make_uint2(pack_bf16(p4.x, p4.y), pack_bf16(p4.z, p4.w));
        if (with_amax) {
          ta.take(am, first, p4.x), ta.take(am, first + 1, p4.y);
          ta.take(am, first + 2, p4.z), ta.take(am, first + 3, p4.w);
        }
      }
    } else {
      for (int j = 0; j < valid; ++j) {
        adamw_update(p[j], m[j], v[j], gr[j], s);
        if constexpr (kBf16) {
          static_cast<uint16_t*>(t.get(4, g))[first + j] = f32_to_bf16(p[j]);
          if (with_amax) ta.take(am, first + j, p[j]);
        }
      }
    }
  } else if (!with_amax) {
    return;
  }
  if (with_amax) block_amax(am, ta);
}

__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_decode_scales_kernel(const float* amax, float* decode, int64_t groups) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < groups) decode[g] = nvfp4_decode_scale(amax[g]);
}

// sum_squares, stage 1: one warp per chunk c (segment c / cps, kSumSquaresChunk elements from
// (c % cps) * kSumSquaresChunk): lane l adds x[i]^2 in FP64 for i = l, l + 32, ... of the chunk,
// then the butterfly (lane 0 ends with the R32 tree's value) into partial[c].
__global__ void __launch_bounds__(Config::kThreads)
    sum_squares_chunks_kernel(const __grid_constant__ SegTable<1> t, int64_t chunks_per_segment,
                              int64_t chunks, double* partial) {
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (c >= chunks) return;
  const int64_t g = c / chunks_per_segment;
  const int64_t first = (c - g * chunks_per_segment) * kSumSquaresChunk;
  const int64_t n = t.n - first < kSumSquaresChunk ? t.n - first : kSumSquaresChunk;
  const float* x = static_cast<const float*>(t.get(0, g)) + first;  // (n)
  double acc = 0.0;
  int64_t i = lane;
  for (; i + 7 * 32 < n; i += 8 * 32) {  // eight coalesced loads in flight ahead of the ordered adds
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldg(x + i + 32 * j);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = acc + static_cast<double>(v[j]) * static_cast<double>(v[j]);
  }
  for (; i < n; i += 32) {
    const double v = __ldg(x + i);
    acc = acc + v * v;
  }
  acc = r32_butterfly(acc);
  if (lane == 0) partial[c] = acc;
}

// sum_squares, stage 2: one warp per group of kSumSquaresGroup chunk sums, their R32 sum (lane l
// adds chunk sums l, l + 32, ... of the group, coalesced, then the butterfly) into group_sum.
__global__ void __launch_bounds__(Config::kThreads)
    sum_squares_groups_kernel(const double* partial, int64_t chunks, int64_t groups,
                              double* group_sum) {
  const int lane = threadIdx.x & 31;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * Config::kWarps + (threadIdx.x >> 5);
  if (g >= groups) return;
  const int64_t first = g * kSumSquaresGroup;
  const int64_t n = chunks - first < kSumSquaresGroup ? chunks - first : kSumSquaresGroup;
  double acc = 0.0;
  for (int64_t c = lane; c < n; c += 32) acc = acc + partial[first + c];
  acc = r32_butterfly(acc);
  if (lane == 0) group_sum[g] = acc;
}

// sum_squares, stage 3: one warp, the R32 sum of the group sums.
__global__ void sum_squares_total_kernel(const double* group_sum, int64_t groups, double* out) {
  double acc = 0.0;
  for (int64_t g = threadIdx.x; g < groups; g += 32) acc = acc + group_sum[g];
  acc = r32_butterfly(acc);
  if (threadIdx.x == 0) *out = acc;
}

}  // namespace

Status cast_f32_to_bf16_sm90(CudaBackend& be, const Segments<const float>& src,
                                     const Segments<uint16_t>& dst) {
  const int64_t G = static_cast<int64_t>(src.ptr.size());
  if (G == 0 || src.n == 0) return Status::ok();
  const SegTable<2> t = make_table<2>(be, {as_void(src.ptr), as_void(dst.ptr)}, src.n);
  const bool vec = all_aligned16(src.ptr, dst.ptr);
  cast_f32_to_bf16_kernel<<<grid_for(G * ((src.n + 7) / 8), Config::kThreads), Config::kThreads,
                            0, be.stream()>>>(t, vec);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status add_f32_sm90(CudaBackend& be, const Segments<float>& dst, const Segments<const float>& src) {
  const int64_t G = static_cast<int64_t>(dst.ptr.size());
  if (G == 0 || dst.n == 0) return Status::ok();
  const SegTable<2> t = make_table<2>(be, {as_void(dst.ptr), as_void(src.ptr)}, dst.n);
  const bool vec = all_aligned16(dst.ptr, src.ptr);
  add_f32_kernel<<<grid_for(G * ((dst.n + 3) / 4), Config::kThreads), Config::kThreads, 0,
                   be.stream()>>>(t, vec);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status add_f32_out_sm90(CudaBackend& be, const Segments<const float>& a,
                        const Segments<const float>& b, const Segments<float>& out) {
  const int64_t G = static_cast<int64_t>(out.ptr.size());
  if (G == 0 || out.n == 0) return Status::ok();
  const SegTable<3> t =
      make_table<3>(be, {as_void(a.ptr), as_void(b.ptr), as_void(out.ptr)}, out.n);
  const bool vec = all_aligned16(a.ptr, b.ptr, out.ptr);
  add_f32_out_kernel<<<grid_for(G * ((out.n + 3) / 4), Config::kThreads), Config::kThreads, 0,
                       be.stream()>>>(t, vec);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status adamw_sm90(CudaBackend& be, const AdamWArgs& a) {
  const int64_t G = static_cast<int64_t>(a.param.ptr.size());
  if (G == 0 || a.param.n == 0) return Status::ok();
  const unsigned grid = grid_for(G * ((a.param.n + 3) / 4), Config::kThreads);
  const std::vector<void*> p = as_void(a.param.ptr), m = as_void(a.exp_avg.ptr),
                           v = as_void(a.exp_avg_sq.ptr), g = as_void(a.grad.ptr);
  const bool vec = all_aligned16(a.param.ptr, a.exp_avg.ptr, a.exp_avg_sq.ptr, a.grad.ptr);
  if (a.bf16.ptr.empty()) {
    adamw_kernel<false><<<grid, Config::kThreads, 0, be.stream()>>>(
        make_table<4>(be, {p, m, v, g}, a.param.n), a.scalars, vec, ImageAmax{});
  } else {
    // 4 floats -> 4 BF16 (8 bytes) per thread: the image needs 8-byte alignment for the wide path.
    bool vec8 = vec;
    for (uint16_t* q : a.bf16.ptr) vec8 = vec8 && reinterpret_cast<uintptr_t>(q) % 8 == 0;
    adamw_kernel<true><<<grid, Config::kThreads, 0, be.stream()>>>(
        make_table<5>(be, {p, m, v, g, as_void(a.bf16.ptr)}, a.param.n), a.scalars, vec8,
        ImageAmax{a.amax, a.amax_span, a.amax_first});
  }
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status sum_squares_sm90(CudaBackend& be, const Segments<const float>& x, double* out) {
  const int64_t G = static_cast<int64_t>(x.ptr.size());
  if (G == 0 || x.n == 0) {
    PACKMOE_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), be.stream()));  // +0
    return Status::ok();
  }
  const int64_t cps = (x.n + kSumSquaresChunk - 1) / kSumSquaresChunk;
  const int64_t chunks = G * cps;
  const SegTable<1> t = make_table<1>(be, {as_void(x.ptr)}, x.n);
  const int64_t groups = (chunks + kSumSquaresGroup - 1) / kSumSquaresGroup;
  auto* partial = static_cast<double*>(
      be.workspace(static_cast<size_t>(chunks + groups) * sizeof(double)));  // chunks, then groups
  double* group_sum = partial + chunks;
  sum_squares_chunks_kernel<<<grid_for(chunks, Config::kWarps), Config::kThreads, 0, be.stream()>>>(
      t, cps, chunks, partial);
  PACKMOE_CUDA_CHECK_LAUNCH();
  sum_squares_groups_kernel<<<grid_for(groups, Config::kWarps), Config::kThreads, 0, be.stream()>>>(
      partial, chunks, groups, group_sum);
  PACKMOE_CUDA_CHECK_LAUNCH();
  sum_squares_total_kernel<<<1, 32, 0, be.stream()>>>(group_sum, groups, out);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status nvfp4_decode_scales_sm90(CudaBackend& be, const float* amax, float* decode, int64_t groups) {
  if (groups == 0) return Status::ok();
  nvfp4_decode_scales_kernel<<<grid_for(groups, Config::kThreads), Config::kThreads, 0,
                               be.stream()>>>(amax, decode, groups);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
