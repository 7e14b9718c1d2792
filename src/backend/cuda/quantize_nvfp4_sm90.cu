// NVFP4 grouped quantize (1x16 rowwise, transposed 16x1 columnwise with optional RHT and
// stochastic rounding, or 2D 16x16) of every group. The per-group amax must be known before any
// block is scaled, so this is TWO launches over the whole pack (never per group): an amax pass
// (input amax, and the post-RHT amax when the columnwise copy uses the RHT) with per-warp
// atomicMax into a zeroed workspace, whose last CTA turns the amax values into each group's
// S_enc / S_dec (GroupScales: two divisions per group, not per thread and tile), then the quantize
// pass, which walks the tiles in reverse so its first tiles are the ones the plain amax pass read
// last (still in L2). Invariant: every byte comes from formats/nvfp4_math.h with the SR numbering
// of formats/nvfp4.h, so it equals quantize_nvfp4_cpu; the E2M1 / E4M3 encoders and decoders of
// kernels_common.cuh replace the shared ones only where selftest.cu proved them equal on this
// device.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/grouped_gemm_dequant.cuh"  // convert8: the GEMM's own BF16 values
#include "backend/cuda/kernel_policy.h"
#include "backend/cuda/kernels_common.cuh"
#include "core/philox.h"
#include "formats/mxfp8_math.h"  // amax_update (via the encoders)
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

using cuda::GroupTable;

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kTileRows = 128;  // 8 column blocks of 16 rows: warp w owns rows 16w..
  static constexpr int kRowBytes = 256;  // input bytes of one tile row: 128 BF16 or 64 F32
  static constexpr int kStageBytes = kTileRows * kRowBytes;  // 32 KB
  static constexpr int kStages = 2;  // one tile loads while the CTA works on the other
  static constexpr int kInlineGroups = 4;
  static constexpr int kSmemGroups = 256;  // larger non-uniform tables are searched in place
  static constexpr int kStagingBytes = 10240;  // transposed-copy staging (Geo asserts the fit)
  // Three CTAs per SM: (2 x 32 KB + 10 KB + 1 KB group table + 1 KB reserved) x 3 = 228 KB.
  static constexpr int kMinBlocks = 3;
  static constexpr int kColBlocks = kTileRows / kNvfp4Block;  // 8
  static_assert(kColBlocks == kWarps, "warp w owns the tile's row block w (rows 16w..16w+15)");
  static_assert(kStageBytes % (16 * kThreads) == 0, "whole 16-byte chunks per thread");
};

// Tile geometry for input element type In.
template <typename In>
struct Geo {
  static constexpr int kCols = Config::kRowBytes / static_cast<int>(sizeof(In));  // 128 / 64
  static constexpr int kPerChunk = 16 / static_cast<int>(sizeof(In));  // elements per 16 B
  static constexpr int kChunksPerRow = Config::kRowBytes / 16;         // 16
  static constexpr int kKb = kCols / kNvfp4Block;                      // 1x16 blocks per row
  static constexpr int kRowsPerPass = 32 / kKb;        // rows of one warp instruction (4 / 8)
  static constexpr int kRowIters = kNvfp4Block / kRowsPerPass;  // row blocks per thread (4 / 2)
  static constexpr int kChunksPerBlock = kNvfp4Block / kPerChunk;  // 2 / 4
  static constexpr int kColGroups = kCols / 32;  // 32-column groups (column-phase warp tasks)
  static constexpr int kCodeWords = kCols / 8;  // 32-bit words of E2M1 codes per tile row
  // Column copy of the 1D path, staged: codes [kCols][pitch 72 B] (8 bytes per row block; the
  // pitch puts 16 consecutive columns on distinct bank pairs), then scales [kCols][8].
  static constexpr int kColPitch = 72;
  static constexpr int kColScaleOff = kCols * kColPitch;
  static_assert(kCols % 32 == 0 && 32 % kKb == 0, "warp shapes");
  static_assert(kColScaleOff + kCols * 8 <= Config::kStagingBytes, "1D staging fits");
  // 2D staging: row codes [kTileRows][16 words], then the tile scales [8 row blocks][8].
  static constexpr int kTscaleOff = Config::kTileRows * 64;
  static_assert(kCodeWords <= 16 && kKb <= 8, "2D staging layout");
  static_assert(kTscaleOff + 64 <= Config::kStagingBytes, "2D staging fits");
};

constexpr uint32_t kRowStream = 0;  // formats/nvfp4.h: SR stream of the rowwise copy
constexpr uint32_t kColStream = 1;  // ... and of the columnwise copy

struct Nvfp4Group {
  const void* in;      // (rows, K) In
  uint8_t* row_data;   // (rows, K/2), or null: the copy is kept as its values (row_bf16) only
  uint8_t* row_scale;  // (rows, K/16) E4M3, or null likewise
  uint8_t* col_data;   // (K, rows/2)
  uint8_t* col_scale;  // (K, rows/16) E4M3
  uint8_t* row_bf16;   // (rows, K) BF16 without S_dec, or null (Nvfp4Outputs::row_bf16)
  int64_t rows;
  uint64_t block_base;  // sum_{u<g} rows_u * K/16: SR number of the group's first block
  uint32_t tile_begin;
};

// A group's per-tensor scales, from its amax values once per group: the rowwise copy's S_enc / 6
// and S_dec, then the columnwise copy's (from the post-RHT amax with the RHT).
struct alignas(16) GroupScales {
  float row_enc6, row_dec, col_enc6, col_dec;
};

struct Nvfp4Args {
  GroupTable<Nvfp4Group, Config::kInlineGroups> groups;
  int64_t cols;  // K
  uint32_t col_tiles;
  cuda::FastDiv col_tiles_div;
  bool rowwise;
  bool columnwise;
  bool two_d;
  bool rht;
  bool sr;
  bool col16;  // every columnwise row is 16-byte aligned (rows % 32 == 0): 16-byte code stores
  bool row_bf16;  // the rowwise copy's BF16 values are written too
  PhiloxKeys sr_keys;  // round keys of the SR seed (formats/nvfp4.h numbering)
  uint64_t offset;
  float* amax_ws;   // (2G,): input amax [0, G), post-RHT amax [G, 2G); zeroed before pass 1
  GroupScales* scales;  // (G,): from amax_ws, by the amax pass's last CTA or the given amax
  uint32_t* amax_done;  // CTAs of the amax pass that have flushed; zeroed before pass 1
  const float* given_amax;  // (G,) Nvfp4Config::amax (replaces the amax pass), or null
  float* row_amax;  // (G,) output or null
  float* col_amax;  // (G,) output or null
};

struct TilePos {
  int g;
  const Nvfp4Group* grp;
  int64_t row0;  // first row of the tile in its group
  int64_t col0;  // first column
};

