// The routing plan on the GPU (backend/ops/moe.h RoutingPlanArgs): build_routing_plan's dest and
// row_slot without copying idx to the host. Three launches over chunks of kChunkSlots (t, j) pairs:
//   count:   per chunk, routed pairs per expert (shared-memory atomics: integer counts have no
//            order) -> hist (chunks, E + 1), column E = indices outside [0, E)
//   scan:    per expert, the chunk bases in chunk order, plus the expert's first row (exclusive
//            scan of the padded counts) -> hist becomes each chunk's first row per expert;
//            the padded counts and their sum M stay on the device (the GEMMs' m_device)
//   scatter: each chunk walks its pairs in order, 256 at a time; a pair's row is its chunk base
//            plus the same-expert pairs before it (earlier warps, then earlier lanes)
// So every expert's rows hold its pairs in increasing (t, j) order, the host plan's order: the
// same bytes whatever the scheduling.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/reduce_order.cuh"  // kFullMask
#include "backend/ops/moe.h"

namespace packmoe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunkSlots = 4096;  // (t, j) pairs per CTA in count and scatter
constexpr int64_t kMaxExperts = 1024;  // scatter keeps (1 + kWarps) E int32 in shared memory

__global__ void __launch_bounds__(kThreads)
    plan_count_kernel(const int32_t* idx, int64_t slots, int64_t experts, int32_t* hist) {
  extern __shared__ int32_t bins[];  // (E + 1)
  for (int64_t e = threadIdx.x; e <= experts; e += kThreads) bins[e] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * kChunkSlots;
  const int64_t end = min(begin + kChunkSlots, slots);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const int32_t e = __ldg(idx + i);
    atomicAdd(&bins[e >= 0 && e < experts ? e : experts], 1);
  }
  __syncthreads();
  int32_t* row = hist + blockIdx.x * (experts + 1);
  for (int64_t e = threadIdx.x; e <= experts; e += kThreads) row[e] = bins[e];
}

// One CTA. counts (E + 1) = column totals; padded (E) = padded counts, rows (1) = their sum M;
// hist[c][e] = first row of expert e's pairs in chunk c.
__global__ void __launch_bounds__(kThreads)
    plan_scan_kernel(int32_t* hist, int64_t chunks, int64_t experts, int64_t align,
                     int64_t* counts, int64_t* padded, int64_t* rows) {
  extern __shared__ int64_t first_row[];  // (E): offsets[e]
  for (int64_t e = threadIdx.x; e <= experts; e += kThreads) {
    int64_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t& v = hist[c * (experts + 1) + e];
      const int32_t n = v;
      v = static_cast<int32_t>(run);
      run += n;
    }
    counts[e] = run;
    if (e < experts) first_row[e] = (run + align - 1) / align * align;  // padded count, for now
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0: exclusive scan, lane l owns a run of `per` experts
    const int lane = threadIdx.x;
    const int64_t per = (experts + 31) / 32;
    const int64_t lo = min(experts, lane * per), hi = min(experts, lo + per);
    int64_t sum = 0;
    for (int64_t e = lo; e < hi; ++e) sum += first_row[e];
    int64_t before = sum;  // inclusive scan over lanes, then minus own sum
    for (int off = 1; off < 32; off *= 2) {
      const int64_t v = __shfl_up_sync(kFullMask, before, off);
      if (lane >= off) before += v;
    }
    before -= sum;
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t n = first_row[e];
      padded[e] = n;
      first_row[e] = before;
      before += n;
    }
    if (lane == 31) *rows = before;  // the last lane's run ends at M
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += kThreads)
    for (int64_t c = 0; c < chunks; ++c)
      hist[c * (experts + 1) + e] += static_cast<int32_t>(first_row[e]);
}

__global__ void __launch_bounds__(kThreads)
    plan_scatter_kernel(const int32_t* idx, int64_t slots, int64_t experts, const int32_t* hist,
                        int32_t* dest, int32_t* row_slot) {
  extern __shared__ int32_t smem[];
  int32_t* next_row = smem;              // (E): the chunk's next row per expert
  int32_t* warp_count = smem + experts;  // (kWarps, E): this round's pairs per warp and expert
  const int32_t* base = hist + blockIdx.x * (experts + 1);
  for (int64_t e = threadIdx.x; e < experts; e += kThreads) next_row[e] = base[e];
  for (int64_t i = threadIdx.x; i < kWarps * experts; i += kThreads) warp_count[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t begin = blockIdx.x * kChunkSlots;
  const int64_t end = min(begin + kChunkSlots, slots);
  for (int64_t round = begin; round < end; round += kThreads) {
    const int64_t i = round + threadIdx.x;
    const int32_t raw = i < end ? __ldg(idx + i) : -1;
    const int32_t e = raw >= 0 && raw < experts ? raw : -1;  // -1: no pair (bad idx: host error)
    const unsigned peers = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == __ffs(peers) - 1) warp_count[warp * experts + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int32_t r = next_row[e] + __popc(peers & ((1u << lane) - 1u));
      for (int w = 0; w < warp; ++w) r += warp_count[w * experts + e];
      dest[i] = r;
      row_slot[r] = static_cast<int32_t>(i);
    }
    __syncthreads();
    for (int64_t x = threadIdx.x; x < experts; x += kThreads) {
      int32_t n = 0;
      for (int w = 0; w < kWarps; ++w) {
        n += warp_count[w * experts + x];
        warp_count[w * experts + x] = 0;
      }
      next_row[x] += n;
    }
    __syncthreads();
  }
}

}  // namespace

Status routing_plan_sm90(CudaBackend& be, const RoutingPlanArgs& a) {
  if (a.experts > kMaxExperts)
    return Status::error("routing_plan: E = " + std::to_string(a.experts) +
                         " experts, the CUDA plan supports at most " +
                         std::to_string(kMaxExperts));
  const int64_t slots = a.tokens * a.top_k, E = a.experts;
  const int64_t chunks = (slots + kChunkSlots - 1) / kChunkSlots;
  auto* hist = static_cast<int32_t*>(
      be.workspace(static_cast<size_t>(chunks * (E + 1)) * sizeof(int32_t)));
  PACKMOE_CUDA_CHECK(cudaMemsetAsync(a.row_slot, 0xFF,
                                     static_cast<size_t>(a.max_rows) * sizeof(int32_t), be.stream()));
  const unsigned grid = static_cast<unsigned>(chunks);
  plan_count_kernel<<<grid, kThreads, (E + 1) * sizeof(int32_t), be.stream()>>>(a.idx, slots, E,
                                                                               hist);
  PACKMOE_CUDA_CHECK_LAUNCH();
  plan_scan_kernel<<<1, kThreads, E * sizeof(int64_t), be.stream()>>>(hist, chunks, E, a.align,
                                                                    a.counts, a.padded_counts, a.rows);
  PACKMOE_CUDA_CHECK_LAUNCH();
  plan_scatter_kernel<<<grid, kThreads, (1 + kWarps) * E * sizeof(int32_t), be.stream()>>>(
      a.idx, slots, E, hist, a.dest, a.row_slot);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
