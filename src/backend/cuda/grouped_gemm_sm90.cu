// The sm_90a grouped GEMM (grouped_gemm_sm90.h): a persistent, warp-specialized wgmma kernel.
// Design notes and measurements: docs/gemm-sm90.md.
//
// Work: the output of every active group is cut into kSm90TileM x BN tiles (BN from the tile
// heuristic, grouped_gemm_sm90_tiles.h). A cluster of kCluster CTAs (1 or 2) takes one work unit
// at a time: with 2, two m-tiles that share their n-tile (each CTA loads half of the B tile and
// multicasts it to both) or, for the last m-tile of a group with an odd count, two n-tiles that
// share it (A multicast). Units run over all groups (table of unit_begin per group, read on the
// device); inside a group in bands of n-tiles whose B fits in L2, the band's m-rows one after
// the other. Cluster c takes units c, c + clusters, ... (a persistent grid of resident CTAs).
//
// CTA = 3 warpgroups. Warpgroup 0 gives registers away (setmaxnreg) and one thread of it is the
// producer: per 64-deep reduction step it waits until the stage is free in every CTA of the
// cluster (`empty` mbarrier), announces the stage's bytes on its `full` mbarrier and issues the
// TMA loads of the A (128 x 64) and B (64 x BN) tiles. Warpgroups 1 and 2 are the consumers, rows
// [0, 64) and [64, 128) of the tile: per stage they wait on `full`, issue four m64nBNk16 wgmmas
// (FP32 accumulators in registers) and release the stage in both CTAs once those wgmmas have
// completed (one step later, so the tensor cores always have the next stage queued). After the
// last step each consumer writes its 64 x BN fragment into 16 KB of swizzled shared memory and one
// thread stores it with TMA (clipped at the group's rows and columns; FP32 accumulation into
// main_grad is a TMA reduce-add), while the warpgroup goes on with the next unit.
//
// Streaming dequantize (Params::dq_jobs): warps 1-3 of warpgroup 0 convert quantized operands into
// the BF16 storage the maps read, group by group, while the consumers compute; a producer waits
// until its tile's group is converted (the section "streaming dequantize" below).
//
// Shared memory, 128-byte swizzle (the TMA maps and the wgmma descriptors agree on it):
//   K-major operand (rows x 64 reduction elements): row r at r * 128 B, 8-row atoms of 1024 B; a
//     wgmma k16 step advances the descriptor's start by 32 B inside the swizzle row.
//   MN-major operand (64 reduction rows x 64 output elements per 8 KB block, blocks along MN):
//     reduction row k at k * 128 B; leading byte offset = 8192 (next 64 MN elements), stride byte
//     offset = 1024 (next 8 reduction rows); a k16 step advances the start by 2048 B.
// Partial tiles: TMA fills elements outside a group's tensor with zeros, so rows beyond m_g add
// exact zeros to a wgrad reduction and partial M / N / K tiles need no special path.
//
// Exactness and determinism: the products of BF16 values are exact in FP32 and each output is the
// FP32 sum over the reduction in a fixed order (64-wide steps, wgmma's internal order inside a
// step); no split-K, no atomics (the reduce-add touches each element once). The same shapes give
// the same bytes, wherever the operands live.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backend/cuda/grouped_gemm_sm90.h"
#include "backend/cuda/grouped_gemm_dequant.cuh"
#include "backend/cuda/grouped_gemm_sm90_ptx.cuh"
#include "backend/cuda/grouped_gemm_sm90_schedule.cuh"
#include "backend/cuda/grouped_gemm_sm90_tiles.h"
#include "backend/cuda/kernel_policy.h"

namespace packmoe {
namespace {

using namespace sm90;

constexpr int kThreads = 384;            // producer warpgroup + 2 consumer warpgroups
constexpr int kBox = 64;                 // elements in one 128-byte swizzle row
constexpr int kBlockBytes = kBox * kSm90TileK * 2;  // one 64 x 64 BF16 box: 8 KB
constexpr int kEpiBytes = 16384;         // epilogue staging per consumer warpgroup
constexpr int kConverters = 96;         // streaming dequantize: warps 1-3 of warpgroup 0
constexpr int kConvertChunk = 24576;    // elements a converter warp takes at a time
// Registers per thread after setmaxnreg: the producer warpgroup (with the converters) and the
// consumers. The launch gives every thread the 168 of __launch_bounds__, so
// what the producers release must be what the consumers take: 128 * 152 + 256 * 176 = 384 * 168.
// ptxas compiles the code after each setmaxnreg within its count, except that a wgmma's register
// operands must fit the launch bound's 168 (m64n256k16 needs 154; docs/gemm-sm90.md). The
// consumers spill a few bytes at BN = 256 when setmaxnreg is left out altogether.
constexpr int kProducerRegs = 152;
constexpr int kConsumerRegs = 176;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs == kThreads * 168, "balanced setmaxnreg");
static_assert(kSm90TileK == kBox, "one swizzle row per reduction step");

// Shared memory of one CTA: the TMA ring of BF16 stages (A tile, then B tile), the two consumers'
// epilogue staging, the ring's mbarriers.
template <int BN>
struct Layout {
  static constexpr int kABytes = kSm90TileM * kSm90TileK * 2;
  static constexpr int kBBytes = BN * kSm90TileK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr int kEpiOffset = kStages * kStageBytes;
  static constexpr int kBarOffset = kEpiOffset + 2 * kEpiBytes;
  static constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + 1024-byte align
  static_assert(kSmemBytes <= 232448, "more shared memory than an sm_90 CTA has");
  static_assert(kStageBytes % 1024 == 0 && kEpiOffset % 1024 == 0, "swizzle atoms 1024-aligned");
};

struct Params {
  const CUtensorMap* a_maps;  // per table row: A, boxes (64 reduction, 64 rows) / (64 rows, 64)
  const CUtensorMap* b_maps;  // B, boxes (64 reduction, BN / 2 cols) / (64 cols, 64 reduction)
  const CUtensorMap* c_maps;  // output, boxes (64 or 32 cols, 64 rows)
  const GroupTiles* groups;
  const Sm90Work* work;  // active groups and work units, in device memory (see Sm90Work)
  int32_t n_tiles, nk;
  int32_t out_mode;  // 0: FP32, 1: BF16, 2: FP32 added to the output
  const float* alpha_lhs;
  const float* alpha_rhs;
  // Streaming dequantize (null: the operands are BF16 already): jobs 2 row and 2 row + 1 convert
  // table row `row`'s A and B into the BF16 storage its maps read, then a sentinel; `begin` counts
  // chunks of kConvertChunk elements. dq_counters (zeroed before the launch): [0] the next chunk
  // to take, [1 + row] the chunks of that row converted.
  const gemm_convert::DequantJob* dq_jobs;
  int32_t dq_rows;
  uint32_t* dq_counters;
};

__device__ __forceinline__ int find_group(const GroupTiles* t, int count, int unit) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t[mid].unit_begin <= unit)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// This CTA's tile of a unit. `shares_b`: the cluster's CTAs share the n-tile (else the m-tile).
struct TileAt {
  int gi, m0, n0;
  bool shares_b;
};

