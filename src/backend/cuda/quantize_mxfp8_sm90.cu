// MXFP8 grouped quantize (rowwise 1x32, columnwise 32x1, or 2D 32x32) of every group in ONE
// launch. A persistent grid walks 32-row x 256-column tiles of all groups (blockIdx -> group by a
// prefix sum of tile counts); each tile holds whole blocks of both shapes, so the input is read
// once for both copies. Invariant: every scale and element byte comes from formats/mxfp8_math.h
// (or the hardware cvt and branch-free scale code proven equal to it by selftest.cu): the bytes
// equal quantize_mxfp8_cpu's. The copies' BF16 values (Mxfp8Outputs::row_bf16 / col_bf16) come
// from the dequantize's own conversion (grouped_gemm_sm90_convert.cuh) of the codes just made.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/grouped_gemm_sm90_convert.cuh"
#include "backend/cuda/kernels_common.cuh"
#include "backend/device_buffer.h"
#include "formats/mxfp8_math.h"

namespace packmoe {
namespace {

using cuda::GroupTable;

struct Config {
  static constexpr int kTileRows = 32;  // one columnwise block (and one 2D tile) of rows
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRowsPerThread = kTileRows / kWarps;  // rows of the tile one warp owns
  static constexpr int kCols = 8;               // columns one thread owns in each of its rows
  static constexpr int kTileCols = 32 * kCols;  // a warp spans the tile's width
  static constexpr int kLanesPerBlock = kMxfp8Block / kCols;  // lanes sharing a 1x32 row block
  // cp.async ring depth: loads of the next kStages-1 tiles are in flight while one is processed,
  // so the bytes in flight per SM do not depend on how many registers the arithmetic needs.
  static constexpr int kStages = 3;
  static constexpr int kInlineGroups = 4;  // groups passed in the kernel parameters
  static constexpr int kSmemGroups = 256;  // larger non-uniform tables are searched in place
  static_assert(kTileRows == kMxfp8Block, "a tile holds exactly one columnwise block of rows");
  static_assert(kTileRows % kWarps == 0, "each warp owns whole rows of the tile");
  static_assert(kMxfp8Block % kCols == 0 && (kLanesPerBlock & (kLanesPerBlock - 1)) == 0,
                "row blocks are reduced by xor-shuffles over a power-of-two lane group");
  static_assert(kCols % kWarps == 0, "the column reduction gives each thread whole columns");
  static_assert(kCols % 4 == 0, "output bytes are packed in words");
  static_assert(kRowsPerThread == kLanesPerBlock,
                "lane l writes the row scale of its row l % kLanesPerBlock: one store per tile");
  static_assert(kTileCols % 16 == 0, "column scales leave in 16-byte pieces");
};

// CTAs per SM the register budget is set for. BF16: four (64 registers; 48 KB ring + 6.4 KB
// shared memory each, 32 KB of loads in flight per CTA). F32 (a 96 KB ring) fits two.
template <typename In>
constexpr int kMinBlocks = sizeof(In) == 2 ? 4 : 2;

// 16-byte vectors per thread row chunk: 1 (BF16) or 2 (F32).
template <typename In>
constexpr int kVecs = Config::kCols* static_cast<int>(sizeof(In)) / 16;

// Dynamic shared memory of the load ring: [kStages][kVecs][kRowsPerThread][kThreads] vectors.
// Each thread reads back only the vectors it copied, at consecutive 16-byte slots across the
// warp, so neither side conflicts on banks and no barrier guards the ring.
template <typename In>
constexpr size_t kRingBytes =
    static_cast<size_t>(Config::kStages) * kVecs<In>* Config::kRowsPerThread* Config::kThreads * 16;

struct Mxfp8Group {
  const void* in;      // (rows, K) In
  uint8_t* row_data;   // (rows, K)
  uint8_t* row_scale;  // (rows, K/32)
  uint8_t* col_data;   // (rows, K)
  uint8_t* col_scale;  // (rows/32, K)
  uint8_t* row_bf16;   // (rows, K) BF16 values of the rowwise copy, or null
  uint8_t* col_bf16;   // (rows, K) BF16 values of the columnwise copy, or null
  int64_t rows;
  uint32_t tile_begin;  // exclusive prefix sum of tile counts
};

struct Mxfp8Args {
  GroupTable<Mxfp8Group, Config::kInlineGroups> groups;
  int64_t cols;        // K
  uint32_t col_tiles;  // tiles across K
  cuda::FastDiv col_tiles_div;
  bool rowwise;
  bool columnwise;
  bool two_d;
  bool col_scale_vec;  // col_scale rows are 16-byte aligned and K % 16 == 0: 16-byte stores
};

// Where a tile is, seen from one thread.
struct TilePos {
  const Mxfp8Group* grp;
  int64_t row_tile;
  int64_t col_tile;
  int64_t r0;     // first of the thread's kRowsPerThread rows
  int64_t c0;     // first of the thread's kCols columns
  int col_valid;  // how many of those columns are inside K
};

__device__ __forceinline__ TilePos locate(const Mxfp8Args& args, uint32_t tile,
                                          const uint32_t* begins) {
  TilePos p;
  const int g = args.groups.find_smem<Config::kSmemGroups>(tile, begins);
  p.grp = &args.groups[g];
  const uint32_t local = tile - p.grp->tile_begin;
  const uint32_t rt = args.col_tiles_div.div(local);
  p.row_tile = rt;
  p.col_tile = local - rt * args.col_tiles;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  p.r0 = p.row_tile * Config::kTileRows + warp * Config::kRowsPerThread;
  p.c0 = p.col_tile * Config::kTileCols + lane * Config::kCols;
  const int64_t left = args.cols - p.c0;
  p.col_valid = left <= 0 ? 0 : (left >= Config::kCols ? Config::kCols : static_cast<int>(left));
  return p;
}

template <typename In>
__device__ __forceinline__ uint4* ring_slot(uint4* ring, int stage, int v, int i) {
  return ring + ((stage * kVecs<In> + v) * Config::kRowsPerThread + i) * Config::kThreads +
         threadIdx.x;
}

// Start the loads of `tile` into ring stage `stage` (zeros outside the matrix). kVec: cp.async;
// otherwise plain scalar loads packed into the same vector layout (ragged K or unaligned input).
template <typename In, bool kVec>
__device__ __forceinline__ void issue_tile(const Mxfp8Args& args, uint4* ring, uint32_t tile,
                                           int stage, const uint32_t* begins) {
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(In));
  if (tile >= args.groups.total_tiles) return;
  const TilePos p = locate(args, tile, begins);
  const In* in = static_cast<const In*>(p.grp->in);
  const int64_t K = args.cols;
#pragma unroll
  for (int i = 0; i < Config::kRowsPerThread; ++i) {
    const bool ok = p.r0 + i < p.grp->rows && p.col_valid > 0;
    if constexpr (kVec) {
#pragma unroll
      for (int v = 0; v < kVecs<In>; ++v)
        cuda::cp_async16(ring_slot<In>(ring, stage, v, i),
                         ok ? in + (p.r0 + i) * K + p.c0 + v * kPerVec : in, ok);
    } else {
      uint32_t w[kVecs<In> * 4];
#pragma unroll
      for (int q = 0; q < kVecs<In> * 4; ++q) w[q] = 0;
#pragma unroll
      for (int j = 0; j < Config::kCols; ++j) {
        if (p.r0 + i < p.grp->rows && j < p.col_valid) {
          const uint32_t bits =
              __float_as_uint(cuda::load_elem<In>(in + (p.r0 + i) * K + p.c0 + j));
          if constexpr (sizeof(In) == 4)
            w[j] = bits;
          else
            w[j / 2] |= (bits >> 16) << (16 * (j % 2));
        }
      }
#pragma unroll
      for (int v = 0; v < kVecs<In>; ++v)
        *ring_slot<In>(ring, stage, v, i) =
            make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
    }
  }
}

// kCols codes of x[j] * q(j) packed little-endian into kCols/4 words. kHw: two elements per cvt
// instruction (selftest.cu proves it equal to mxfp8_encode); else mxfp8_encode itself.
template <typename In, DType kEl, bool kHw, typename QOf>
__device__ __forceinline__ void encode_chunk(const uint4* raw, QOf q_of, uint32_t* words) {
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(In));
#pragma unroll
  for (int w = 0; w < Config::kCols / 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int j = 4 * w + 2 * p;
      const float x0 = cuda::chunk_elem<In>(raw[j / kPerVec], j % kPerVec);
      const float x1 = cuda::chunk_elem<In>(raw[(j + 1) / kPerVec], (j + 1) % kPerVec);
      uint32_t pair;
      if constexpr (kHw) {
        pair = cuda::cvt_fp8x2<kEl == DType::kE5M2>(x0 * q_of(j), x1 * q_of(j + 1));
      } else {
        pair = static_cast<uint32_t>(mxfp8_encode(x0, q_of(j), kEl)) |
               (static_cast<uint32_t>(mxfp8_encode(x1, q_of(j + 1), kEl)) << 8);
      }
      word |= pair << (16 * p);
    }
    words[w] = word;
  }
}

