// NVFP4 grouped quantize (1x16 rowwise, transposed 16x1 columnwise with optional RHT and
// stochastic rounding, or 2D 16x16) of every group. The per-group amax must be known before any
// block is scaled, so this is TWO launches over the whole pack (never per group): an amax pass
// (input amax, and the post-RHT amax when the columnwise copy uses the RHT) with one atomicMax per
// CTA into a zeroed workspace, then the quantize pass. Invariant: every byte comes from
// formats/nvfp4_math.h with the SR numbering of formats/nvfp4.h, so it equals quantize_nvfp4_cpu.
#include <cuda_runtime.h>

#include <vector>

#include "backend/cuda/kernels_common.cuh"
#include "core/philox.h"
#include "formats/mxfp8_math.h"  // amax_update
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

using cuda::GroupTable;

struct Config {
  static constexpr int kTileRows = 64;  // 4 column blocks of 16 tokens: 32 contiguous bytes
  static constexpr int kTileCols = 64;  // 4 row blocks of 16: 32 contiguous bytes per row
  static constexpr int kThreads = 256;
  static constexpr int kPitch = kTileCols + 4;  // floats; keeps 16-byte row alignment
  static constexpr int kBlocksPerRow = kTileCols / kNvfp4Block;  // 4
  static constexpr int kBlocksPerCol = kTileRows / kNvfp4Block;  // 4
  static constexpr int kInlineGroups = 4;
  // One 1x16 row block and one 16x1 column block per thread.
  static_assert(kTileRows * kBlocksPerRow == kThreads, "one row block per thread");
  static_assert(kTileCols * kBlocksPerCol == kThreads, "one column block per thread");
  static_assert(kTileCols % 32 == 0, "a warp reads 32 consecutive columns in the column pass");
  static_assert(kPitch % 4 == 0, "float4 accesses to the tile");
};

constexpr uint32_t kRowStream = 0;  // formats/nvfp4.h: SR stream of the rowwise copy
constexpr uint32_t kColStream = 1;  // ... and of the columnwise copy

struct Nvfp4Group {
  const void* in;      // (rows, K) In
  uint8_t* row_data;   // (rows, K/2)
  uint8_t* row_scale;  // (rows, K/16) E4M3
  uint8_t* col_data;   // (K, rows/2)
  uint8_t* col_scale;  // (K, rows/16) E4M3
  int64_t rows;
  uint64_t block_base;  // sum_{u<g} rows_u * K/16: SR number of the group's first block
  uint32_t tile_begin;
};

struct Nvfp4Args {
  GroupTable<Nvfp4Group, Config::kInlineGroups> groups;
  int64_t cols;  // K
  uint32_t col_tiles;
  bool rowwise;
  bool columnwise;
  bool two_d;
  bool rht;
  bool sr;
  uint64_t seed;
  uint64_t offset;
  float* amax_ws;   // (2G,): input amax [0, G), post-RHT amax [G, 2G); zeroed before pass 1
  float* row_amax;  // (G,) output or null
  float* col_amax;  // (G,) output or null
};

struct TilePos {
  int g;
  const Nvfp4Group* grp;
  int64_t row0;  // first row of the tile in its group
  int64_t col0;  // first column
};

__device__ __forceinline__ TilePos locate(const Nvfp4Args& a) {
  TilePos p;
  p.g = a.groups.find(blockIdx.x);
  p.grp = &a.groups[p.g];
  const uint32_t local = blockIdx.x - p.grp->tile_begin;
  p.row0 = static_cast<int64_t>(local / a.col_tiles) * Config::kTileRows;
  p.col0 = static_cast<int64_t>(local % a.col_tiles) * Config::kTileCols;
  return p;
}

using Tile = float[Config::kTileRows][Config::kPitch];