template <int BN, int kCluster>
__device__ __forceinline__ TileAt tile_of(const Params& p, const Sm90Work& w, int unit, int rank,
                                          GroupTiles& g) {
  TileAt t;
  t.gi = find_group(p.groups, w.num_groups, unit);
  g = p.groups[t.gi];
  const int u = unit - g.unit_begin;
  const int rows = g.m_tiles / kCluster;  // m-rows of units that pair m-tiles
  const int paired = rows * p.n_tiles;
  int mt, nt;
  if (u < paired) {
    const int per_band = rows * g.band;
    const int band = u / per_band;
    const int width = min(g.band, p.n_tiles - band * g.band);
    const int o = u - band * per_band;
    mt = (o / width) * kCluster + rank;
    nt = band * g.band + o % width;
    t.shares_b = true;
  } else {  // cluster of 2, odd m_tiles: the last m-tile, pairs of n-tiles
    mt = g.m_tiles - 1;
    nt = (u - paired) * kCluster + rank;
    t.shares_b = false;
  }
  t.m0 = mt * kSm90TileM;
  t.n0 = nt * BN;
  return t;
}

template <int BN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_step(float (&acc)[BN / 2], uint64_t da, uint64_t db,
                                           uint32_t scale_d) {
  if constexpr (BN == 256)
    wgmma_m64n256k16<kTransA, kTransB>(acc, da, db, scale_d);
  else
    wgmma_m64n128k16<kTransA, kTransB>(acc, da, db, scale_d);
}

// Loads box `part` (0 or 1) of half an operand tile: own (this CTA only) or multicast to both.
__device__ __forceinline__ void load_box(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                         int c1, bool multicast) {
  if (multicast)
    tma_load_2d_multicast(dst, map, bar, c0, c1, 0x3);
  else
    tma_load_2d(dst, map, bar, c0, c1);
}

template <int BN, bool kAKMajor, bool kBKMajor, int kCluster>
__device__ __forceinline__ void produce(const Params& p, const Sm90Work& w, uint8_t* smem, uint64_t* full,
                                        uint64_t* empty, int rank) {
  using L = Layout<BN>;
  constexpr int kHalfB = L::kBBytes / 2;  // bytes of BN / 2 columns
  int stage = 0;
  uint32_t phase = 0;
  int converted_row = -1;  // streaming dequantize: the last table row known to be converted
  for (int unit = blockIdx.x / kCluster; unit < w.total_units; unit += gridDim.x / kCluster) {
    GroupTiles g;
    const TileAt at = tile_of<BN, kCluster>(p, w, unit, rank, g);
    const CUtensorMap* am = p.a_maps + at.gi;
    const CUtensorMap* bm = p.b_maps + at.gi;
    tensormap_acquire(am);
    tensormap_acquire(bm);
    if (p.dq_jobs != nullptr && at.gi != converted_row) {
      // The group's BF16 operands are written by the converters of every CTA (stream_dequant).
      const uint32_t chunks = p.dq_jobs[2 * at.gi + 2].begin - p.dq_jobs[2 * at.gi].begin;
      wait_counter(p.dq_counters + 1 + at.gi, chunks);
      fence_async_global();  // the acquired BF16 writes come before this thread's TMA reads
      converted_row = at.gi;
    }
    // With a cluster, the shared operand is loaded half by each CTA, multicast to both.
    const bool mc_a = kCluster == 2 && !at.shares_b, mc_b = kCluster == 2 && at.shares_b;
    const int k_steps = (g.kred + kSm90TileK - 1) / kSm90TileK;
    for (int ks = 0; ks < k_steps; ++ks) {
      mbar_wait(&empty[stage], phase ^ 1);  // free in every CTA of the cluster
      uint8_t* sa = smem + stage * L::kStageBytes;
      uint8_t* sb = sa + L::kABytes;
      uint64_t* bar = &full[stage];
      mbar_arrive_expect_tx(bar, L::kStageBytes);
      const int k0 = ks * kSm90TileK;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // A: rows [64 h, 64 h + 64)
        if (mc_a && h != rank) continue;
        const int r0 = at.m0 + h * 64;
        if constexpr (kAKMajor)
          load_box(sa + h * (L::kABytes / 2), am, bar, k0, r0, mc_a);
        else
          load_box(sa + h * kBlockBytes, am, bar, r0, k0, mc_a);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // B: columns [BN / 2 h, BN / 2 (h + 1))
        if (mc_b && h != rank) continue;
        const int c0 = at.n0 + h * (BN / 2);
        if constexpr (kBKMajor) {
          load_box(sb + h * kHalfB, bm, bar, k0, c0, mc_b);
        } else {
#pragma unroll
          for (int j = 0; j < BN / 128; ++j)
            load_box(sb + h * kHalfB + j * kBlockBytes, bm, bar, c0 + j * kBox, k0, mc_b);
        }
      }
      if (++stage == L::kStages) stage = 0, phase ^= 1;
    }
  }
}