// kCols bytes to dst: one 8-byte streaming store when aligned, else byte by byte (ragged K).
template <bool kVec>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint32_t* words, int valid) {
  static_assert(Config::kCols == 8, "one 8-byte store per row chunk");
  if constexpr (kVec) {
    __stcs(reinterpret_cast<uint2*>(dst), make_uint2(words[0], words[1]));
  } else {
#pragma unroll
    for (int j = 0; j < Config::kCols; ++j)
      if (j < valid) dst[j] = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
  }
}

// The BF16 values of a chunk's kCols codes (`words`), code j times sc_of(j), as 16 bytes at dst:
// f32_to_bf16(mxfp8_decode(code, scale)), the bytes dequantize_mxfp8 writes. The conversion is
// the GEMM dequantize's (FP8 -> F16 -> FP32, times the scale, RNE to BF16: exact values); a NaN
// code, which that conversion turns into the NaN 0x7FFF, becomes the canonical 0x7FC0 (rare: a NaN
// input; the quantizer makes no NaN scale).
template <DType kEl, typename ScOf>
__device__ __forceinline__ void store_values(uint8_t* dst, const uint32_t* words, ScOf sc_of) {
  static_assert(Config::kCols == 8, "one 16-byte store per row chunk");
  uint32_t o[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 f = gemm_convert::f16x2_to_f32x2(
        gemm_convert::fp8x2_to_f16x2<kEl == DType::kE5M2>(words[p / 2] >> (16 * (p % 2))));
    o[p] = gemm_convert::f32x2_to_bf16x2(f.x * sc_of(2 * p), f.y * sc_of(2 * p + 1));
  }
  // Bit 7 of each byte: the code is a NaN (E4M3 0x7F, E5M2 0x7D..0x7F, either sign); the add
  // cannot carry out of a byte.
  constexpr uint32_t kNanAdd = kEl == DType::kE5M2 ? 0x03030303u : 0x01010101u;
  const uint32_t nan[2] = {((words[0] & 0x7F7F7F7Fu) + kNanAdd) & 0x80808080u,
                           ((words[1] & 0x7F7F7F7Fu) + kNanAdd) & 0x80808080u};
  if ((nan[0] | nan[1]) != 0) {
#pragma unroll
    for (int j = 0; j < Config::kCols; ++j)
      if ((nan[j / 4] >> (8 * (j % 4) + 7)) & 1u)
        o[j / 2] = (o[j / 2] & (0xFFFF0000u >> (16 * (j % 2)))) | (0x7FC0u << (16 * (j % 2)));
  }
  __stcs(reinterpret_cast<uint4*>(dst), make_uint4(o[0], o[1], o[2], o[3]));
}