// Loads the tile as FP32 (zeros outside the matrix) into `tile` when given, and returns this
// thread's NaN-ignoring amax of what it loaded. Chunks of 16 bytes go to consecutive threads
// along a row, so the loads coalesce. K % 16 == 0, so a chunk is all in or all out.
template <typename In, bool kVec>
__device__ __forceinline__ float load_tile(const Nvfp4Args& a, const TilePos& p, Tile* tile) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(In));
  constexpr int kChunksPerRow = Config::kTileCols / kPerChunk;
  constexpr int kPerThread = Config::kTileRows * kChunksPerRow / Config::kThreads;
  static_assert(kPerThread * Config::kThreads == Config::kTileRows * kChunksPerRow, "even split");
  const In* in = static_cast<const In*>(p.grp->in);
  const int64_t K = a.cols;
  float amax = 0.0f;
  uint4 v[kPerThread];
#pragma unroll
  for (int m = 0; m < kPerThread; ++m) {  // all loads first
    const int q = threadIdx.x + m * Config::kThreads;
    const int64_t r = p.row0 + q / kChunksPerRow;
    const int64_t c = p.col0 + (q % kChunksPerRow) * kPerChunk;
    const bool ok = r < p.grp->rows && c < K;
    if constexpr (kVec) {
      v[m] = ok ? cuda::load_stream16(in + r * K + c) : make_uint4(0, 0, 0, 0);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < kPerChunk; ++e) {
        if (!ok) break;
        const uint32_t bits = __float_as_uint(cuda::load_elem<In>(in + r * K + c + e));
        if constexpr (sizeof(In) == 4)
          w[e] = bits;
        else
          w[e / 2] |= (bits >> 16) << (16 * (e % 2));
      }
      v[m] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
#pragma unroll
  for (int m = 0; m < kPerThread; ++m) {
    const int q = threadIdx.x + m * Config::kThreads;
    float x[kPerChunk];
#pragma unroll
    for (int e = 0; e < kPerChunk; ++e) {
      x[e] = cuda::chunk_elem<In>(v[m], e);
      amax = amax_update(amax, x[e]);
    }
    if (tile) {
      float* dst = &(*tile)[q / kChunksPerRow][(q % kChunksPerRow) * kPerChunk];
#pragma unroll
      for (int e = 0; e < kPerChunk; e += 4)
        *reinterpret_cast<float4*>(dst + e) = make_float4(x[e], x[e + 1], x[e + 2], x[e + 3]);
    }
  }
  return amax;
}

// The thread's column block: column c (0..63) of the tile, rows 16*rb .. 16*rb+15. A warp reads
// 32 consecutive columns of one row: no bank conflicts.
__device__ __forceinline__ int col_of_thread() { return threadIdx.x % Config::kTileCols; }
__device__ __forceinline__ int colblock_of_thread() { return threadIdx.x / Config::kTileCols; }

// The 16 values of the thread's column block (after the RHT when on).
__device__ __forceinline__ void column_values(const Tile& tile, bool rht, float v[kNvfp4Block]) {
  const int c = col_of_thread();
  const int rb = colblock_of_thread();
  float x[kNvfp4Block];
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) x[i] = tile[rb * kNvfp4Block + i][c];
  if (rht) {
    rht16(x, v);
  } else {
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) v[i] = x[i];
  }
}

// Max over the CTA of non-negative, non-NaN values; result valid in every thread.
__device__ __forceinline__ float block_max(float v, float* scratch /* kThreads/32 */) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = amax_update(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  __syncthreads();  // scratch may still be read by a previous call
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < Config::kThreads / 32; ++w) r = amax_update(r, scratch[w]);
  return r;
}