// ---- streaming dequantize -----------------------------------------------------------------------
// With quantized operands (host token counts), the pre-pass's work runs inside this launch: the 3
// converter warps of every CTA each take chunks of kConvertChunk elements in job order (row 0's A
// and B, row 1's, ...) from one global counter, convert each exactly as the pre-pass does
// (grouped_gemm_dequant.cuh) into the BF16 storage the maps read, and count the chunk as done
// for its table row; a producer waits until every chunk of its tile's row is done. Units run in
// row order, so conversion stays ahead of the tensor cores after the first rows, and the BF16
// values are written while other tiles compute. Any resident CTA takes chunks until none is left,
// so no CTA waits for one that is not running.

// A warp converts its chunk in rounds of kUnroll 16-element loads per lane (lane l: elements
// [16 (u * 32 + l), + 16) of the round), loading round r + 1 before converting and storing
// round r, so up to 2 kUnroll loads per lane are in flight (kUnroll = 4: both buffers and the
// addresses fit kProducerRegs without spills).
template <gemm_convert::DequantKind kKind>
__device__ __forceinline__ void convert_chunk(const gemm_convert::DequantJob& job, int64_t base,
                                              int lane) {
  using namespace gemm_convert;
  constexpr int kUnroll = 4;
  constexpr int kRound = 32 * 16 * kUnroll;
  constexpr int kRounds = kConvertChunk / kRound;
  static_assert(kConvertChunk % (2 * kRound) == 0, "pairs of rounds: buffer 0, then buffer 1");
  const int64_t first = base + lane * 16;  // this lane's first element
  Raw8 lo0[kUnroll], hi0[kUnroll], lo1[kUnroll], hi1[kUnroll];
  auto load = [&](int r, Raw8 (&lo)[kUnroll], Raw8 (&hi)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = first + r * kRound + u * 512;
      if (e < job.elems) load16<kKind>(job, e, lo[u], hi[u]);
    }
  };
  auto store = [&](int r, const Raw8 (&lo)[kUnroll], const Raw8 (&hi)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = first + r * kRound + u * 512;
      if (e < job.elems) {
        store8<false>(job.out, e, convert8<kKind>(lo[u]));
        store8<false>(job.out, e + 8, convert8<kKind>(hi[u]));
      }
    }
  };
  load(0, lo0, hi0);
#pragma unroll 1
  for (int r = 0; r < kRounds; r += 2) {
    load(r + 1, lo1, hi1);
    store(r, lo0, hi0);
    if (r + 2 < kRounds) load(r + 2, lo0, hi0);
    store(r + 1, lo1, hi1);
  }
}

// One converter warp (lane 0 takes the chunks and signals them done).
__device__ __forceinline__ void stream_dequant(const Params& p, int lane) {
  using gemm_convert::DequantKind;
  const uint32_t total = p.dq_jobs[2 * p.dq_rows].begin;
  uint32_t next = lane == 0 ? atomicAdd(p.dq_counters, 1u) : 0;
  // Chunks come in increasing order, so the job only ever moves forward (no search per chunk).
  int j = 0;
  gemm_convert::DequantJob job = p.dq_jobs[0];
  uint32_t job_end = p.dq_jobs[1].begin;
  for (;;) {
    const uint32_t chunk = __shfl_sync(0xFFFFFFFFu, next, 0);
    if (chunk >= total) break;
    if (lane == 0) next = atomicAdd(p.dq_counters, 1u);  // in flight while this chunk converts
    while (chunk >= job_end) {
      job = p.dq_jobs[++j];
      job_end = p.dq_jobs[j + 1].begin;
    }
    const int64_t base = static_cast<int64_t>(chunk - job.begin) * kConvertChunk;
    switch (job.kind) {
      case DequantKind::kE4m3Rowwise: convert_chunk<DequantKind::kE4m3Rowwise>(job, base, lane); break;
      case DequantKind::kE4m3Columnwise: convert_chunk<DequantKind::kE4m3Columnwise>(job, base, lane); break;
      case DequantKind::kE5m2Rowwise: convert_chunk<DequantKind::kE5m2Rowwise>(job, base, lane); break;
      case DequantKind::kE5m2Columnwise: convert_chunk<DequantKind::kE5m2Columnwise>(job, base, lane); break;
      case DequantKind::kNvfp4: convert_chunk<DequantKind::kNvfp4>(job, base, lane); break;
    }
    fence_async_global();  // this lane's BF16 writes, for the TMA reads of other CTAs
    __syncwarp();          // every lane's writes are ordered before lane 0's release
    if (lane == 0) {
      __threadfence();
      red_release_add(p.dq_counters + 1 + j / 2, 1u);
    }
  }
}

// A stage of the cluster's TMA ring has been read by this warpgroup: one arrival on its `empty`
// barrier in every CTA of the cluster (each CTA's ring is filled from both).
template <int kCluster>
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  if constexpr (kCluster == 2) {
    mbar_arrive_cluster(empty, 0);
    mbar_arrive_cluster(empty, 1);
  } else {
    mbar_arrive(empty);
  }
}