// E8M0 code of a block and its quantization multiplier q. kHw: the branch-free forms of
// kernels_common.cuh (selftest.cu proves them equal for every amax); else the shared functions.
template <DType kEl, bool kHw>
__device__ __forceinline__ uint8_t scale_code(float amax, float& q) {
  if constexpr (kHw) {
    const uint32_t c = cuda::e8m0_code_fast(amax * mxfp8_max_norm_rcp(kEl));
    q = cuda::e8m0_rcp_fast(c);
    return static_cast<uint8_t>(c);
  } else {
    const uint8_t c = mxfp8_scale_code(amax, kEl);
    q = e8m0_reciprocal(c);
    return c;
  }
}

// Column partial amaxes: F32 [warp][j][lane] for column lane*kCols + j; BF16 input keeps them
// packed, [warp][j/2][lane] words of two BF16 maxima. Lanes touch consecutive words, so neither the
// writes nor the reduction's reads conflict on banks.
template <typename In>
struct ColumnSmem {
  static constexpr int kPartialWords = sizeof(In) == 2 ? Config::kCols / 2 : Config::kCols;
  uint32_t partial[Config::kWarps][kPartialWords][32];
  float colq[Config::kCols][32];  // per column: q (1D) or the column amax (2D), same layout
  // 1D column scale codes of the tile, gathered so they leave as 16-byte stores instead of one
  // byte per column at stride kCols across the lanes.
  alignas(16) uint8_t colcode[Config::kTileCols];
};