// Tile `tile` of group g (tile_begin_g <= tile < tile_begin_{g+1}).
template <typename In>
__device__ __forceinline__ TilePos tile_in_group(const Nvfp4Args& a, uint32_t tile, int g) {
  TilePos p;
  p.g = g;
  p.grp = &a.groups[g];
  const uint32_t local = tile - p.grp->tile_begin;
  const uint32_t rt = a.col_tiles_div.div(local);
  p.row0 = static_cast<int64_t>(rt) * Config::kTileRows;
  p.col0 = static_cast<int64_t>(local - rt * a.col_tiles) * Geo<In>::kCols;
  return p;
}

template <typename In>
__device__ __forceinline__ TilePos locate_tile(const Nvfp4Args& a, uint32_t tile,
                                               const uint32_t* begins) {
  return tile_in_group<In>(a, tile, a.groups.find_smem<Config::kSmemGroups>(tile, begins));
}

// ---- shared-memory tile: [kTileRows][kRowBytes], 16-byte chunk q of a row stored at chunk
// q ^ ((q >> 3) & 1): the row phase's two 16-byte reads per 1x16 block then hit 8 distinct bank
// quads per quarter-warp (chunk q and q + 8 would otherwise share banks).
__device__ __forceinline__ int chunk_slot(int q) { return q ^ ((q >> 3) & 1); }
__device__ __forceinline__ int tile_byte(int r, int byte_in_row) {
  return r * Config::kRowBytes + (chunk_slot(byte_in_row >> 4) << 4) + (byte_in_row & 15);
}

template <typename In>
__device__ __forceinline__ float tile_elem(const uint8_t* stage, int r, int c) {
  const int off = tile_byte(r, c * static_cast<int>(sizeof(In)));
  if constexpr (sizeof(In) == 2)
    return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(stage + off))
                           << 16);
  else
    return *reinterpret_cast<const float*>(stage + off);
}

// Loads of `tile` into `stage` (zeros outside the matrix; K % 16 == 0, so a 16-byte chunk is all
// in or all out). kVec: cp.async, one commit group per call; else scalar loads and plain stores.
template <typename In, bool kVec>
__device__ __forceinline__ void issue_tile(const Nvfp4Args& a, uint8_t* stage, const TilePos& p) {
  using G = Geo<In>;
  constexpr int kPer = Config::kStageBytes / 16 / Config::kThreads;
  constexpr int kRowStep = Config::kThreads / G::kChunksPerRow;  // rows between a thread's chunks
  static_assert(Config::kThreads % G::kChunksPerRow == 0, "a thread keeps its chunk column");
  // Thread t loads chunk t % 16 of rows t / 16 + kRowStep * m. One pointer walks the rows, so no
  // per-m offsets stay live across tiles.
  const int r0 = threadIdx.x / G::kChunksPerRow;
  const int ch = threadIdx.x % G::kChunksPerRow;
  const int64_t K = a.cols;
  const int64_t col = p.col0 + ch * G::kPerChunk;
  // Row r0 + kRowStep m exists iff kRowStep m < rows_left: a 32-bit count (at most a tile's rows),
  // zero when the chunk's columns are past K, so each load tests one 32-bit compare.
  const int64_t left = col < K ? p.grp->rows - p.row0 - r0 : 0;
  const int rows_left = static_cast<int>(left < Config::kTileRows ? left : Config::kTileRows);
  const In* base = static_cast<const In*>(p.grp->in);
  const In* src = base + (p.row0 + r0) * K + col;
  uint8_t* dst = stage + r0 * Config::kRowBytes + (chunk_slot(ch) << 4);
#pragma unroll
  for (int m = 0; m < kPer; ++m, src += kRowStep * K, dst += kRowStep * Config::kRowBytes) {
    const bool ok = kRowStep * m < rows_left;
    if constexpr (kVec) {
      cuda::cp_async16(dst, ok ? src : base, ok);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < G::kPerChunk; ++e) {
        if (!ok) break;
        const uint32_t bits = __float_as_uint(cuda::load_elem<In>(src + e));
        if constexpr (sizeof(In) == 4)
          w[e] = bits;
        else
          w[e / 2] |= (bits >> 16) << (16 * (e % 2));
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---- per-block arithmetic ----------------------------------------------------------------------

// NaN-ignoring amax of one 1x16 block held as 16-byte chunks; BF16 by packed maxima (exact).
template <typename In>
__device__ __forceinline__ float block_amax(const uint4 (&c)[Geo<In>::kChunksPerBlock]) {
  if constexpr (sizeof(In) == 2) {
    uint32_t m = 0;
#pragma unroll
    for (int h = 0; h < Geo<In>::kChunksPerBlock; ++h) {
      m = cuda::max_bf16x2(m, cuda::max_bf16x2(cuda::abs_bf16x2(c[h].x), cuda::abs_bf16x2(c[h].y)));
      m = cuda::max_bf16x2(m, cuda::max_bf16x2(cuda::abs_bf16x2(c[h].z), cuda::abs_bf16x2(c[h].w)));
    }
    return cuda::amax_bf16x2(0.0f, m);
  } else {
    float a = 0.0f;
#pragma unroll
    for (int h = 0; h < Geo<In>::kChunksPerBlock; ++h) {
      a = cuda::amax_fast(a, __uint_as_float(c[h].x));
      a = cuda::amax_fast(a, __uint_as_float(c[h].y));
      a = cuda::amax_fast(a, __uint_as_float(c[h].z));
      a = cuda::amax_fast(a, __uint_as_float(c[h].w));
    }
    return a;
  }
}

// E4M3 block scale s_b = nvfp4_block_scale(block_amax, s_enc), with s_enc * (1/6) precomputed in
// the same FP32 multiply. kHw: the hardware cvt (selftest.cu proves it equal to f32_to_e4m3 for
// every non-NaN input; block_amax * s_enc_over_6 is never NaN).
template <bool kHw>
__device__ __forceinline__ uint8_t block_scale(float block_amax, float s_enc_over_6) {
  if constexpr (kHw)
    return static_cast<uint8_t>(cuda::cvt_fp8x2<false>(block_amax * s_enc_over_6, 0.0f) & 0xFFu);
  else
    return f32_to_e4m3(block_amax * s_enc_over_6);
}

// The block's decoded scale float(s_b), by the hardware FP8 conversion when kHw, and its encode
// multiplier nvfp4_block_rcp.
template <bool kHw>
__device__ __forceinline__ float block_scale_value(uint8_t s_b) {
  if constexpr (kHw)
    return cuda::e4m3_to_f32_hw(s_b);
  else
    return e4m3_to_f32(s_b);
}
template <bool kHw>
__device__ __forceinline__ float block_rcp(uint8_t s_b, float s_dec) {
  return nvfp4_block_rcp_of(block_scale_value<kHw>(s_b), s_dec);
}

// A rowwise copy kept as its values only: the 16 BF16 values the codes of v[j] * r would decode to
// times the block scale value sc (the same bits as encode16_hw's values), without forming the
// codes. Two values at a time: the signed grid values to BF16 (exact), then one BF16 multiply by
// sc in both halves (exact, as in the dequantize's convert8: at most 6 significant bits).
template <bool kSr>
__device__ __forceinline__ void values16_hw(const float v[kNvfp4Block], float r, const Philox4& draw,
                                            float sc, uint32_t values[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t sc2 = gemm_convert::f32x2_to_bf16x2(sc, sc);
#endif
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float g[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float y = v[2 * i + h] * r;
      g[h] = kSr ? cuda::e2m1_sr_value(y, cuda::sr_byte(draw, 2 * i + h)) : cuda::e2m1_rn_value(y);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    values[i] = gemm_convert::bf16x2_mul(gemm_convert::f32x2_to_bf16x2(g[0], g[1]), sc2);
#else
    values[i] = gemm_convert::f32x2_to_bf16x2(g[0] * sc, g[1] * sc);
#endif
  }
}

// 16 codes of v[j] * r (RNE, or SR from one Philox draw) by the encoders of kernels_common.cuh,
// packed into 8 bytes, element 2i in the low nibble of byte i. With kValues also the BF16 values
// the codes decode to times the block scale sc, in values[8] (element 2i in the low half of word
// i): the signed rounded magnitude times sc, exact in FP32 and BF16 (e2m1 * e4m3: at most 6
// significant bits), so the same bits as the dequantize's convert8 of the codes.
template <bool kSr, bool kValues>
__device__ __forceinline__ uint2 encode16_hw(const float v[kNvfp4Block], float r,
                                             const Philox4& draw, float sc, uint32_t* values) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t mag[8], sgn[8];
    float q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float y = v[8 * h + j] * r;
      sgn[j] = __float_as_uint(y);
      const cuda::E2m1Rounded e = kSr ? cuda::e2m1_sr_round(y, cuda::sr_byte(draw, 8 * h + j))
                                      : cuda::e2m1_rn_round(y);
      mag[j] = e.sum;
      const float grid = __uint_as_float(kSr ? e.sum & ~0xFFu : e.sum) - e.m;  // exact
      q[j] = __uint_as_float(__float_as_uint(grid) | (sgn[j] & 0x80000000u)) * sc;
    }
    w[h] = cuda::pack_e2m1x8<kSr ? 1 : 0>(mag, sgn);
    if constexpr (kValues) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        values[4 * h + i] = gemm_convert::f32x2_to_bf16x2(q[2 * i], q[2 * i + 1]);
    }
  }
  return make_uint2(w[0], w[1]);
}