// The main loop of one tile on BF16 operands: per step, wait for the TMA stage, issue its
// wgmmas, and release the previous stage once its wgmmas are done.
template <int BN, bool kAKMajor, bool kBKMajor, int kCluster>
__device__ __forceinline__ void mainloop_tma(uint32_t smem_base, uint64_t* full, uint64_t* empty,
                                             int half, int t, int k_steps, float (&acc)[BN / 2],
                                             int& stage, uint32_t& phase) {
  using L = Layout<BN>;
  constexpr int kTransA = kAKMajor ? 0 : 1, kTransB = kBKMajor ? 0 : 1;
  // Descriptor steps per k16: 32 B inside the swizzle row (K-major), two 8-row atoms (MN-major).
  constexpr uint32_t kStepA = kAKMajor ? 32 : 2048, kStepB = kBKMajor ? 32 : 2048;
  constexpr uint32_t kLboA = kAKMajor ? 16 : kBlockBytes, kLboB = kBKMajor ? 16 : kBlockBytes;
  int prev = 0;
  for (int ks = 0; ks < k_steps; ++ks) {
    mbar_wait(&full[stage], phase);
    // This warpgroup's 64 rows of A: the second 8 KB (64 rows x 128 B, or the second MN box).
    const uint32_t sa = smem_base + stage * L::kStageBytes + half * kBlockBytes;
    const uint32_t sb = smem_base + stage * L::kStageBytes + L::kABytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSm90TileK / 16; ++kk) {
      const uint64_t da = wgmma_desc(sa + kk * kStepA, kLboA, 1024);
      const uint64_t db = wgmma_desc(sb + kk * kStepB, kLboB, 1024);
      wgmma_step<BN, kTransA, kTransB>(acc, da, db, (ks | kk) != 0 ? 1u : 0u);
    }
    wgmma_commit();
    if (ks > 0) {
      wgmma_wait<1>();  // the previous step's wgmmas are done: its stage is free
      if (t == 0) release_stage<kCluster>(&empty[prev]);
    }
    prev = stage;
    if (++stage == L::kStages) stage = 0, phase ^= 1;
  }
  wgmma_wait<0>();
  if (t == 0) release_stage<kCluster>(&empty[prev]);
}

// Consumer warpgroup `half` (0: tile rows [0, 64), 1: [64, 128)), thread t of it.
template <int BN, bool kAKMajor, bool kBKMajor, int kCluster>
__device__ __forceinline__ void consume(const Params& p, const Sm90Work& w, uint8_t* smem, uint64_t* full,
                                        uint64_t* empty, int rank, int half, int t) {
  using L = Layout<BN>;
  const uint32_t smem_base = smem_addr(smem);
  const uint32_t epi = smem_base + L::kEpiOffset + half * kEpiBytes;
  uint8_t* epi_ptr = smem + L::kEpiOffset + half * kEpiBytes;
  const int warp = t / 32, lane = t % 32;
  const int bar_id = 1 + half;
  float acc[BN / 2];
  int stage = 0;
  uint32_t phase = 0;
  for (int unit = blockIdx.x / kCluster; unit < w.total_units; unit += gridDim.x / kCluster) {
    GroupTiles g;
    const TileAt at = tile_of<BN, kCluster>(p, w, unit, rank, g);
    const int k_steps = (g.kred + kSm90TileK - 1) / kSm90TileK;
    mainloop_tma<BN, kAKMajor, kBKMajor, kCluster>(smem_base, full, empty, half, t, k_steps, acc,
                                                   stage, phase);

    // Epilogue: the fragment (row 16 warp + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1)) is
    // written into 16 KB of shared memory in the output map's 128-byte swizzled boxes of 64 rows,
    // then one thread stores the boxes with TMA (clipped at mk and nk) while the warpgroup goes on.
    const int row0 = at.m0 + half * 64;
    const CUtensorMap* cm = p.c_maps + at.gi;
    if (t == 0) tensormap_acquire(cm);
    const float alpha = p.alpha_lhs != nullptr ? p.alpha_lhs[g.group] * p.alpha_rhs[g.group] : 1.0f;
    const bool scaled = p.alpha_lhs != nullptr;
    const int r_lo = warp * 16 + lane / 4;  // rows r_lo and r_lo + 8 of the 64
    const uint32_t sw = static_cast<uint32_t>(r_lo % 8);  // the same for r_lo + 8
    constexpr int kBf16Chunks = BN / 128, kF32Chunks = BN / 64;  // 16 KB each
    const bool bf16 = p.out_mode == 1;
    const int chunks = bf16 ? kBf16Chunks : kF32Chunks;
    const int chunk_cols = bf16 ? 128 : 64;
    const int box_cols = bf16 ? 64 : 32;
#pragma unroll
    for (int c = 0; c < kF32Chunks; ++c) {
      if (c >= chunks) break;
      if (t == 0) bulk_wait_all<true>();  // the last store from this buffer has read it
      named_barrier_sync(bar_id, 128);
      if (bf16) {
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {  // 8 columns each, 2 boxes of 64 columns
          const int j = (c * 16 + jj) % (BN / 8);
          const uint32_t box = jj / 8, chunk16 = (jj % 8);  // 16-byte chunk of the 128-byte row
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
            if (scaled) v0 *= alpha, v1 *= alpha;
            const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
            const uint32_t r = r_lo + 8 * i;
            st_shared_b32(epi + box * 8192 + r * 128 + ((chunk16 ^ sw) << 4) + (lane % 4) * 4,
                          *reinterpret_cast<const uint32_t*>(&h));
          }
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {  // 8 columns each, 2 boxes of 32 columns
          const int j = c * 8 + jj;
          const uint32_t box = jj / 4;
          const uint32_t chunk16 = (jj % 4) * 2 + (lane % 4) / 2;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
            if (scaled) v0 *= alpha, v1 *= alpha;
            const uint32_t r = r_lo + 8 * i;
            st_shared_v2_f32(epi + box * 8192 + r * 128 + ((chunk16 ^ sw) << 4) + (lane % 2) * 8,
                             v0, v1);
          }
        }
      }
      fence_async_shared();
      named_barrier_sync(bar_id, 128);
      if (t == 0 && row0 < g.mk) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int col = at.n0 + c * chunk_cols + b * box_cols;
          if (col >= p.nk) continue;
          if (p.out_mode == 2)
            tma_store_2d<true>(cm, epi_ptr + b * 8192, col, row0);
          else
            tma_store_2d<false>(cm, epi_ptr + b * 8192, col, row0);
        }
        bulk_commit();
      }
    }
  }
  if (t == 0) bulk_wait_all<false>();
}