// Lane l stores the row scale of its row l % kLanesPerBlock (the xor-reduction left the code of
// row i in all kLanesPerBlock lanes of a block): one byte store per thread covers the tile's
// rows x blocks, 8 consecutive bytes per row, instead of one store per row.
template <int R>
__device__ __forceinline__ void store_row_scales(uint8_t* row_scale, int64_t K, const TilePos& p,
                                                 int64_t rows, const uint8_t (&code)[R]) {
  const int lane = threadIdx.x % 32;
  const int i = lane % R;
  uint8_t c = code[0];
#pragma unroll
  for (int k = 1; k < R; ++k)
    if (i == k) c = code[k];
  const int64_t r = p.r0 + i;
  if (r < rows && p.col_valid) row_scale[r * (K / kMxfp8Block) + p.c0 / kMxfp8Block] = c;
}

// kValues: also the copies' BF16 values into the groups' row_bf16 / col_bf16 (kHw, kVec only).
template <typename In, DType kEl, bool kHw, bool kVec, bool kValues>
__device__ __forceinline__ void process_tile(const Mxfp8Args& args, const uint4* ring_stage_v0,
                                             uint32_t tile, ColumnSmem<In>& cs,
                                             const uint32_t* begins) {
  constexpr int C = Config::kCols;
  constexpr int R = Config::kRowsPerThread;
  constexpr int kV = kVecs<In>;
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(In));
  constexpr int kLpb = Config::kLanesPerBlock;
  constexpr bool kBf16 = sizeof(In) == 2;
  const TilePos p = locate(args, tile, begins);
  // Group fields are read into locals once per phase: the output stores could alias the table, so
  // every `grp.x` after a store would be loaded again.
  const Mxfp8Group& grp = *p.grp;
  const int64_t K = args.cols;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  uint4 raw[R][kV];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int v = 0; v < kV; ++v) raw[i][v] = ring_stage_v0[(v * R + i) * Config::kThreads];
  auto elem = [&](int i, int j) { return cuda::chunk_elem<In>(raw[i][j / kPerVec], j % kPerVec); };
  // BF16: |x| of both halves of each word, for the packed maxima below.
  uint32_t aw[R][4];
  if constexpr (kBf16) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      aw[i][0] = cuda::abs_bf16x2(raw[i][0].x);
      aw[i][1] = cuda::abs_bf16x2(raw[i][0].y);
      aw[i][2] = cuda::abs_bf16x2(raw[i][0].z);
      aw[i][3] = cuda::abs_bf16x2(raw[i][0].w);
    }
  }

  // ---- rowwise 1x32 blocks ----
  if (args.rowwise && !args.two_d) {
    uint8_t* const row_data = grp.row_data;  // null: the copy is kept as its values only
    uint8_t* const row_scale = grp.row_scale;
    const int64_t rows = grp.rows;
    uint8_t codes[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float amax = 0.0f;
      if constexpr (kBf16) {
        const uint32_t m = cuda::max_bf16x2(cuda::max_bf16x2(aw[i][0], aw[i][1]),
                                            cuda::max_bf16x2(aw[i][2], aw[i][3]));
        amax = cuda::amax_bf16x2(0.0f, m);
      } else {
#pragma unroll
        for (int j = 0; j < C; ++j) amax = cuda::amax_fast(amax, elem(i, j));
      }
      // amax is >= 0 and never NaN from here on: a plain max reduces it.
#pragma unroll
      for (int m = 1; m < kLpb; m <<= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, m));
      float q;
      codes[i] = scale_code<kEl, kHw>(amax, q);
      uint32_t words[C / 4];
      encode_chunk<In, kEl, kHw>(
          raw[i], [&](int) { return q; }, words);
      const int64_t r = p.r0 + i;
      if (r < rows && p.col_valid) {
        if (row_data != nullptr) store_bytes<kVec>(row_data + r * K + p.c0, words, p.col_valid);
        if constexpr (kValues) {
          if (grp.row_bf16 != nullptr) {
            const float sc = e8m0_to_f32(codes[i]);
            store_values<kEl>(grp.row_bf16 + (r * K + p.c0) * 2, words, [&](int) { return sc; });
          }
        }
      }
    }
    if (row_scale != nullptr) store_row_scales<R>(row_scale, K, p, rows, codes);
  }
  if (!(args.columnwise || args.two_d)) return;

  // ---- columnwise 32x1 blocks / 2D 32x32 tiles: amax over the tile's 32 rows per column ----
  // (rows % 32 == 0 here, so every row of the tile is inside the group.)
  if constexpr (kBf16) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t m = aw[0][k];