// Pass 1: per-group amax of the input (and of the RHT outputs) by one atomicMax per CTA. The
// values are non-negative and never NaN, so their IEEE order is their unsigned bit order.
template <typename In, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_amax_kernel(const __grid_constant__ Nvfp4Args a) {
  __shared__ __align__(16) Tile tile;
  __shared__ float scratch[Config::kThreads / 32];
  const TilePos p = locate(a);
  const bool rht_amax = a.columnwise && a.rht;
  const float amax = block_max(load_tile<In, kVec>(a, p, rht_amax ? &tile : nullptr), scratch);
  if (threadIdx.x == 0 && amax > 0.0f)
    atomicMax(reinterpret_cast<unsigned*>(a.amax_ws) + p.g, __float_as_uint(amax));
  if (!rht_amax) return;
  // tile was written before block_max's barriers, so it is visible here.
  float col = 0.0f;
  const int64_t c = p.col0 + col_of_thread();
  const int64_t r = p.row0 + colblock_of_thread() * kNvfp4Block;
  if (c < a.cols && r < p.grp->rows) {
    float v[kNvfp4Block];
    column_values(tile, true, v);
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) col = amax_update(col, v[i]);
  }
  col = block_max(col, scratch);
  if (threadIdx.x == 0 && col > 0.0f)
    atomicMax(reinterpret_cast<unsigned*>(a.amax_ws) + a.groups.count + p.g, __float_as_uint(col));
}

// 16 codes of v[j] * r (deterministic or SR from one Philox draw) packed into 8 bytes.
__device__ __forceinline__ uint2 encode16(const float v[kNvfp4Block], float r, bool sr,
                                          const Philox4& draw) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < kNvfp4Block; ++j) {
    const uint8_t code =
        sr ? nvfp4_encode_sr(v[j], r, nvfp4_sr_byte(draw, j)) : nvfp4_encode(v[j], r);
    w[j / 8] |= static_cast<uint32_t>(code & 0xF) << (4 * (j % 8));
  }
  return make_uint2(w[0], w[1]);
}

template <bool kVec>
__device__ __forceinline__ void store8(uint8_t* dst, uint2 v) {
  if constexpr (kVec) {
    __stcs(reinterpret_cast<uint2*>(dst), v);
  } else {
#pragma unroll
    for (int b = 0; b < 8; ++b) dst[b] = static_cast<uint8_t>((b < 4 ? v.x : v.y) >> (8 * (b % 4)));
  }
}