template <int BN, bool kAKMajor, bool kBKMajor, int kCluster>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_sm90_kernel(const __grid_constant__ Params p) {
  using L = Layout<BN>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarOffset);
  uint64_t* empty = full + L::kStages;
  const int rank = kCluster == 2 ? static_cast<int>(cluster_rank()) : 0;
  // Written by the host upload or the device schedule before this launch. CTAs beyond the work
  // (a grid sized without the counts) skip every loop; both CTAs of a cluster alike.
  const Sm90Work w = *p.work;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(&full[s], 1);               // the producer's expect_tx arrival (+ the bytes)
      mbar_init(&empty[s], 2 * kCluster);   // each consumer warpgroup of the cluster
    }
    mbar_init_fence();
  }
  if constexpr (kCluster == 2)
    cluster_sync();  // the peer's barriers exist before any multicast or remote arrival
  else
    __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (t == 0) produce<BN, kAKMajor, kBKMajor, kCluster>(p, w, smem, full, empty, rank);
    if (t >= 128 - kConverters && p.dq_jobs != nullptr) stream_dequant(p, t % 32);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consume<BN, kAKMajor, kBKMajor, kCluster>(p, w, smem, full, empty, rank, wg - 1, t);
  }
  // No CTA leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster == 2) cluster_sync();
}

// ---- host ---------------------------------------------------------------------------------------

// Element type of a tensor map (both with 128-byte swizzle).
enum class MapElem { kBf16, kF32 };

// 2-D tensor (outer, inner) row-major, box (box_outer, box_inner).
struct MapKey {
  const void* ptr;
  int64_t inner, outer;
  int box_inner, box_outer;
  MapElem elem;
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && inner == o.inner && outer == o.outer && box_inner == o.box_inner &&
           box_outer == o.box_outer && elem == o.elem;
  }
};
struct MapKeyHash {
  size_t operator()(const MapKey& k) const {
    size_t h = std::hash<const void*>()(k.ptr);
    for (int64_t v : {k.inner, k.outer, static_cast<int64_t>(k.box_inner),
                      static_cast<int64_t>(k.box_outer), static_cast<int64_t>(k.elem)})
      h = h * 0x9E3779B97F4A7C15ull + static_cast<size_t>(v);
    return h;
  }
};

class MapCache {
 public:
  // Encoded maps are pure functions of the key; the cache only saves host time (weights keep
  // their pointers from call to call).
  const CUtensorMap& get(const MapKey& k) {
    auto it = maps_.find(k);
    if (it != maps_.end()) return it->second;
    if (maps_.size() >= kMaxMaps) maps_.clear();
    CUtensorMap m;
    const int el = k.elem == MapElem::kF32 ? 4 : 2;
    const CUtensorMapDataType type = k.elem == MapElem::kF32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k.inner), static_cast<cuuint64_t>(k.outer)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k.inner) * el};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(k.box_inner),
                               static_cast<cuuint32_t>(k.box_outer)};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = encode()(
        &m, type, 2, const_cast<void*>(k.ptr), dims, strides, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    PACKMOE_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed ("
                                         << static_cast<int>(r) << ") for a (" << k.outer << ", "
                                         << k.inner << ") tensor of " << el << "-byte elements");
    return maps_.emplace(k, m).first->second;
  }

  std::mutex mu;

 private:
  static constexpr size_t kMaxMaps = size_t{1} << 16;
  static PFN_cuTensorMapEncodeTiled_v12000 encode() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q{};
      PACKMOE_CUDA_CHECK(
          cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
      PACKMOE_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                    "the driver has no cuTensorMapEncodeTiled");
      return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }();
    return fn;
  }
  std::unordered_map<MapKey, CUtensorMap, MapKeyHash> maps_;
};

MapCache& map_cache() {
  static auto* c = new MapCache();  // leaked: lives as long as the process-wide backend
  return *c;
}

// `units`: the work units when the host knows them (the grid is no larger), else -1 (the grid is
// the resident CTA count; CTAs without work exit). GemmPolicy::max_ctas caps the grid (tests: a
// few CTAs walk many tiles).
template <int BN, bool kAKMajor, bool kBKMajor, int kCluster>
void launch(CudaBackend& be, const Params& p, int64_t units) {
  auto kernel = grouped_gemm_sm90_kernel<BN, kAKMajor, kBKMajor, kCluster>;
  constexpr int kSmem = Layout<BN>::kSmemBytes;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = be.stream();
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // CTAs the GPU holds at once (whole clusters), found once per instantiation.
  static const int resident = [&] {
    PACKMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    if (kCluster == 1) return be.sm_count();
    cfg.gridDim = dim3(be.sm_count() / kCluster * kCluster);
    int clusters = 0;
    PACKMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    PACKMOE_CHECK(clusters > 0, "grouped_gemm_sm90: no cluster of " << kCluster << " fits");
    return clusters * kCluster;
  }();
  const int cap = kernel_policy().gemm.max_ctas;
  const int64_t limit = cap > 0 ? std::max(kCluster, cap / kCluster * kCluster) : resident;
  const int64_t grid = units >= 0 ? std::min<int64_t>(units * kCluster, limit) : limit;
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  PACKMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <int BN, int kCluster>
void launch_layout(CudaBackend& be, const Params& p, bool a_k, bool b_k, int64_t units) {
  if (a_k && b_k) return launch<BN, true, true, kCluster>(be, p, units);
  if (a_k && !b_k) return launch<BN, true, false, kCluster>(be, p, units);
  if (!a_k && !b_k) return launch<BN, false, false, kCluster>(be, p, units);
  PACKMOE_CHECK(false, "grouped_gemm_sm90: MN-major A with K-major B is not instantiated");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool sm90_gemm_device_ok(CudaBackend& be) {
  static std::mutex mu;
  static std::unordered_map<int, bool> ok;
  std::lock_guard<std::mutex> lock(mu);
  auto it = ok.find(be.device_index());
  if (it != ok.end()) return it->second;
  int major = 0, minor = 0;
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be.device_index()));
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, be.device_index()));
  return ok[be.device_index()] = major == 9 && minor == 0;
}