#pragma unroll
      for (int i = 1; i < R; ++i) m = cuda::max_bf16x2(m, aw[i][k]);
      cs.partial[warp][k][lane] = m;
    }
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < R; ++i) amax = cuda::amax_fast(amax, elem(i, j));
      cs.partial[warp][j][lane] = __float_as_uint(amax);
    }
  }
  __syncthreads();
  // Thread (warp w, lane l) reduces columns l*C + j for j = w, w + kWarps, ...
#pragma unroll
  for (int m = 0; m < C / Config::kWarps; ++m) {
    const int j = warp + Config::kWarps * m;
    float amax = 0.0f;
    if constexpr (kBf16) {
      uint32_t w = cs.partial[0][j / 2][lane];
#pragma unroll
      for (int u = 1; u < Config::kWarps; ++u) w = cuda::max_bf16x2(w, cs.partial[u][j / 2][lane]);
      amax = cuda::amax_bf16x2(0.0f, (j % 2) ? (w & 0xFFFF0000u) : (w & 0xFFFFu));
    } else {
#pragma unroll
      for (int u = 0; u < Config::kWarps; ++u)
        amax = fmaxf(amax, __uint_as_float(cs.partial[u][j][lane]));
    }
    if (args.two_d) {
      cs.colq[j][lane] = amax;
    } else {
      float q;
      cs.colcode[lane * C + j] = scale_code<kEl, kHw>(amax, q);
      cs.colq[j][lane] = q;
    }
  }
  __syncthreads();
  // The next tile writes `partial` and `colcode` only after its first barrier, which every thread
  // reaches after it has finished reading `colq` and `colcode` below, so one set suffices.

  if (args.two_d) {
    // Tile amax = max of the 32 column amaxes of this thread's 32-column block.
    const int l0 = lane & ~(kLpb - 1);
    float amax = 0.0f;
#pragma unroll
    for (int l = 0; l < kLpb; ++l)
#pragma unroll
      for (int j = 0; j < C; ++j) amax = fmaxf(amax, cs.colq[j][l0 + l]);
    float q;
    const uint8_t code = scale_code<kEl, kHw>(amax, q);
    if (!p.col_valid) return;
    uint8_t* const row_data = grp.row_data + p.r0 * K + p.c0;
    uint8_t* const col_data = grp.col_data + p.r0 * K + p.c0;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      uint32_t words[C / 4];
      encode_chunk<In, kEl, kHw>(
          raw[i], [&](int) { return q; }, words);
      if (args.rowwise) store_bytes<kVec>(row_data + i * K, words, p.col_valid);
      if (args.columnwise) store_bytes<kVec>(col_data + i * K, words, p.col_valid);
    }
    if (args.rowwise) {
      uint8_t codes[R];
#pragma unroll
      for (int i = 0; i < R; ++i) codes[i] = code;
      store_row_scales<R>(grp.row_scale, K, p, grp.rows, codes);
    }
    if (args.columnwise && warp == 0) {
      const uint32_t codes[C / 4] = {0x01010101u * code, 0x01010101u * code};
      store_bytes<kVec>(grp.col_scale + p.row_tile * K + p.c0, codes, p.col_valid);
    }
    return;
  }

  // 1D column scales: the tile's kTileCols codes in 16-byte pieces (or bytes at ragged K); none
  // for a copy kept as its values only.
  if (grp.col_scale != nullptr) {
    const int64_t c0 = p.col_tile * Config::kTileCols;
    uint8_t* dst = grp.col_scale + p.row_tile * K + c0;
    if (args.col_scale_vec) {
      const int t = threadIdx.x;
      if (t < Config::kTileCols / 16 && c0 + 16 * t < K)
        __stcs(reinterpret_cast<uint4*>(dst) + t, reinterpret_cast<const uint4*>(cs.colcode)[t]);
    } else {
      for (int t = threadIdx.x; t < Config::kTileCols; t += Config::kThreads)
        if (c0 + t < K) dst[t] = cs.colcode[t];
    }
  }
  if (!p.col_valid) return;
  uint8_t* const col_data = grp.col_data;  // null: the copy is kept as its values only
  float q[C];