// The same codes: kHw by encode16_hw, else by the shared codecs (and no values).
template <bool kHw, bool kValues = false>
__device__ __forceinline__ uint2 encode16(const float v[kNvfp4Block], float r, bool sr,
                                          const Philox4& draw, float sc = 0.0f,
                                          uint32_t* values = nullptr) {
  static_assert(kHw || !kValues, "the BF16 values come with the hardware encoders");
  if constexpr (kHw) {
    return sr ? encode16_hw<true, kValues>(v, r, draw, sc, values)
              : encode16_hw<false, kValues>(v, r, draw, sc, values);
  } else {
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < kNvfp4Block; ++j) {
      const uint32_t code = sr ? nvfp4_encode_sr(v[j], r, nvfp4_sr_byte(draw, j))
                               : nvfp4_encode(v[j], r);
      w[j / 8] += code << (4 * (j % 8));
    }
    return make_uint2(w[0], w[1]);
  }
}

// Stores of n bytes (n = 4, 8 or 16) of codes: one vector store, or bytes on unaligned views.
template <bool kVec, int N>
__device__ __forceinline__ void store_n(uint8_t* dst, const uint32_t (&w)[N / 4]) {
  if constexpr (kVec) {
    if constexpr (N == 4) __stcs(reinterpret_cast<unsigned*>(dst), w[0]);
    if constexpr (N == 8) __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]));
    if constexpr (N == 16)
      __stcs(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]));
  } else {
#pragma unroll
    for (int b = 0; b < N; ++b) dst[b] = static_cast<uint8_t>(w[b / 4] >> (8 * (b % 4)));
  }
}

// rht16 (formats/nvfp4_math.h) with the same FP32 operations, minus the rounding of inputs that
// already are BF16 values (kBf16In: an identity for every non-NaN value, and a NaN input makes the
// first butterfly produce the canonical NaN either way), and with the outputs rounded to BF16 by
// the hardware cvt when kHw (selftest.cu: equal values, NaN stays NaN). In three steps: the
// butterflies, then each output scaled and rounded.
template <bool kBf16In>
__device__ __forceinline__ void rht16_unscaled(const float in[kRhtSize], float out[kRhtSize]) {
#pragma unroll
  for (int i = 0; i < kRhtSize; ++i) out[i] = kBf16In ? in[i] : bf16_to_f32(f32_to_bf16(in[i]));
  rht16_butterflies(out);
}
template <bool kHw>
__device__ __forceinline__ float rht16_scale_round(float v) {
  const float s = rht16_scaled(v);
  return kHw ? cuda::round_bf16_hw(s) : bf16_to_f32(f32_to_bf16(s));
}
// kHw: the scaling as one FMA and two outputs per BF16 cvt (selftest.cu checks both).
template <bool kBf16In, bool kHw>
__device__ __forceinline__ void rht16_fast(const float in[kRhtSize], float out[kRhtSize]) {
  rht16_unscaled<kBf16In>(in, out);
  if constexpr (kHw) {
#pragma unroll
    for (int j = 0; j < kRhtSize; j += 2) {
      const uint32_t w = gemm_convert::f32x2_to_bf16x2(cuda::rht16_scaled_fma(out[j]),
                                                       cuda::rht16_scaled_fma(out[j + 1]));
      out[j] = __uint_as_float(w << 16);
      out[j + 1] = __uint_as_float(w & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kRhtSize; ++j) out[j] = rht16_scale_round<false>(out[j]);
  }
}

// 8x8 transpose of 4-bit elements: w[i] nibble j (row i, column j) -> w[j] nibble i. Three
// rounds of block swaps (4x4, 2x2, 1x1 blocks), each a masked xor exchange between two words.
__device__ __forceinline__ void transpose_nibbles8x8(uint32_t w[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t t = ((w[i] >> 16) ^ w[i + 4]) & 0x0000FFFFu;
    w[i] ^= t << 16;
    w[i + 4] ^= t;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i & 2) continue;
    const uint32_t t = ((w[i] >> 8) ^ w[i + 2]) & 0x00FF00FFu;
    w[i] ^= t << 8;
    w[i + 2] ^= t;
  }
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const uint32_t t = ((w[i] >> 4) ^ w[i + 1]) & 0x0F0F0F0Fu;
    w[i] ^= t << 4;
    w[i + 1] ^= t;
  }
}

// The SR draw of the group's block number `block` (formats/nvfp4.h numbering) in one copy's
// stream; no draw (zeros) without SR.
__device__ __forceinline__ Philox4 sr_draw(const Nvfp4Args& a, const Nvfp4Group& grp, int64_t block,
                                           uint32_t stream) {
  Philox4 draw{};
  if (a.sr)
    draw = philox_draw(a.sr_keys, a.offset + grp.block_base + static_cast<uint64_t>(block), stream);
  return draw;
}