bool sm90_gemm_shape_ok(const Sm90Gemm& p) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (p.nk <= 0 || p.nk % 8 != 0 || p.nk >= kMax) return false;
  if (p.a_k_major == false && p.b_k_major == true) return false;
  if (p.accumulate && p.out_bf16) return false;
  for (size_t g = 0; g < p.mk.size(); ++g) {
    const int64_t mk = p.mk[g], kred = p.kred[g];
    if (mk <= 0 || kred <= 0) continue;
    if (mk >= kMax || kred >= kMax) return false;
    if ((p.a_k_major ? kred : mk) % 8 != 0) return false;  // A row length
    if (p.b_k_major && kred % 8 != 0) return false;         // B row length (else nk)
  }
  return true;
}

namespace {

// The heuristic's choice, or the one GemmPolicy forces (tile_n, cluster; 0: the heuristic's).
Sm90Tiles with_policy(Sm90Tiles tiles) {
  const GemmPolicy g = kernel_policy().gemm;
  if (g.tile_n != 0) tiles.bn = g.tile_n;
  if (g.cluster != 0) tiles.cluster = g.cluster;
  return tiles;
}

// The maps of one group, (mk, kred) its shape: A and B boxes per the operand majors, C the output.
MapKey a_map_key(const void* a, int64_t mk, int64_t kred, bool k_major) {
  constexpr MapElem in = MapElem::kBf16;
  return k_major ? MapKey{a, kred, mk, kBox, 64, in} : MapKey{a, mk, kred, kBox, kSm90TileK, in};
}
MapKey b_map_key(const void* b, int64_t nk, int64_t kred, bool k_major, int bn) {
  constexpr MapElem in = MapElem::kBf16;
  return k_major ? MapKey{b, kred, nk, kBox, bn / 2, in} : MapKey{b, nk, kred, kBox, kSm90TileK, in};
}
MapKey c_map_key(void* out, int64_t nk, int64_t mk, bool f32_out) {
  return MapKey{out, nk, mk, f32_out ? 32 : 64, 64, f32_out ? MapElem::kF32 : MapElem::kBf16};
}

// Launches the kernel instance of `tiles` (units: see launch).
void launch_tiles(CudaBackend& be, const Params& k, Sm90Tiles tiles, bool a_k, bool b_k,
                  int64_t units) {
  const int bn = tiles.bn, cl = tiles.cluster;
  if (bn == 256 && cl == 2) launch_layout<256, 2>(be, k, a_k, b_k, units);
  if (bn == 256 && cl == 1) launch_layout<256, 1>(be, k, a_k, b_k, units);
  if (bn == 128 && cl == 2) launch_layout<128, 2>(be, k, a_k, b_k, units);
  if (bn == 128 && cl == 1) launch_layout<128, 1>(be, k, a_k, b_k, units);
}

}  // namespace