#pragma unroll
  for (int j = 0; j < C; ++j) q[j] = cs.colq[j][lane];
  uint8_t* const col_bf16 = kValues ? grp.col_bf16 : nullptr;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    uint32_t words[C / 4];
    encode_chunk<In, kEl, kHw>(
        raw[i], [&](int j) { return q[j]; }, words);
    if (col_data != nullptr) store_bytes<kVec>(col_data + (p.r0 + i) * K + p.c0, words, p.col_valid);
    if (kValues && col_bf16 != nullptr) {
      // The column codes from shared memory (8 bytes), not 8 more live registers.
      const uint2 cc = *reinterpret_cast<const uint2*>(cs.colcode + lane * C);
      store_values<kEl>(col_bf16 + ((p.r0 + i) * K + p.c0) * 2, words, [&](int j) {
        return e8m0_to_f32(static_cast<uint8_t>((j < 4 ? cc.x : cc.y) >> (8 * (j % 4))));
      });
    }
  }
}

// kVec: K % kCols == 0 and every data pointer 16-byte aligned, so a thread's chunk is all in or
// all out of the matrix and moves with vector instructions; otherwise (columnwise-only with
// ragged K, or unaligned views) elements move one at a time.
template <typename In, DType kEl, bool kHw, bool kVec, bool kValues>
__global__ void __launch_bounds__(Config::kThreads, kMinBlocks<In>)
    mxfp8_quantize_kernel(const __grid_constant__ Mxfp8Args args) {
  extern __shared__ uint4 ring[];  // kRingBytes<In>
  __shared__ ColumnSmem<In> cs;
  __shared__ uint32_t begins[Config::kSmemGroups];  // tile_begin of a non-uniform uploaded table
  constexpr int S = Config::kStages;
  const uint32_t step = gridDim.x;
  args.groups.template load_tile_begins<Config::kSmemGroups>(begins);
  __syncthreads();
  // Prologue: the CTA's first S-1 tiles. Every thread commits one group per tile, loads or not,
  // so the group count (and wait_group's meaning) is uniform.
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    issue_tile<In, kVec>(args, ring, blockIdx.x + s * step, s, begins);
    cuda::cp_async_commit();
  }
  int stage = 0;
  for (uint32_t tile = blockIdx.x; tile < args.groups.total_tiles; tile += step) {
    // Refill the stage this thread finished reading in the previous iteration (its own slots:
    // the register values it read are consumed, so no barrier is needed).
    issue_tile<In, kVec>(args, ring, tile + (S - 1) * step, stage == 0 ? S - 1 : stage - 1,
                         begins);
    cuda::cp_async_commit();
    cuda::cp_async_wait<S - 1>();
    process_tile<In, kEl, kHw, kVec, kValues>(args, ring_slot<In>(ring, stage, 0, 0), tile, cs,
                                              begins);
    stage = stage == S - 1 ? 0 : stage + 1;
  }
}