// ---- pass 1: per-group amax ----------------------------------------------------------------------

// GroupScales of every group from amax (2G,) (read through L2: other CTAs' atomics wrote it).
__device__ __forceinline__ void store_group_scales(const Nvfp4Args& a, const float* amax) {
  const int G_count = a.groups.count;
  for (int g = threadIdx.x; g < G_count; g += Config::kThreads) {
    const float row = __ldcg(amax + g);
    const float col = a.rht ? __ldcg(amax + G_count + g) : row;
    a.scales[g] = {nvfp4_encode_scale(row) * kOneSixth, nvfp4_decode_scale(row),
                   nvfp4_encode_scale(col) * kOneSixth, nvfp4_decode_scale(col)};
  }
}

// Max over the warp of non-negative, non-NaN values, published by one atomicMax per warp: the
// values' IEEE order is their unsigned bit order.
__device__ __forceinline__ void flush_amax(float* slot, float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  if (threadIdx.x % 32 == 0 && v > 0.0f)
    atomicMax(reinterpret_cast<unsigned*>(slot), __float_as_uint(v));
}

// The plain amax reads a group as the flat array it is (rows * K contiguous elements): its i-th
// tile stands for bytes [i * kStageBytes, (i + 1) * kStageBytes) of the group, contiguous 4 KB
// per CTA load step, which DRAM serves better than a tile's 128 rows of 256 bytes. A group has at
// least as many tiles as such chunks; chunks past its end read nothing.
template <typename In, bool kVec>
__device__ __forceinline__ void load_amax_chunks(uint32_t local_tile, const Nvfp4Group& grp,
                                                 int64_t K,
                                                 uint4 (&v)[Config::kStageBytes / 16 /
                                                            Config::kThreads]) {
  using G = Geo<In>;
  constexpr int kPer = Config::kStageBytes / 16 / Config::kThreads;
  constexpr int64_t kElems = Config::kStageBytes / static_cast<int>(sizeof(In));
  const In* in = static_cast<const In*>(grp.in);
  const int64_t n = grp.rows * K;
  const int64_t base = static_cast<int64_t>(local_tile) * kElems;
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int64_t e0 = base + static_cast<int64_t>(threadIdx.x + m * Config::kThreads) * G::kPerChunk;
    const bool ok = e0 < n;  // n % kPerChunk == 0 (K % 16 == 0): a chunk is all in or out
    if constexpr (kVec) {
      v[m] = ok ? cuda::load_stream16(in + e0) : make_uint4(0, 0, 0, 0);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < G::kPerChunk; ++e) {
        if (!ok) break;
        const uint32_t bits = __float_as_uint(cuda::load_elem<In>(in + e0 + e));
        if constexpr (sizeof(In) == 4)
          w[e] = bits;
        else
          w[e / 2] |= (bits >> 16) << (16 * (e % 2));
      }
      v[m] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Input amax (and, kRht, the amax of the RHT outputs of every 16x1 column block). A thread keeps
// running maxima while the CTA stays in one group and flushes them when the group changes, so a
// single-group tensor costs one atomic per warp. Without the RHT the loads of the CTA's next tile
// are in flight while the current one is reduced.
template <typename In, bool kVec, bool kRht, bool kHw>
__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_amax_kernel(const __grid_constant__ Nvfp4Args a) {
  using G = Geo<In>;
  __shared__ uint32_t begins[Config::kSmemGroups];
  a.groups.template load_tile_begins<Config::kSmemGroups>(begins);
  __syncthreads();
  const int64_t K = a.cols;
  const int G_count = a.groups.count;
  const uint32_t total = a.groups.total_tiles;
  // >= 0, never NaN. rht_max is the largest |butterfly output|, scaled and rounded once per flush:
  // both steps are monotonic and odd, so that equals the largest |rht16_fast output| (NaN ignored
  // by both).
  float in_max = 0.0f, rht_max = 0.0f;
  uint32_t in_w = 0;                    // BF16: packed running max of |x|
  int cur = -1;
  auto switch_group = [&](int g) {
    if (g == cur) return;
    if (cur >= 0) {
      if constexpr (sizeof(In) == 2) in_max = cuda::amax_bf16x2(in_max, in_w);
      flush_amax(a.amax_ws + cur, in_max);
      if constexpr (kRht) flush_amax(a.amax_ws + G_count + cur, rht16_scale_round<kHw>(rht_max));
    }
    cur = g;
    in_max = rht_max = 0.0f;
    in_w = 0;
  };
  if constexpr (!kRht) {
    constexpr int kPer = Config::kStageBytes / 16 / Config::kThreads;
    uint32_t tile = blockIdx.x;  // < total: the grid has at most `total` CTAs (launch)
    int g = a.groups.find_smem<Config::kSmemGroups>(tile, begins);
    uint4 v[kPer];
    load_amax_chunks<In, kVec>(tile - a.groups[g].tile_begin, a.groups[g], K, v);
    while (true) {
      const uint32_t next = tile + gridDim.x;
      int ng = 0;
      uint4 nv[kPer];
      if (next < total) {
        ng = a.groups.find_smem<Config::kSmemGroups>(next, begins);
        load_amax_chunks<In, kVec>(next - a.groups[ng].tile_begin, a.groups[ng], K, nv);
      }
      switch_group(g);
#pragma unroll
      for (int m = 0; m < kPer; ++m) {
        if constexpr (sizeof(In) == 2) {
          in_w = cuda::max_bf16x2(in_w, cuda::max_bf16x2(cuda::abs_bf16x2(v[m].x),
                                                         cuda::abs_bf16x2(v[m].y)));
          in_w = cuda::max_bf16x2(in_w, cuda::max_bf16x2(cuda::abs_bf16x2(v[m].z),
                                                         cuda::abs_bf16x2(v[m].w)));
        } else {
          in_max = cuda::amax_fast(in_max, __uint_as_float(v[m].x));
          in_max = cuda::amax_fast(in_max, __uint_as_float(v[m].y));
          in_max = cuda::amax_fast(in_max, __uint_as_float(v[m].z));
          in_max = cuda::amax_fast(in_max, __uint_as_float(v[m].w));
        }
      }
      if (next >= total) break;
      tile = next;
      g = ng;
#pragma unroll
      for (int m = 0; m < kPer; ++m) v[m] = nv[m];
    }
  } else {
    // A CTA takes one contiguous range of tiles, so it looks its group up once and flushes its
    // maxima once per group it crosses (a grid-stride walk changed group at nearly every tile of
    // a many-group pack: a table search, a descriptor load and two flushes each).
    const uint32_t per = (total + gridDim.x - 1) / gridDim.x;
    const uint32_t first = blockIdx.x * per;
    const uint32_t last = min(total, first + per);
    int g = first < last ? a.groups.find_smem<Config::kSmemGroups>(first, begins) : 0;
    auto group_end = [&](int h) { return h + 1 < G_count ? a.groups[h + 1].tile_begin : total; };
    uint32_t end = group_end(g);
    for (uint32_t tile = first; tile < last; ++tile) {
      while (tile >= end) end = group_end(++g);  // empty groups own no tile
      const TilePos p = tile_in_group<In>(a, tile, g);
      switch_group(p.g);
      const In* in = static_cast<const In*>(p.grp->in);
      // Thread t: column block row rb = t / 32, 8 bytes of columns (4 BF16 / 2 F32) at piece
      // t % 32, 16 rows; a warp's load covers 256 consecutive bytes of one row.
      constexpr int kPer8 = 8 / static_cast<int>(sizeof(In));
      const int rb = threadIdx.x / 32;
      const int64_t col = p.col0 + (threadIdx.x % 32) * kPer8;
      const int64_t row0 = p.row0 + rb * kNvfp4Block;
      const bool ok = row0 < p.grp->rows && col < K;  // rows % 16 == 0: blocks all in or out
      uint2 v[kNvfp4Block];
#pragma unroll
      for (int i = 0; i < kNvfp4Block; ++i) {
        if constexpr (kVec) {
          v[i] = ok ? __ldcs(reinterpret_cast<const uint2*>(in + (row0 + i) * K + col))
                    : make_uint2(0, 0);
        } else {
          uint32_t w[2] = {0, 0};
#pragma unroll
          for (int e = 0; e < kPer8; ++e) {
            if (!ok) break;
            const uint32_t bits =
                __float_as_uint(cuda::load_elem<In>(in + (row0 + i) * K + col + e));
            if constexpr (sizeof(In) == 4)
              w[e] = bits;
            else
              w[e / 2] |= (bits >> 16) << (16 * (e % 2));
          }
          v[i] = make_uint2(w[0], w[1]);
        }
      }
#pragma unroll
      for (int e = 0; e < kPer8; ++e) {
        float x[kNvfp4Block], y[kNvfp4Block];
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i) {
          const uint32_t w = (e * sizeof(In) < 4) ? v[i].x : v[i].y;
          x[i] = sizeof(In) == 4 ? __uint_as_float(w)
                                 : __uint_as_float((e % 2) ? (w & 0xFFFF0000u) : (w << 16));
          in_max = cuda::amax_fast(in_max, x[i]);
        }
        rht16_unscaled<sizeof(In) == 2>(x, y);
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i) rht_max = cuda::amax_fast(rht_max, y[i]);
      }
    }
  }
  switch_group(-1);  // flush
  // The CTA that flushes last (every CTA counts itself after its flushes are visible) turns the
  // complete amax values into the groups' scales.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.amax_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) {
    __threadfence();
    store_group_scales(a, a.amax_ws);
  }
}