// Pass 2: scales and codes. Thread t owns row block (t/4, t%4) and column block (t%64, t/64).
template <typename In, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_quantize_kernel(const __grid_constant__ Nvfp4Args a) {
  __shared__ __align__(16) Tile tile;
  __shared__ float blk_amax[Config::kTileRows][Config::kBlocksPerRow];   // 2D: 1x16 amaxes
  __shared__ uint2 col_codes[Config::kTileCols][Config::kBlocksPerCol];  // staged column output
  __shared__ uint8_t col_scales[Config::kTileCols][Config::kBlocksPerCol];

  // One CTA publishes the amax outputs of every group (0 for empty groups, which own no tile).
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < a.groups.count; g += Config::kThreads) {
      const float in_amax = a.amax_ws[g];
      if (a.row_amax) a.row_amax[g] = in_amax;
      if (a.col_amax) a.col_amax[g] = a.rht ? a.amax_ws[a.groups.count + g] : in_amax;
    }
  }

  const TilePos p = locate(a);
  const Nvfp4Group& grp = *p.grp;
  const int64_t K = a.cols;
  const int64_t rows = grp.rows;
  const float row_amax = a.amax_ws[p.g];
  const float col_amax = a.rht ? a.amax_ws[a.groups.count + p.g] : row_amax;
  load_tile<In, kVec>(a, p, &tile);
  __syncthreads();

  // ---- row block of this thread ----
  const int rr = threadIdx.x / Config::kBlocksPerRow;  // row in tile
  const int rk = threadIdx.x % Config::kBlocksPerRow;  // block in row
  const bool row_ok = p.row0 + rr < rows && p.col0 + rk * kNvfp4Block < K;
  float rv[kNvfp4Block];
  {
    const float* src = &tile[rr][rk * kNvfp4Block];
#pragma unroll
    for (int j = 0; j < kNvfp4Block; j += 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + j);
      rv[j] = f.x;
      rv[j + 1] = f.y;
      rv[j + 2] = f.z;
      rv[j + 3] = f.w;
    }
  }
  float rblock_amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kNvfp4Block; ++j) rblock_amax = amax_update(rblock_amax, rv[j]);

  // ---- column block of this thread ----
  const int cc = col_of_thread();
  const int cb = colblock_of_thread();
  const bool col_ok = p.col0 + cc < K && p.row0 + cb * kNvfp4Block < rows;

  if (a.two_d) {
    // One scale per 16x16 tile from the max of its 16 row-block amaxes; both copies use it.
    blk_amax[rr][rk] = rblock_amax;
    __syncthreads();
    const float s_enc = nvfp4_encode_scale(row_amax);
    const float s_dec = nvfp4_decode_scale(row_amax);
    if (a.rowwise && row_ok) {
      const int t0 = rr / kNvfp4Block * kNvfp4Block;
      float tamax = 0.0f;
#pragma unroll
      for (int i = 0; i < kNvfp4Block; ++i) tamax = amax_update(tamax, blk_amax[t0 + i][rk]);
      const uint8_t s_b = nvfp4_block_scale(tamax, s_enc);
      const float r = nvfp4_block_rcp(s_b, s_dec);
      const int64_t row = p.row0 + rr;
      const int64_t kb = p.col0 / kNvfp4Block + rk;
      store8<kVec>(grp.row_data + row * (K / 2) + kb * (kNvfp4Block / 2),
                   encode16(rv, r, false, Philox4{}));
      grp.row_scale[row * (K / kNvfp4Block) + kb] = s_b;
    }
    if (a.columnwise) {
      uint2 codes = make_uint2(0, 0);
      uint8_t s_b = 0;
      if (col_ok) {
        const int k16 = cc / kNvfp4Block;
        float tamax = 0.0f;
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i)
          tamax = amax_update(tamax, blk_amax[cb * kNvfp4Block + i][k16]);
        s_b = nvfp4_block_scale(tamax, s_enc);
        const float r = nvfp4_block_rcp(s_b, s_dec);
        float v[kNvfp4Block];
        column_values(tile, false, v);
        codes = encode16(v, r, false, Philox4{});
      }
      col_codes[cc][cb] = codes;
      col_scales[cc][cb] = s_b;
    }
  } else {
    if (a.rowwise && row_ok) {
      const float s_enc = nvfp4_encode_scale(row_amax);
      const float s_dec = nvfp4_decode_scale(row_amax);
      const uint8_t s_b = nvfp4_block_scale(rblock_amax, s_enc);
      const float r = nvfp4_block_rcp(s_b, s_dec);
      const int64_t row = p.row0 + rr;
      const int64_t kb = p.col0 / kNvfp4Block + rk;
      Philox4 draw{};
      if (a.sr)
        draw = philox_draw(
            a.seed, a.offset + grp.block_base + static_cast<uint64_t>(row * (K / kNvfp4Block) + kb),
            kRowStream);
      store8<kVec>(grp.row_data + row * (K / 2) + kb * (kNvfp4Block / 2),
                   encode16(rv, r, a.sr, draw));
      grp.row_scale[row * (K / kNvfp4Block) + kb] = s_b;
    }
    if (a.columnwise) {
      uint2 codes = make_uint2(0, 0);
      uint8_t s_b = 0;
      if (col_ok) {
        float v[kNvfp4Block];
        column_values(tile, a.rht, v);
        float bamax = 0.0f;
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i) bamax = amax_update(bamax, v[i]);
        const float s_enc = nvfp4_encode_scale(col_amax);
        const float s_dec = nvfp4_decode_scale(col_amax);
        s_b = nvfp4_block_scale(bamax, s_enc);
        const float r = nvfp4_block_rcp(s_b, s_dec);
        Philox4 draw{};
        if (a.sr) {
          const int64_t c = p.col0 + cc;
          const int64_t rb = p.row0 / kNvfp4Block + cb;
          draw = philox_draw(
              a.seed,
              a.offset + grp.block_base + static_cast<uint64_t>(c * (rows / kNvfp4Block) + rb),
              kColStream);
        }
        codes = encode16(v, r, a.sr, draw);
      }
      col_codes[cc][cb] = codes;
      col_scales[cc][cb] = s_b;
    }
  }
  if (!a.columnwise) return;
  __syncthreads();
  // Store the transposed copy with 4 consecutive threads per column: each column's 32 bytes (one
  // sector) leave in one instruction instead of as four scattered 8-byte pieces.
  const int sc = threadIdx.x / Config::kBlocksPerCol;
  const int sb = threadIdx.x % Config::kBlocksPerCol;
  const int64_t c = p.col0 + sc;
  const int64_t rb = p.row0 / kNvfp4Block + sb;
  if (c < K && rb * kNvfp4Block < rows) {
    store8<kVec>(grp.col_data + c * (rows / 2) + rb * (kNvfp4Block / 2), col_codes[sc][sb]);
    grp.col_scale[c * (rows / kNvfp4Block) + rb] = col_scales[sc][sb];
  }
}