template <typename In, DType kEl, bool kHw, bool kVec, bool kValues = false>
void launch(CudaBackend& be, const Mxfp8Args& args) {
  auto* kernel = &mxfp8_quantize_kernel<In, kEl, kHw, kVec, kValues>;
  // Per instantiation, once: the ring exceeds the 48 KB default of dynamic shared memory, and the
  // persistent grid is as many CTAs as fit on the device at once.
  static const int ctas_per_sm = [&] {
    PACKMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kRingBytes<In>)));
    int n = 0;
    PACKMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Config::kThreads,
                                                                     kRingBytes<In>));
    PACKMOE_CHECK(n > 0, "MXFP8 quantize kernel does not fit on an SM");
    return n;
  }();
  const uint64_t grid = std::min<uint64_t>(args.groups.total_tiles,
                                           static_cast<uint64_t>(ctas_per_sm) * be.sm_count());
  kernel<<<static_cast<unsigned>(grid), Config::kThreads, kRingBytes<In>, be.stream()>>>(args);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

// values: the kernel writes the BF16 values too (BF16 input, hardware conversions, vector path).
template <typename In, DType kEl>
void dispatch_hw_vec(CudaBackend& be, const Mxfp8Args& args, bool hw, bool vec, bool values) {
  if constexpr (sizeof(In) == 2) {
    if (values) return launch<In, kEl, true, true, true>(be, args);
  }
  if (hw) {
    vec ? launch<In, kEl, true, true>(be, args) : launch<In, kEl, true, false>(be, args);
  } else {
    vec ? launch<In, kEl, false, true>(be, args) : launch<In, kEl, false, false>(be, args);
  }
}

template <typename In>
void dispatch_element(CudaBackend& be, const Mxfp8Args& args, DType el, bool hw, bool vec,
                      bool values) {
  if (el == DType::kE5M2)
    dispatch_hw_vec<In, DType::kE5M2>(be, args, hw, vec, values);
  else
    dispatch_hw_vec<In, DType::kE4M3>(be, args, hw, vec, values);
}

// The group table of the outputs `out` (a pointer the request leaves out is null) and whether
// the vector path applies: chunks never straddle K and every row of every buffer starts 16-byte
// aligned (outputs are written in 8- and 16-byte pieces at multiples of their size).
struct GroupPlan {
  std::vector<Mxfp8Group> groups;
  uint64_t tiles = 0;
  bool vec = false;
  bool col_scale_vec = false;  // every column scale row is 16-byte aligned (K % 16 checked apart)
};

