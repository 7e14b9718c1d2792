// The work table of the sm_90a grouped GEMM (grouped_gemm_sm90.cu) and the one-CTA "schedule"
// kernel that writes it on the device when the token counts live there (GroupedGemmArgs::m_device):
// it reads the G counts, checks them, and writes what the host builds from host counts: the table
// of active groups (unit_begin prefix), the work counts and the per-row TMA maps, copied from
// host-encoded templates with the token dimension patched by tensormap.replace. Several CTAs: each computes the (cheap) prefix sums itself and writes its
// share of the maps; CTA 0 checks the counts and writes the table. Invariant: the table and maps
// equal the host-built ones for the same counts, so both paths run the same tiles in the same
// summation order (the same bytes).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cstdio>

#include "backend/cuda/grouped_gemm_sm90_ptx.cuh"
#include "backend/cuda/grouped_gemm_sm90_tiles.h"

namespace packmoe::sm90 {

// One active group on the device. Work comes in units of one tile per CTA of the cluster: for a
// cluster of 2, pairs of m-tiles sharing an n-tile (B multicast) and, when m_tiles is odd, the
// last m-tile's pairs of n-tiles (A multicast). Unit order: bands of `band` n-tiles, m-rows of
// the band one after the other, n fastest (the band's B stays in L2 while its rows pass).
struct GroupTiles {
  int32_t mk, kred;
  int32_t unit_begin;
  int32_t m_tiles;
  int32_t band;
  int32_t group;  // the caller's group index (alpha); tensor maps are indexed like this table
};

// What the GEMM kernel reads before its first tile: the table's length and the units over it.
struct Sm90Work {
  int32_t num_groups;
  int32_t total_units;
};

// Which dimension of a map counts tokens (patched per group to m_g); none: a weight-side map.
enum class TokenDim : int32_t { kNone = 0, kOuter = 1, kInner = 2 };

// One of the A / B / C maps. Row r of `out` is table row r (group g): the template of group g,
// for a token-side map with the address moved to base + off_g * token_bytes and the token
// dimension set to m_g (kInner: the stride of the outer dimension to m_g * elem_bytes too).
struct ScheduleMap {
  const CUtensorMap* templates;  // (G,)
  CUtensorMap* out;              // (G,) rows used: the active groups
  uint64_t base;
  int64_t token_bytes;
  int32_t elem_bytes;
  TokenDim dim;
};

constexpr int kScheduleThreads = 256;
constexpr int kMaxScheduleGroups = 1024;
// CTAs of the schedule launch for G groups: about one (row, map) item per warp, at most 3 G.
inline int schedule_ctas(int64_t groups) {
  const int64_t ctas = (3 * groups + kScheduleThreads / 32 - 1) / (kScheduleThreads / 32);
  return static_cast<int>(ctas < 1 ? 1 : ctas > 132 ? 132 : ctas);
}

struct ScheduleParams {
  const int64_t* m;  // (G,) token counts in device memory
  int32_t groups;
  int32_t align;     // every m_g is a multiple of it
  int64_t capacity;  // the counts sum to at most this
  bool tokens_reduce;  // wgrad: kred_g = m_g, mk_g = fixed; else mk_g = m_g, kred_g = fixed
  int32_t fixed;
  int32_t bn, cluster, n_tiles;
  GroupTiles* table;  // (G,)
  Sm90Work* work;
  ScheduleMap maps[3];  // A, B, C
};

// A count the host never saw is wrong: one line on the device's printf, then a trap (the CUDA
// context is lost; the caller's next CUDA call reports it).
__device__ __forceinline__ void schedule_fail(const char* what, int g, long long v, long long lim) {
  printf("packmoe grouped_gemm: device token counts: %s (group %d: %lld, limit %lld)\n", what, g, v,
         lim);
  __trap();
}

__global__ void __launch_bounds__(kScheduleThreads)
    sm90_schedule_kernel(const __grid_constant__ ScheduleParams p) {
  __shared__ int64_t m_s[kMaxScheduleGroups];
  __shared__ int64_t off_s[kMaxScheduleGroups];    // first token row of group g
  __shared__ int32_t units_s[kMaxScheduleGroups];  // work units of group g, then its unit_begin
  __shared__ int32_t group_of_row[kMaxScheduleGroups];
  __shared__ int32_t rows_s;
  __shared__ alignas(128) CUtensorMap staged[kScheduleThreads / 32];
  const int tid = threadIdx.x, G = p.groups;
  const bool first = blockIdx.x == 0;  // checks the counts, writes the table

  // Counts and each group's units, in parallel.
  for (int g = tid; g < G; g += kScheduleThreads) {
    const int64_t mg = p.m[g];
    if (first && (mg < 0 || mg % p.align != 0))
      schedule_fail("a count is negative or not a multiple of the alignment", g, mg, p.align);
    if (first && mg > p.capacity) schedule_fail("a count exceeds m_capacity", g, mg, p.capacity);
    m_s[g] = mg;
    const int64_t mk = p.tokens_reduce ? p.fixed : mg;
    units_s[g] = mg > 0 ? static_cast<int32_t>(sm90_units((mk + kSm90TileM - 1) / kSm90TileM,
                                                          p.n_tiles, p.cluster))
                        : 0;
  }
  __syncthreads();
  // Prefix sums (one thread; a few instructions per group).
  if (tid == 0) {
    int64_t sum = 0, units = 0;
    int32_t rows = 0;
    for (int g = 0; g < G; ++g) {
      off_s[g] = sum;
      sum += m_s[g];
      if (first && sum > p.capacity)
        schedule_fail("the counts sum past m_capacity", g, sum, p.capacity);
      const int32_t u = units_s[g];
      units_s[g] = static_cast<int32_t>(units);
      units += u;
      if (m_s[g] > 0) group_of_row[rows++] = g;
    }
    if (first && units >= (int64_t{1} << 30))
      schedule_fail("too many work units", G - 1, units, 1 << 30);
    rows_s = rows;
    if (first) *p.work = Sm90Work{rows, static_cast<int32_t>(units)};
  }
  __syncthreads();
  const int rows = rows_s;

  // The table, a row per thread of CTA 0.
  for (int r = tid; first && r < rows; r += kScheduleThreads) {
    const int g = group_of_row[r];
    const int64_t mg = m_s[g];
    const int64_t mk = p.tokens_reduce ? p.fixed : mg, kred = p.tokens_reduce ? mg : p.fixed;
    const int64_t m_tiles = (mk + kSm90TileM - 1) / kSm90TileM;
    p.table[r] = GroupTiles{static_cast<int32_t>(mk), static_cast<int32_t>(kred), units_s[g],
                            static_cast<int32_t>(m_tiles), sm90_band(p.bn, kred, p.n_tiles), g};
  }

  // The maps: warp w of the grid takes (row, map) items w, w + warps, ...; lanes 0-7 copy the
  // template into shared memory, lane 0 patches it, the whole warp copies it out with the
  // release to the tensormap proxy.
  constexpr int kWarps = kScheduleThreads / 32;
  const int warp = tid / 32, lane = tid % 32;
  const uint32_t stage = smem_addr(&staged[warp]);
  for (int item = blockIdx.x * kWarps + warp; item < 3 * rows; item += gridDim.x * kWarps) {
    const int r = item / 3;
    const ScheduleMap& mp = p.maps[item % 3];
    const int g = group_of_row[r];
    if (lane < 8)
      reinterpret_cast<uint4*>(&staged[warp])[lane] =
          reinterpret_cast<const uint4*>(mp.templates + g)[lane];
    __syncwarp();
    if (lane == 0) {
      if (mp.dim != TokenDim::kNone) {
        const uint32_t mg = static_cast<uint32_t>(m_s[g]);
        tensormap_set_address(stage, mp.base + static_cast<uint64_t>(off_s[g] * mp.token_bytes));
        if (mp.dim == TokenDim::kOuter) {
          tensormap_set_dim<1>(stage, mg);
        } else {
          tensormap_set_dim<0>(stage, mg);
          tensormap_set_stride<0>(stage, static_cast<uint64_t>(mg) * mp.elem_bytes);
        }
      }
    }
    __syncwarp();
    tensormap_publish(mp.out + r, stage);
    __syncwarp();
  }
}

}  // namespace packmoe::sm90