// The groups' scales from a given amax (weights: AdamW's pass wrote it), which also fills amax_ws
// for the quantize pass's amax outputs; one CTA.
__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_given_amax_kernel(const __grid_constant__ Nvfp4Args a) {
  const int G_count = a.groups.count;
  for (int g = threadIdx.x; g < G_count; g += Config::kThreads) a.amax_ws[g] = a.given_amax[g];
  __syncthreads();
  store_group_scales(a, a.amax_ws);
}

// For the tile the CTA works on next: its group's scales (GroupScales) into registers, and the
// group's descriptor (an uploaded table's row) into L1, so that neither is a global-memory round
// trip after the tile's barrier (measured: with the loads at their use, the 2D pass spent a fifth
// of its stall samples waiting on them).
__device__ __forceinline__ GroupScales prefetch_tile_group(const Nvfp4Args& a, const TilePos& t) {
  if (a.groups.uploaded != nullptr && threadIdx.x == 0) {
    const char* d = reinterpret_cast<const char*>(a.groups.uploaded + t.g);
    asm volatile("prefetch.global.L1 [%0];" ::"l"(d));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(d + sizeof(Nvfp4Group) - 1));
  }
  const float4 v = *reinterpret_cast<const float4*>(a.scales + t.g);
  return {v.x, v.y, v.z, v.w};
}

// ---- pass 2: scales and codes ---------------------------------------------------------------------

// Per tile, in one CTA: (1) row phase: thread (warp w, lane) owns 1x16 row blocks of rows
// 16w + kRowsPerPass*m + lane / kKb, block lane % kKb, and writes the rowwise copy directly
// (8 lanes x 8 bytes contiguous per row); in 2D it forms the 16x16 tile scale by shuffles and
// stages its codes for the transpose. (2) column phase (1D): warp w's lanes own 32 consecutive
// columns of row block w (conflict-free column reads), RHT / amax / SR in registers, codes staged.
// (3) after a barrier the transposed copy leaves in 64-byte runs per column. kTwoD (16x16 weight
// tiles) and 1D are separate instantiations, so neither's register allocation constrains the
// other's (the 1D one keeps a few loop invariants on the stack, reloaded once per tile).
template <typename In, bool kVec, bool kHw, bool kTwoD, bool kRowBf16>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinBlocks)
    nvfp4_quantize_kernel(const __grid_constant__ Nvfp4Args a) {
  using G = Geo<In>;
  extern __shared__ __align__(16) uint8_t smem[];  // [kStages][kStageBytes] + staging
  __shared__ uint32_t begins[Config::kSmemGroups];
  uint8_t* staging = smem + Config::kStages * Config::kStageBytes;  // kStagingBytes
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t K = a.cols;
  const int Gc = a.groups.count;

  // One CTA publishes the amax outputs of every group (0 for empty groups, which own no tile).
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < Gc; g += Config::kThreads) {
      const float in_amax = a.amax_ws[g];
      if (a.row_amax) a.row_amax[g] = in_amax;
      if (a.col_amax) a.col_amax[g] = a.rht ? a.amax_ws[Gc + g] : in_amax;
    }
  }
  a.groups.template load_tile_begins<Config::kSmemGroups>(begins);
  __syncthreads();

  // Reverse order: the plain amax pass walked the tiles forwards, so the last ones it read are in
  // L2. (The RHT amax pass ends on the last tiles of each CTA's range, which this order does not
  // meet; measured, that cost nothing: the RHT quantize pass is bound by its arithmetic.)
  const uint32_t total = a.groups.total_tiles;
  auto tile_of = [&](uint32_t i) { return total - 1 - i; };
  uint32_t i = blockIdx.x;
  TilePos next{};  // the tile whose loads are in flight
  GroupScales next_scales{};
  if (i < total) {
    next = locate_tile<In>(a, tile_of(i), begins);
    next_scales = prefetch_tile_group(a, next);
    issue_tile<In, kVec>(a, smem, next);
  }
  cuda::cp_async_commit();
  for (int s = 0; i < total; i += gridDim.x, s ^= 1) {
    const uint8_t* stage = smem + s * Config::kStageBytes;
    cuda::cp_async_wait<0>();
    // B1: the tile is visible, and every thread is done with the previous tile (its stage, which
    // the next load overwrites, and the staging area).
    __syncthreads();
    const TilePos p = next;
    const GroupScales sc = next_scales;
    if (i + gridDim.x < total) {
      next = locate_tile<In>(a, tile_of(i + gridDim.x), begins);
      next_scales = prefetch_tile_group(a, next);
      issue_tile<In, kVec>(a, smem + (s ^ 1) * Config::kStageBytes, next);
    }
    cuda::cp_async_commit();

    const Nvfp4Group& grp = *p.grp;
    const int64_t rows = grp.rows;

    // ---- (1) row phase ----
    const int rsub = lane / G::kKb;
    const int kb = lane % G::kKb;
    const bool kb_ok = p.col0 + kb * kNvfp4Block < K;
    const int64_t kbg = p.col0 / kNvfp4Block + kb;
    auto row_of = [&](int m) { return kNvfp4Block * warp + G::kRowsPerPass * m + rsub; };
    auto load_block = [&](int m, uint4 (&raw)[G::kChunksPerBlock]) {
#pragma unroll
      for (int h = 0; h < G::kChunksPerBlock; ++h)
        raw[h] = *reinterpret_cast<const uint4*>(
            stage + tile_byte(row_of(m), (kb * G::kChunksPerBlock + h) * 16));
    };
    auto values = [&](const uint4 (&raw)[G::kChunksPerBlock], float v[kNvfp4Block]) {
#pragma unroll
      for (int h = 0; h < G::kChunksPerBlock; ++h)
#pragma unroll
        for (int e = 0; e < G::kPerChunk; ++e)
          v[h * G::kPerChunk + e] = cuda::chunk_elem<In>(raw[h], e);
    };
    if constexpr (kTwoD) {
      const float s_enc6 = sc.row_enc6;
      const float s_dec = sc.row_dec;
      // 16x16 tile amax: the thread's kRowIters blocks, then the lanes of the other rows.
      float t = 0.0f;
#pragma unroll
      for (int m = 0; m < G::kRowIters; ++m) {
        uint4 raw[G::kChunksPerBlock];
        load_block(m, raw);
        t = fmaxf(t, block_amax<In>(raw));  // block amaxes are >= 0 and never NaN
      }
#pragma unroll
      for (int sh = G::kKb; sh < 32; sh <<= 1) t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, sh));
      const uint8_t tscale = block_scale<kHw>(t, s_enc6);
      const float r = block_rcp<kHw>(tscale, s_dec);
      uint32_t* rc = reinterpret_cast<uint32_t*>(staging);