template <typename In, bool kVec>
void launch(CudaBackend& be, const Nvfp4Args& a) {
  const unsigned grid = a.groups.total_tiles;
  nvfp4_amax_kernel<In, kVec><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  nvfp4_quantize_kernel<In, kVec><<<grid, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Status quantize_nvfp4_sm90(CudaBackend& be, const GroupedMatrices& in, const Nvfp4Config& cfg,
                           const Nvfp4Outputs& out) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4(in, cfg, out));
  const int64_t K = in.cols;
  const int64_t G = in.groups();
  Nvfp4Args a{};
  a.cols = K;
  a.col_tiles = static_cast<uint32_t>((K + Config::kTileCols - 1) / Config::kTileCols);
  a.rowwise = cfg.rowwise;
  a.columnwise = cfg.columnwise;
  a.two_d = cfg.two_d;
  a.rht = cfg.rht && cfg.columnwise;
  a.sr = cfg.stochastic_rounding;
  a.seed = cfg.seed;
  a.offset = cfg.offset;
  a.row_amax = static_cast<float*>(out.row_amax);
  a.col_amax = static_cast<float*>(out.col_amax);

  bool vec = true;
  std::vector<Nvfp4Group> groups(G);
  uint64_t tiles = 0, base = 0;
  for (int64_t g = 0; g < G; ++g) {
    Nvfp4Group& d = groups[g];
    d.in = in.data[g];
    d.row_data = cfg.rowwise ? static_cast<uint8_t*>(out.row_data[g]) : nullptr;
    d.row_scale = cfg.rowwise ? static_cast<uint8_t*>(out.row_scale[g]) : nullptr;
    d.col_data = cfg.columnwise ? static_cast<uint8_t*>(out.col_data[g]) : nullptr;
    d.col_scale = cfg.columnwise ? static_cast<uint8_t*>(out.col_scale[g]) : nullptr;
    d.rows = in.rows[g];
    d.block_base = base;
    d.tile_begin = static_cast<uint32_t>(tiles);
    base += static_cast<uint64_t>(d.rows * (K / kNvfp4Block));
    if (d.rows == 0) continue;
    vec =
        vec && cuda::aligned16(d.in) && cuda::aligned16(d.row_data) && cuda::aligned16(d.col_data);
    tiles +=
        static_cast<uint64_t>((d.rows + Config::kTileRows - 1) / Config::kTileRows) * a.col_tiles;
  }
  a.groups = cuda::make_group_table<Nvfp4Group, Config::kInlineGroups>(be, groups, tiles);
  a.amax_ws = static_cast<float*>(be.workspace(2 * G * sizeof(float)));
  be.fill_zero(a.amax_ws, 2 * G * sizeof(float));
  if (in.dtype == DType::kBF16)
    vec ? launch<uint16_t, true>(be, a) : launch<uint16_t, false>(be, a);
  else
    vec ? launch<float, true>(be, a) : launch<float, false>(be, a);
  return Status::ok();
}

}  // namespace packmoe