Status grouped_gemm_sm90(CudaBackend& be, const Sm90Gemm& p) {
  if (!sm90_gemm_shape_ok(p)) return Status::error("grouped_gemm_sm90: unsupported shape");
  const size_t G = p.mk.size();
  const Sm90Tiles tiles = with_policy(choose_sm90_tiles(p.mk, p.kred, p.nk, be.sm_count()));
  const int bn = tiles.bn, cl = tiles.cluster;
  const int64_t n_tiles = (p.nk + bn - 1) / bn;
  const bool f32_out = !p.out_bf16;

  std::vector<GroupTiles> table;
  std::vector<CUtensorMap> amaps, bmaps, cmaps;
  std::vector<gemm_convert::DequantJob> jobs;  // streaming dequantize: A, B per table row
  const bool stream = !p.a_dequant.empty() || !p.b_dequant.empty();
  uint32_t chunks = 0;
  auto add_job = [&](const std::vector<gemm_convert::DequantJob>& d, size_t g) {
    gemm_convert::DequantJob j{};
    if (!d.empty()) j = d[g];
    j.begin = chunks;
    const int64_t n = (j.elems + kConvertChunk - 1) / kConvertChunk;
    PACKMOE_CHECK(chunks + n < (int64_t{1} << 31), "grouped_gemm_sm90: too many dequantize chunks");
    chunks += static_cast<uint32_t>(n);
    jobs.push_back(j);
  };
  int64_t total = 0;
  {
    MapCache& cache = map_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    for (size_t g = 0; g < G; ++g) {
      const int64_t mk = p.mk[g], kred = p.kred[g];
      if (mk <= 0 || kred <= 0) continue;
      PACKMOE_CHECK(aligned16(p.a[g]) && aligned16(p.b[g]) && aligned16(p.out[g]),
                    "grouped_gemm_sm90: group " << g << " has a pointer off 16-byte alignment");
      const int64_t m_tiles = (mk + kSm90TileM - 1) / kSm90TileM;
      table.push_back(GroupTiles{static_cast<int32_t>(mk), static_cast<int32_t>(kred),
                                 static_cast<int32_t>(total), static_cast<int32_t>(m_tiles),
                                 sm90_band(bn, kred, n_tiles), static_cast<int32_t>(g)});
      total += sm90_units(m_tiles, n_tiles, cl);
      amaps.push_back(cache.get(a_map_key(p.a[g], mk, kred, p.a_k_major)));
      bmaps.push_back(cache.get(b_map_key(p.b[g], p.nk, kred, p.b_k_major, bn)));
      cmaps.push_back(cache.get(c_map_key(p.out[g], p.nk, mk, f32_out)));
      if (stream) add_job(p.a_dequant, g), add_job(p.b_dequant, g);
    }
  }
  if (stream) {  // the sentinel: begin = every chunk
    jobs.push_back(gemm_convert::DequantJob{});
    jobs.back().begin = chunks;
  }
  if (total == 0) return Status::ok();
  PACKMOE_CHECK(total < (int64_t{1} << 30), "grouped_gemm_sm90: " << total << " work units");

  // One upload: [A maps][B maps][C maps][group table][work][dequantize jobs][zeroed counters]
  // (the last two only when streaming); the staging buffers are 256-byte aligned, a CUtensorMap is
  // 64-byte aligned, the table (24 bytes a row) and the work (8 bytes) end 8-byte aligned.
  const size_t n = table.size();
  const size_t maps_bytes = n * sizeof(CUtensorMap);
  const size_t table_bytes = n * sizeof(GroupTiles);
  static_assert(sizeof(GroupTiles) % 8 == 0 && sizeof(Sm90Work) == 8,
                "the jobs follow the table and the work 8-byte aligned");
  const Sm90Work work{static_cast<int32_t>(n), static_cast<int32_t>(total)};
  const size_t work_at = 3 * maps_bytes + table_bytes;
  static_assert(sizeof(gemm_convert::DequantJob) % 8 == 0, "the counters follow the jobs");
  const size_t jobs_at = work_at + sizeof(Sm90Work),
               counters_at = jobs_at + jobs.size() * sizeof(gemm_convert::DequantJob);
  const size_t counters = stream ? 1 + n : 0;
  std::vector<uint8_t> blob(counters_at + counters * sizeof(uint32_t), 0);
  std::memcpy(blob.data(), amaps.data(), maps_bytes);
  std::memcpy(blob.data() + maps_bytes, bmaps.data(), maps_bytes);
  std::memcpy(blob.data() + 2 * maps_bytes, cmaps.data(), maps_bytes);
  std::memcpy(blob.data() + 3 * maps_bytes, table.data(), table_bytes);
  std::memcpy(blob.data() + work_at, &work, sizeof work);
  if (stream) std::memcpy(blob.data() + jobs_at, jobs.data(), jobs.size() * sizeof(jobs[0]));
  const auto* dev = static_cast<const uint8_t*>(be.upload(blob.data(), blob.size()));

  Params k{};
  k.a_maps = reinterpret_cast<const CUtensorMap*>(dev);
  k.b_maps = reinterpret_cast<const CUtensorMap*>(dev + maps_bytes);
  k.c_maps = reinterpret_cast<const CUtensorMap*>(dev + 2 * maps_bytes);
  k.groups = reinterpret_cast<const GroupTiles*>(dev + 3 * maps_bytes);
  k.work = reinterpret_cast<const Sm90Work*>(dev + work_at);
  k.n_tiles = static_cast<int32_t>(n_tiles);
  k.nk = static_cast<int32_t>(p.nk);
  k.out_mode = p.out_bf16 ? 1 : p.accumulate ? 2 : 0;
  k.alpha_lhs = p.alpha_lhs;
  k.alpha_rhs = p.alpha_rhs;
  if (stream) {
    k.dq_jobs = reinterpret_cast<const gemm_convert::DequantJob*>(dev + jobs_at);
    k.dq_rows = static_cast<int32_t>(n);
    // Uploaded zeros; this launch is the only writer of its upload slot's memory until the next
    // upload into that slot, which the stream orders after it.
    k.dq_counters = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(dev) + counters_at);
  }
  launch_tiles(be, k, tiles, p.a_k_major, p.b_k_major, total);
  return Status::ok();
}

// ---- token counts in device memory ---------------------------------------------------------------

Sm90Gemm sm90_device_geometry(const Sm90DeviceGemm& p, const std::vector<int64_t>& m) {
  Sm90Gemm g;
  g.nk = p.nk;
  for (int64_t mg : m) {
    g.mk.push_back(mg > 0 ? (p.tokens_reduce ? p.fixed : mg) : 0);
    g.kred.push_back(mg > 0 ? (p.tokens_reduce ? mg : p.fixed) : 0);
  }
  g.a_k_major = p.a_k_major;
  g.b_k_major = p.b_k_major;
  g.out_bf16 = p.out_bf16;
  g.accumulate = p.accumulate;
  return g;
}

Sm90Tiles sm90_device_tiles(CudaBackend& be, const Sm90DeviceGemm& p) {
  const Sm90Gemm g = sm90_device_geometry(p, sm90_uniform_split(p.capacity, p.groups, p.align));
  return with_policy(choose_sm90_tiles(g.mk, g.kred, g.nk, be.sm_count()));
}

// One allocation: [A templates][B templates][C templates][A maps][B maps][C maps] (G each),
// [table (G)][work].
static_assert(kSm90MaxDeviceGroups <= kMaxScheduleGroups, "the schedule kernel holds every group");

struct Sm90DevicePlan {
  Sm90DeviceGemm p;
  uint8_t* memory = nullptr;
  size_t maps_at = 0, table_at = 0, work_at = 0;
};