#pragma unroll
      for (int m = 0; m < G::kRowIters; ++m) {
        uint4 raw[G::kChunksPerBlock];
        load_block(m, raw);
        float v[kNvfp4Block];
        values(raw, v);
        const uint2 c = encode16<kHw>(v, r, false, Philox4{});
        const int64_t row = p.row0 + row_of(m);
        if (a.rowwise && kb_ok && row < rows) {
          store_n<kVec, 8>(grp.row_data + row * (K / 2) + kbg * 8, {c.x, c.y});
          grp.row_scale[row * (K / kNvfp4Block) + kbg] = tscale;
        }
        // Staged row codes: word w of tile row r at w ^ ((r >> 3) % kCodeWords), so the
        // transpose's reads of 16 rows 8 apart hit at most 2 words per bank.
        const int rr = row_of(m);
        const int sw = (rr >> 3) % G::kCodeWords;
        rc[rr * 16 + ((2 * kb) ^ sw)] = c.x;
        rc[rr * 16 + ((2 * kb + 1) ^ sw)] = c.y;
      }
      if (rsub == 0) staging[G::kTscaleOff + warp * 8 + kb] = tscale;
    } else if (a.rowwise) {
      const float s_enc6 = sc.row_enc6;
      const float s_dec = sc.row_dec;
#pragma unroll
      for (int m = 0; m < G::kRowIters; ++m) {
        const int64_t row = p.row0 + row_of(m);
        if (!(kb_ok && row < rows)) continue;
        uint4 raw[G::kChunksPerBlock];
        load_block(m, raw);
        const uint8_t s_b = block_scale<kHw>(block_amax<In>(raw), s_enc6);
        const float s_b_value = block_scale_value<kHw>(s_b);
        const float r = nvfp4_block_rcp_of(s_b_value, s_dec);
        const Philox4 draw = sr_draw(a, grp, row * (K / kNvfp4Block) + kbg, kRowStream);
        float v[kNvfp4Block];
        values(raw, v);
        // With kRowBf16, the values the GEMM's dequantize would write: from the encoder (kHw; the
        // values alone when the copy keeps no codes), or by the dequantize's own code.
        uint32_t bf16[8];
        uint2 c{};
        const bool codes = grp.row_data != nullptr;
        if constexpr (kRowBf16 && kHw) {
          if (codes)
            c = encode16<true, true>(v, r, a.sr, draw, s_b_value, bf16);
          else if (a.sr)
            values16_hw<true>(v, r, draw, s_b_value, bf16);
          else
            values16_hw<false>(v, r, draw, s_b_value, bf16);
        } else {
          c = encode16<kHw>(v, r, a.sr, draw);
        }
        if (codes) {
          store_n<kVec, 8>(grp.row_data + row * (K / 2) + kbg * 8, {c.x, c.y});
          grp.row_scale[row * (K / kNvfp4Block) + kbg] = s_b;
        }
        if constexpr (kRowBf16) {
          if constexpr (!kHw) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint4 d = gemm_convert::convert8<gemm_convert::DequantKind::kNvfp4>(
                  gemm_convert::Raw8{make_uint2(h ? c.y : c.x, 0), make_uint2(s_b, 0)});
              const uint32_t words[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
              for (int i = 0; i < 4; ++i) bf16[4 * h + i] = words[i];
            }
          }
          uint8_t* dst = grp.row_bf16 + (row * K + kbg * kNvfp4Block) * 2;
          store_n<kVec, 16>(dst, {bf16[0], bf16[1], bf16[2], bf16[3]});
          store_n<kVec, 16>(dst + 16, {bf16[4], bf16[5], bf16[6], bf16[7]});
        }
      }
    }
    if (!a.columnwise) continue;  // uniform; B1 of the next tile orders the stage's reuse

    // ---- (2) column phase (1D columnwise): codes and scales to the staging area ----
    if constexpr (!kTwoD) {
      const float s_enc6 = sc.col_enc6;
      const float s_dec = sc.col_dec;
      const int rb = warp;
      const int64_t rbg = p.row0 / kNvfp4Block + rb;
#pragma unroll 1
      for (int u = 0; u < G::kColGroups; ++u) {
        const int c = u * 32 + lane;
        const int64_t cg = p.col0 + c;
        uint2 code = make_uint2(0, 0);
        uint8_t s_b = 0;
        if (cg < K && rbg * kNvfp4Block < rows) {
          // The draw first: its 4 words, not its temporaries, are live beside the 16 values.
          const Philox4 draw = sr_draw(a, grp, cg * (rows / kNvfp4Block) + rbg, kColStream);
          float x[kNvfp4Block], v[kNvfp4Block];
#pragma unroll
          for (int r = 0; r < kNvfp4Block; ++r)
            x[r] = tile_elem<In>(stage, rb * kNvfp4Block + r, c);
          if (a.rht) {
            rht16_fast<sizeof(In) == 2, kHw>(x, v);
          } else {
#pragma unroll
            for (int r = 0; r < kNvfp4Block; ++r) v[r] = x[r];
          }
          float am = 0.0f;
#pragma unroll
          for (int r = 0; r < kNvfp4Block; ++r) am = cuda::amax_fast(am, v[r]);
          s_b = block_scale<kHw>(am, s_enc6);
          const float rc = block_rcp<kHw>(s_b, s_dec);
          code = encode16<kHw>(v, rc, a.sr, draw);
        }
        *reinterpret_cast<uint2*>(staging + c * G::kColPitch + rb * 8) = code;
        staging[G::kColScaleOff + c * 8 + rb] = s_b;
      }
    }
    __syncthreads();  // B2: staging complete

    // ---- (3) the transposed copy ----
    if constexpr (kTwoD) {
      // Thread (8-column group cg, row block rb, half h): an 8x8 nibble transpose of its 8 rows
      // gives 4 bytes of each of its 8 columns; 16 lanes write a column's 64 bytes.
      const int h = threadIdx.x & 1;
      const int rb = (threadIdx.x >> 1) & 7;
      const int cgrp = threadIdx.x >> 4;
      const int64_t rbg = p.row0 / kNvfp4Block + rb;
      if (cgrp < G::kCodeWords && rbg * kNvfp4Block < rows) {
        const uint32_t* rc = reinterpret_cast<const uint32_t*>(staging);
        uint32_t w[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int r = rb * kNvfp4Block + 8 * h + q;
          w[q] = rc[r * 16 + (cgrp ^ ((r >> 3) % G::kCodeWords))];
        }
        transpose_nibbles8x8(w);
        const uint8_t s_b = staging[G::kTscaleOff + rb * 8 + (cgrp * 8) / kNvfp4Block];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int64_t cgl = p.col0 + cgrp * 8 + j;
          if (cgl >= K) continue;
          store_n<kVec, 4>(grp.col_data + cgl * (rows / 2) + rbg * 8 + 4 * h, {w[j]});
          if ((j >> 2) == h) grp.col_scale[cgl * (rows / kNvfp4Block) + rbg] = s_b;
        }
      }
    } else {
      // Column c's 8 row blocks: 64 bytes, 4 threads x 16 (or 2 x 8-byte stores).
      constexpr int kPieces = G::kCols * 4;
#pragma unroll
      for (int q = threadIdx.x; q < kPieces; q += Config::kThreads) {
        const int c = q / 4;
        const int pc = q % 4;  // row blocks 2pc, 2pc+1
        const int64_t cg = p.col0 + c;
        const int64_t rbg = p.row0 / kNvfp4Block + 2 * pc;
        if (cg >= K || rbg * kNvfp4Block >= rows) continue;
        const uint2 lo = *reinterpret_cast<const uint2*>(staging + c * G::kColPitch + 16 * pc);
        const uint2 hi = *reinterpret_cast<const uint2*>(staging + c * G::kColPitch + 16 * pc + 8);
        uint8_t* dst = grp.col_data + cg * (rows / 2) + rbg * 8;
        if (kVec && a.col16) {
          store_n<true, 16>(dst, {lo.x, lo.y, hi.x, hi.y});
        } else {
          store_n<kVec, 8>(dst, {lo.x, lo.y});
          if ((rbg + 1) * kNvfp4Block < rows) store_n<kVec, 8>(dst + 8, {hi.x, hi.y});
        }
      }
      if (threadIdx.x < G::kCols) {
        const int c = threadIdx.x;
        const int64_t cg = p.col0 + c;
        const int64_t rb0 = p.row0 / kNvfp4Block;
        const int64_t nrb = rows / kNvfp4Block;
        if (cg < K) {
          uint8_t* dst = grp.col_scale + cg * nrb + rb0;
          const uint8_t* src = staging + G::kColScaleOff + c * 8;
          if (rb0 + 8 <= nrb && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
            *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
          } else {
            for (int b = 0; b < 8 && rb0 + b < nrb; ++b) dst[b] = src[b];
          }
        }
      }
    }
  }
}

