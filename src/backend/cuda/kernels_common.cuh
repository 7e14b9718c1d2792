// Shared pieces of the grouped kernels: the per-launch group table (one launch covers every
// group), blockIdx -> group mapping by a prefix sum of tile counts, 16-byte memory helpers and
// the hardware FP8 conversion. Invariant: a kernel never branches on anything but the table, so a
// packed (E, N, K) tensor and E discrete pointers run exactly the same instructions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/codecs.h"

namespace packmoe::cuda {

// Group descriptors of one launch. Up to kInline groups travel inside the kernel parameters (the
// per-expert loop and small packs need no upload); larger tables are uploaded by one async copy.
// Each G has a `tile_begin` field: the exclusive prefix sum of the groups' tile counts.
template <typename G, int kInline>
struct GroupTable {
  const G* uploaded;  // (count,) in device memory, or null when the groups are inline
  int count;
  uint32_t total_tiles;
  G local[kInline];

  // The table is a __grid_constant__ parameter, so indexing `local` at run time reads parameter
  // memory in place instead of copying the array to local memory.
  __device__ __forceinline__ const G& operator[](int g) const {
    return uploaded ? uploaded[g] : local[g];
  }

  // The group of tile `t`: the last g with tile_begin <= t. Empty groups share tile_begin with
  // the next group, so they are never chosen.
  __device__ __forceinline__ int find(uint32_t t) const {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((*this)[mid].tile_begin <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
};

template <typename G, int kInline>
GroupTable<G, kInline> make_group_table(CudaBackend& be, const std::vector<G>& groups,
                                        uint64_t total_tiles) {
  PACKMOE_CHECK(total_tiles < (1ull << 31), "grid of " << total_tiles << " tiles is too large");
  GroupTable<G, kInline> t{};
  t.count = static_cast<int>(groups.size());
  t.total_tiles = static_cast<uint32_t>(total_tiles);
  if (groups.size() <= static_cast<size_t>(kInline)) {
    t.uploaded = nullptr;
    for (size_t g = 0; g < groups.size(); ++g) t.local[g] = groups[g];
  } else {
    t.uploaded = static_cast<const G*>(be.upload(groups.data(), groups.size() * sizeof(G)));
  }
  return t;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- memory
// ----------------------------------------------------------------------------------------

// Streaming 16-byte load of read-once input (no L1 allocation: nothing is re-read by this CTA).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte global -> shared copy that bypasses registers (sm_80+ LDGSTS); `bytes` 0 writes zeros
// (rows or columns outside the matrix). Completion: cp_async_commit / cp_async_wait.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Element i of a 16-byte chunk, as FP32 (BF16 widens exactly).
template <typename In>
__device__ __forceinline__ float chunk_elem(const uint4& v, int i);

template <>
__device__ __forceinline__ float chunk_elem<float>(const uint4& v, int i) {
  const uint32_t w = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  return __uint_as_float(w);
}

template <>
__device__ __forceinline__ float chunk_elem<uint16_t>(const uint4& v, int i) {
  const uint32_t w = (i >> 1) == 0 ? v.x : (i >> 1) == 1 ? v.y : (i >> 1) == 2 ? v.z : v.w;
  return __uint_as_float((i & 1) ? (w & 0xFFFF0000u) : (w << 16));
}

// Scalar element load for the unaligned / ragged fallback paths.
template <typename In>
__device__ __forceinline__ float load_elem(const In* p);
template <>
__device__ __forceinline__ float load_elem<float>(const float* p) {
  return __ldg(p);
}
template <>
__device__ __forceinline__ float load_elem<uint16_t>(const uint16_t* p) {
  return bf16_to_f32(__ldg(p));
}

// ---- FP8 conversion
// --------------------------------------------------------------------------------

// Hardware RNE + satfinite conversion of (lo, hi) to two FP8 bytes, lo in the low byte. Used only
// where the exhaustive self-test (selftest.cu) proved it equal to the software codec.
template <bool kE5M2>
__device__ __forceinline__ uint32_t cvt_fp8x2(float lo, float hi) {
  uint16_t r;
  if constexpr (kE5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// One grid-stride-free launch shape: ceil(n / per) blocks.
inline unsigned blocks_for(uint64_t n, uint64_t per) {
  const uint64_t b = (n + per - 1) / per;
  PACKMOE_CHECK(b < (1ull << 31), "grid of " << b << " blocks is too large");
  return static_cast<unsigned>(b);
}

}  // namespace packmoe::cuda