GroupPlan plan_groups(const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out,
                      uint32_t col_tiles) {
  auto at = [](const std::vector<void*>& v, int64_t g) {
    return v.empty() ? nullptr : static_cast<uint8_t*>(v[g]);
  };
  GroupPlan plan;
  plan.vec = in.cols % Config::kCols == 0;
  plan.col_scale_vec = true;
  plan.groups.resize(in.groups());
  for (int64_t g = 0; g < in.groups(); ++g) {
    Mxfp8Group& d = plan.groups[g];
    d.in = in.data[g];
    d.row_data = at(out.row_data, g);
    d.row_scale = at(out.row_scale, g);
    d.col_data = at(out.col_data, g);
    d.col_scale = at(out.col_scale, g);
    d.row_bf16 = at(out.row_bf16, g);
    d.col_bf16 = at(out.col_bf16, g);
    d.rows = in.rows[g];
    d.tile_begin = static_cast<uint32_t>(plan.tiles);
    if (d.rows == 0) continue;
    plan.vec = plan.vec && cuda::aligned16(d.in) && cuda::aligned16(d.row_data) &&
               cuda::aligned16(d.col_data) && cuda::aligned16(d.row_bf16) &&
               cuda::aligned16(d.col_bf16) && (!cfg.two_d || cuda::aligned16(d.col_scale));
    plan.col_scale_vec = plan.col_scale_vec && cuda::aligned16(d.col_scale);
    plan.tiles += static_cast<uint64_t>((d.rows + Config::kTileRows - 1) / Config::kTileRows) * col_tiles;
  }
  return plan;
}

}  // namespace

Status quantize_mxfp8_sm90(CudaBackend& be, const GroupedMatrices& in, const Mxfp8Config& cfg,
                           const Mxfp8Outputs& given) {
  const int64_t K = in.cols;
  Mxfp8Args args{};
  args.cols = K;
  args.col_tiles = static_cast<uint32_t>((K + Config::kTileCols - 1) / Config::kTileCols);
  args.col_tiles_div = cuda::FastDiv(args.col_tiles);
  args.rowwise = cfg.rowwise;
  args.columnwise = cfg.columnwise;
  args.two_d = cfg.two_d;
  const bool hw = cuda_fp8_hw_conversion_ok(be, cfg.element) && cuda_mxfp8_fast_scale_ok(be);
  const bool want_values = !given.row_bf16.empty() || !given.col_bf16.empty();
  GroupPlan plan = plan_groups(in, cfg, given, args.col_tiles);
  // The kernel writes the values itself on the fast path (BF16 input, hardware conversions,
  // aligned vectors: the activations of a layer). Elsewhere the dequantize kernel writes them
  // after it, from the copies' bytes, by the same definition: a copy kept as its values only is
  // quantized into stream-ordered scratch first.
  const bool in_kernel = want_values && hw && plan.vec && in.dtype == DType::kBF16;
  Mxfp8Outputs out = given;
  std::vector<DeviceBuffer> scratch;
  if (want_values && !in_kernel) {
    auto fill = [&](std::vector<void*>& ptrs, int64_t divisor) {  // rows * K / divisor bytes
      for (int64_t rows : in.rows)
        ptrs.push_back(scratch.emplace_back(be, std::max<int64_t>(rows * K / divisor, 1)).get());
    };
    if (cfg.rowwise && given.row_values_only()) fill(out.row_data, 1), fill(out.row_scale, kMxfp8Block);
    if (cfg.columnwise && given.col_values_only())
      fill(out.col_data, 1), fill(out.col_scale, kMxfp8Block);
    plan = plan_groups(in, cfg, out, args.col_tiles);
  }
  args.col_scale_vec = plan.col_scale_vec && K % 16 == 0;
  args.groups = cuda::make_group_table<Mxfp8Group, Config::kInlineGroups>(be, plan.groups, plan.tiles);
  if (in.dtype == DType::kBF16)
    dispatch_element<uint16_t>(be, args, cfg.element, hw, plan.vec, in_kernel);
  else
    dispatch_element<float>(be, args, cfg.element, hw, plan.vec, false);
  if (!want_values || in_kernel || plan.tiles == 0) return Status::ok();
  if (!out.row_bf16.empty())
    PACKMOE_RETURN_IF_ERROR(dequantize_mxfp8_sm90(
        be, mxfp8_copy_of(in, cfg.element, false, out), DType::kBF16, out.row_bf16));
  if (!out.col_bf16.empty())
    PACKMOE_RETURN_IF_ERROR(dequantize_mxfp8_sm90(
        be, mxfp8_copy_of(in, cfg.element, true, out), DType::kBF16, out.col_bf16));
  return Status::ok();
}

}  // namespace packmoe