// Both grids hold every resident CTA unless QuantizePolicy::nvfp4_max_ctas caps them (tests: a few
// CTAs walk many tiles and groups).
uint64_t grid_cap(uint64_t resident) {
  const int n = kernel_policy().quantize.nvfp4_max_ctas;
  return n > 0 ? std::min<uint64_t>(resident, static_cast<uint64_t>(n)) : resident;
}

// The amax pass fills a.amax_ws unless the caller already did (a given amax); the quantize pass
// is skipped when only the amax is wanted (nvfp4_amax).
template <typename In, bool kVec, bool kHw>
void launch(CudaBackend& be, const Nvfp4Args& a, bool amax_pass, bool quantize_pass) {
  constexpr size_t kSmem =
      static_cast<size_t>(Config::kStages) * Config::kStageBytes + Config::kStagingBytes;
  auto* amax_plain = &nvfp4_amax_kernel<In, kVec, false, false>;
  auto* amax_rht = &nvfp4_amax_kernel<In, kVec, true, kHw>;
  auto* quant_1d = &nvfp4_quantize_kernel<In, kVec, kHw, false, false>;
  auto* quant_1d_bf16 = &nvfp4_quantize_kernel<In, kVec, kHw, false, true>;
  auto* quant_2d = &nvfp4_quantize_kernel<In, kVec, kHw, true, false>;
  // Per instantiation, once: persistent grids of as many CTAs as fit on the device at once.
  auto per_sm = [](auto* kernel, size_t smem) {
    if (smem > 48 * 1024)
      PACKMOE_CUDA_CHECK(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int n = 0;
    PACKMOE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Config::kThreads, smem));
    PACKMOE_CHECK(n > 0, "NVFP4 kernel does not fit on an SM");
    return n;
  };
  static const int plain_per_sm = per_sm(amax_plain, 0);
  static const int rht_per_sm = per_sm(amax_rht, 0);
  static const int quant_1d_per_sm = per_sm(quant_1d, kSmem);
  static const int quant_1d_bf16_per_sm = per_sm(quant_1d_bf16, kSmem);
  static const int quant_2d_per_sm = per_sm(quant_2d, kSmem);
  const uint64_t tiles = a.groups.total_tiles;
  if (tiles == 0) return;
  const uint64_t sms = static_cast<uint64_t>(be.sm_count());
  if (amax_pass) {
    const uint64_t resident = (a.rht ? rht_per_sm : plain_per_sm) * sms;
    const uint64_t g1 = std::min<uint64_t>(tiles, grid_cap(resident));
    if (a.rht)
      amax_rht<<<static_cast<unsigned>(g1), Config::kThreads, 0, be.stream()>>>(a);
    else
      amax_plain<<<static_cast<unsigned>(g1), Config::kThreads, 0, be.stream()>>>(a);
    PACKMOE_CUDA_CHECK_LAUNCH();
  } else {
    nvfp4_given_amax_kernel<<<1, Config::kThreads, 0, be.stream()>>>(a);
    PACKMOE_CUDA_CHECK_LAUNCH();
  }
  if (!quantize_pass) return;
  auto* quant = a.two_d ? quant_2d : a.row_bf16 ? quant_1d_bf16 : quant_1d;
  const int quant_per_sm = a.two_d      ? quant_2d_per_sm
                           : a.row_bf16 ? quant_1d_bf16_per_sm
                                        : quant_1d_per_sm;
  const uint64_t g2 = std::min<uint64_t>(tiles, grid_cap(quant_per_sm * sms));
  quant<<<static_cast<unsigned>(g2), Config::kThreads, kSmem, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