namespace {

// Which map dimension of an operand counts tokens: the contiguous one when the token axis is
// contiguous (e.g. NVFP4's transposed wgrad copies), else the outer one.
TokenDim token_dim(bool token_side, bool tokens_contiguous) {
  if (!token_side) return TokenDim::kNone;
  return tokens_contiguous ? TokenDim::kInner : TokenDim::kOuter;
}

}  // namespace

const Sm90DevicePlan* make_sm90_device_plan(CudaBackend& be, const Sm90DeviceGemm& p) {
  const size_t G = static_cast<size_t>(p.groups);
  PACKMOE_CHECK(p.groups > 0 && p.groups <= kSm90MaxDeviceGroups,
                "grouped_gemm_sm90: " << p.groups << " groups on the device-count path");
  const int bn = p.tiles.bn;
  const bool f32_out = !p.out_bf16;
  // Templates: token-side maps over the whole capacity at the packed base, weight-side maps of
  // each group as the host path encodes them.
  const int64_t cap = p.capacity;
  const int64_t mk = p.tokens_reduce ? p.fixed : cap, kred = p.tokens_reduce ? cap : p.fixed;
  std::vector<CUtensorMap> templates(3 * G);
  {
    MapCache& cache = map_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    for (size_t g = 0; g < G; ++g) {
      const void* a = p.a.token_bytes ? p.a.base : p.a.ptr[g];
      const void* b = p.b.token_bytes ? p.b.base : p.b.ptr[g];
      void* out = const_cast<void*>(p.out.token_bytes ? p.out.base : p.out.ptr[g]);
      PACKMOE_CHECK(aligned16(a) && aligned16(b) && aligned16(out),
                    "grouped_gemm_sm90: group " << g << " has a pointer off 16-byte alignment");
      templates[g] = cache.get(a_map_key(a, mk, kred, p.a_k_major));
      templates[G + g] = cache.get(b_map_key(b, p.nk, kred, p.b_k_major, bn));
      templates[2 * G + g] = cache.get(c_map_key(out, p.nk, mk, f32_out));
    }
  }
  auto* plan = new Sm90DevicePlan();  // kept for the life of the process (graphs may use it)
  plan->p = p;
  const size_t maps = 3 * G * sizeof(CUtensorMap);
  plan->maps_at = maps;
  plan->table_at = 2 * maps;
  plan->work_at = plan->table_at + G * sizeof(GroupTiles);
  const size_t bytes = plan->work_at + sizeof(Sm90Work);
  std::vector<uint8_t> blob(bytes, 0);
  std::memcpy(blob.data(), templates.data(), maps);
  PACKMOE_CUDA_CHECK(cudaMalloc(&plan->memory, bytes));
  // In the stream's order (a cudaMemcpy's DMA is not ordered with the non-blocking stream).
  be.copy(plan->memory, blob.data(), bytes, Backend::CopyKind::kHostToDevice);
  return plan;
}

Status grouped_gemm_sm90_device(CudaBackend& be, const Sm90DevicePlan& plan, const int64_t* m_device) {
  const Sm90DeviceGemm& p = plan.p;
  const size_t G = static_cast<size_t>(p.groups);
  const Sm90Tiles tiles = p.tiles;
  const int64_t n_tiles = (p.nk + tiles.bn - 1) / tiles.bn;
  uint8_t* mem = plan.memory;
  auto* templates = reinterpret_cast<const CUtensorMap*>(mem);
  auto* maps = reinterpret_cast<CUtensorMap*>(mem + plan.maps_at);

  ScheduleParams s{};
  s.m = m_device;
  s.groups = static_cast<int32_t>(p.groups);
  s.align = static_cast<int32_t>(p.align);
  s.capacity = p.capacity;
  s.tokens_reduce = p.tokens_reduce;
  s.fixed = static_cast<int32_t>(p.fixed);
  s.bn = tiles.bn;
  s.cluster = tiles.cluster;
  s.n_tiles = static_cast<int32_t>(n_tiles);
  s.table = reinterpret_cast<GroupTiles*>(mem + plan.table_at);
  s.work = reinterpret_cast<Sm90Work*>(mem + plan.work_at);
  // Token axis contiguous: A K-major with tokens as the reduction (wgrad), B K-major likewise;
  // the output's token axis (fprop / dgrad rows) is always the outer one.
  const Sm90DeviceOperand* ops[3] = {&p.a, &p.b, &p.out};
  const bool contiguous[3] = {p.tokens_reduce && p.a_k_major, p.tokens_reduce && p.b_k_major, false};
  const int32_t elem[3] = {2, 2, p.out_bf16 ? 2 : 4};
  for (int i = 0; i < 3; ++i)
    s.maps[i] = ScheduleMap{templates + i * G, maps + i * G,
                            reinterpret_cast<uint64_t>(ops[i]->base), ops[i]->token_bytes, elem[i],
                            token_dim(ops[i]->token_bytes != 0, contiguous[i])};
  sm90_schedule_kernel<<<schedule_ctas(p.groups), kScheduleThreads, 0, be.stream()>>>(s);
  PACKMOE_CUDA_CHECK_LAUNCH();

  Params k{};
  k.a_maps = maps;
  k.b_maps = maps + G;
  k.c_maps = maps + 2 * G;
  k.groups = s.table;
  k.work = s.work;
  k.n_tiles = static_cast<int32_t>(n_tiles);
  k.nk = static_cast<int32_t>(p.nk);
  k.out_mode = p.out_bf16 ? 1 : p.accumulate ? 2 : 0;
  k.alpha_lhs = p.alpha_lhs;
  k.alpha_rhs = p.alpha_rhs;
  launch_tiles(be, k, tiles, p.a_k_major, p.b_k_major, -1);
  return Status::ok();
}

}  // namespace packmoe