template <typename In>
void dispatch(CudaBackend& be, const Nvfp4Args& a, bool vec, bool hw, bool amax_pass,
              bool quantize_pass) {
  if (hw)
    vec ? launch<In, true, true>(be, a, amax_pass, quantize_pass)
        : launch<In, false, true>(be, a, amax_pass, quantize_pass);
  else
    vec ? launch<In, true, false>(be, a, amax_pass, quantize_pass)
        : launch<In, false, false>(be, a, amax_pass, quantize_pass);
}

// Arguments of both passes (validated input), with the amax workspace zeroed; `vec` says whether
// every pointer allows 16-byte accesses.
Nvfp4Args make_args(CudaBackend& be, const GroupedMatrices& in, const Nvfp4Config& cfg,
                    const Nvfp4Outputs& out, bool& vec) {
  const int64_t K = in.cols;
  const int64_t G = in.groups();
  const int64_t tile_cols = in.dtype == DType::kBF16 ? Geo<uint16_t>::kCols : Geo<float>::kCols;
  Nvfp4Args a{};
  a.cols = K;
  a.col_tiles = static_cast<uint32_t>((K + tile_cols - 1) / tile_cols);
  a.col_tiles_div = cuda::FastDiv(a.col_tiles);
  a.rowwise = cfg.rowwise;
  a.columnwise = cfg.columnwise;
  a.two_d = cfg.two_d;
  a.rht = cfg.rht && cfg.columnwise;
  a.sr = cfg.stochastic_rounding;
  a.sr_keys = philox_seed_keys(cfg.seed);
  a.row_bf16 = !out.row_bf16.empty();
  a.offset = cfg.offset;
  a.row_amax = static_cast<float*>(out.row_amax);
  a.col_amax = static_cast<float*>(out.col_amax);

  vec = true;
  bool col16 = true;
  std::vector<Nvfp4Group> groups(G);
  uint64_t tiles = 0, base = 0;
  for (int64_t g = 0; g < G; ++g) {
    Nvfp4Group& d = groups[g];
    d.in = in.data[g];
    d.row_data = out.row_data.empty() ? nullptr : static_cast<uint8_t*>(out.row_data[g]);
    d.row_scale = out.row_scale.empty() ? nullptr : static_cast<uint8_t*>(out.row_scale[g]);
    d.col_data = cfg.columnwise ? static_cast<uint8_t*>(out.col_data[g]) : nullptr;
    d.col_scale = cfg.columnwise ? static_cast<uint8_t*>(out.col_scale[g]) : nullptr;
    d.row_bf16 = out.row_bf16.empty() ? nullptr : static_cast<uint8_t*>(out.row_bf16[g]);
    d.rows = in.rows[g];
    d.block_base = base;
    d.tile_begin = static_cast<uint32_t>(tiles);
    base += static_cast<uint64_t>(d.rows * (K / kNvfp4Block));
    if (d.rows == 0) continue;
    vec = vec && cuda::aligned16(d.in) && cuda::aligned16(d.row_data) &&
          cuda::aligned16(d.col_data) && cuda::aligned16(d.row_bf16);
    col16 = col16 && d.rows % 32 == 0;
    tiles += static_cast<uint64_t>((d.rows + Config::kTileRows - 1) / Config::kTileRows) *
             a.col_tiles;
  }
  a.col16 = col16;
  a.groups = cuda::make_group_table<Nvfp4Group, Config::kInlineGroups>(be, groups, tiles);
  // Workspace: the scales (G,), then amax_ws (2G,) and the amax pass's counter, zeroed.
  uint8_t* ws = static_cast<uint8_t*>(
      be.workspace(G * sizeof(GroupScales) + 2 * G * sizeof(float) + sizeof(uint32_t)));
  a.scales = reinterpret_cast<GroupScales*>(ws);
  a.amax_ws = reinterpret_cast<float*>(ws + G * sizeof(GroupScales));
  a.amax_done = reinterpret_cast<uint32_t*>(a.amax_ws + 2 * G);
  be.fill_zero(a.amax_ws, 2 * G * sizeof(float) + sizeof(uint32_t));
  a.given_amax = static_cast<const float*>(cfg.amax);
  return a;
}

void run(CudaBackend& be, const GroupedMatrices& in, const Nvfp4Args& a, bool vec, bool amax_pass,
         bool quantize_pass) {
  const bool hw = cuda_nvfp4_fast_codecs_ok(be);
  if (in.dtype == DType::kBF16)
    dispatch<uint16_t>(be, a, vec, hw, amax_pass, quantize_pass);
  else
    dispatch<float>(be, a, vec, hw, amax_pass, quantize_pass);
}

}  // namespace

Status quantize_nvfp4_sm90(CudaBackend& be, const GroupedMatrices& in, const Nvfp4Config& cfg,
                           const Nvfp4Outputs& out) {
  bool vec = true;
  const Nvfp4Args a = make_args(be, in, cfg, out, vec);
  // A given amax (no RHT: validated) replaces the amax pass (nvfp4_given_amax_kernel).
  run(be, in, a, vec, /*amax_pass=*/cfg.amax == nullptr, /*quantize_pass=*/true);
  return Status::ok();
}

Status nvfp4_amax_sm90(CudaBackend& be, const GroupedMatrices& in, float* amax) {
  Nvfp4Config cfg;  // no copy requested: the group table carries only the inputs
  cfg.rowwise = false;
  bool vec = true;
  const Nvfp4Args a = make_args(be, in, cfg, Nvfp4Outputs{}, vec);
  run(be, in, a, vec, /*amax_pass=*/true, /*quantize_pass=*/false);
  be.copy(amax, a.amax_ws, in.groups() * sizeof(float), Backend::CopyKind::kDeviceToDevice);
  return Status::ok();
}

}  // namespace packmoe
