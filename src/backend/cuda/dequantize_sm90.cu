// MXFP8 and NVFP4 grouped dequantize: one launch per copy over all groups, each thread turning
// 16 consecutive elements of one row into F32 or BF16. Invariant: every value is mxfp8_decode /
// nvfp4_decode (then f32_to_bf16), the functions dequantize_*_cpu call, so the bytes are equal.
#include <cuda_runtime.h>

#include <vector>

#include "backend/cuda/kernels_common.cuh"
#include "formats/mxfp8_math.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

using cuda::GroupTable;

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kPerThread = 16;  // elements: 16 FP8 bytes or 8 NVFP4 bytes in
  static constexpr int kPerTile = kThreads * kPerThread;
  static constexpr int kInlineGroups = 4;
  static_assert(kPerThread == 16, "one NVFP4 block / half an MXFP8 block per thread");
  static_assert(kMxfp8Block % kPerThread == 0 && kPerThread == kNvfp4Block, "chunks inside blocks");
};

struct DequantGroup {
  const uint8_t* data;
  const uint8_t* scale;
  void* out;  // (rows, cols) F32 or BF16
  int64_t rows;
  uint32_t tile_begin;
};

struct DequantArgs {
  GroupTable<DequantGroup, Config::kInlineGroups> groups;
  int64_t cols;
  bool columnwise;     // MXFP8: scale layout (rows/32, K) instead of (rows, K/32)
  const float* s_dec;  // NVFP4: (G,) per-group decode scales, device memory
};

// Writes 16 FP32 values as F32 or BF16; vector stores when aligned, else one element at a time.
template <bool kBf16, bool kVec>
__device__ __forceinline__ void store16(void* out, int64_t idx, const float v[16], int valid) {
  if constexpr (kBf16) {
    uint16_t* o = static_cast<uint16_t*>(out) + idx;
    if constexpr (kVec) {
      uint32_t w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        w[j] = static_cast<uint32_t>(f32_to_bf16(v[2 * j])) |
               (static_cast<uint32_t>(f32_to_bf16(v[2 * j + 1])) << 16);
      uint4* o4 = reinterpret_cast<uint4*>(o);
      __stcs(o4, make_uint4(w[0], w[1], w[2], w[3]));
      __stcs(o4 + 1, make_uint4(w[4], w[5], w[6], w[7]));
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < valid) o[j] = f32_to_bf16(v[j]);
    }
  } else {
    float* o = static_cast<float*>(out) + idx;
    if constexpr (kVec) {
      float4* o4 = reinterpret_cast<float4*>(o);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        __stcs(o4 + j, make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]));
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j < valid) o[j] = v[j];
    }
  }
}

// Thread t of a tile handles flat elements [16 i, 16 i + 16) of its group (i = tile-local chunk).
// kVec: cols % 16 == 0 and aligned pointers, so a chunk is 16 elements of one row.
template <DType kEl, bool kBf16, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    mxfp8_dequantize_kernel(const __grid_constant__ DequantArgs a) {
  const int g = a.groups.find(blockIdx.x);
  const DequantGroup& grp = a.groups[g];
  const int64_t K = a.cols;
  const int64_t n = grp.rows * K;
  const int64_t first =
      (static_cast<int64_t>(blockIdx.x - grp.tile_begin) * Config::kThreads + threadIdx.x) *
      Config::kPerThread;
  if (first >= n) return;
  float v[16];
  if constexpr (kVec) {
    const int64_t r = first / K;
    const int64_t c = first % K;
    const uint4 d = cuda::load_stream16(grp.data + first);
    const uint32_t dw[4] = {d.x, d.y, d.z, d.w};
    uint8_t codes[16];
    if (a.columnwise) {
      const uint4 s = *reinterpret_cast<const uint4*>(grp.scale + (r / kMxfp8Block) * K + c);
      const uint32_t sw[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) codes[j] = static_cast<uint8_t>(sw[j / 4] >> (8 * (j % 4)));
    } else {
      const uint8_t code = grp.scale[r * (K / kMxfp8Block) + c / kMxfp8Block];
#pragma unroll
      for (int j = 0; j < 16; ++j) codes[j] = code;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
      v[j] = mxfp8_decode(static_cast<uint8_t>(dw[j / 4] >> (8 * (j % 4))), codes[j], kEl);
    store16<kBf16, true>(grp.out, first, v, 16);
  } else {
    const int valid = n - first >= 16 ? 16 : static_cast<int>(n - first);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      v[j] = 0.0f;
      if (j < valid) {
        const int64_t e = first + j;
        const int64_t r = e / K;
        const int64_t c = e % K;
        const uint8_t code = a.columnwise ? grp.scale[(r / kMxfp8Block) * K + c]
                                          : grp.scale[r * (K / kMxfp8Block) + c / kMxfp8Block];
        v[j] = mxfp8_decode(grp.data[e], code, kEl);
      }
    }
    store16<kBf16, false>(grp.out, first, v, valid);
  }
}

// One NVFP4 block (8 bytes, one scale) per thread; cols % 16 == 0 always.
template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(Config::kThreads)
    nvfp4_dequantize_kernel(const __grid_constant__ DequantArgs a) {
  const int g = a.groups.find(blockIdx.x);
  const DequantGroup& grp = a.groups[g];
  const int64_t cols = a.cols;
  const int64_t n = grp.rows * cols;
  const int64_t first =
      (static_cast<int64_t>(blockIdx.x - grp.tile_begin) * Config::kThreads + threadIdx.x) *
      Config::kPerThread;
  if (first >= n) return;
  const int64_t r = first / cols;
  const int64_t c = first % cols;
  uint32_t w[2];
  if constexpr (kVec) {
    const uint2 d = __ldg(reinterpret_cast<const uint2*>(grp.data + first / 2));
    w[0] = d.x;
    w[1] = d.y;
  } else {
    w[0] = w[1] = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b)
      w[b / 4] |= static_cast<uint32_t>(grp.data[first / 2 + b]) << (8 * (b % 4));
  }
  const uint8_t s_b = grp.scale[r * (cols / kNvfp4Block) + c / kNvfp4Block];
  const float s_dec = a.s_dec[g];
  float v[16];
#pragma unroll
  for (int j = 0; j < 16; ++j)
    v[j] = nvfp4_decode(static_cast<uint8_t>((w[j / 8] >> (4 * (j % 8))) & 0xF), s_b, s_dec);
  store16<kBf16, kVec>(grp.out, first, v, 16);
}

// Builds the table; returns the tile count.
template <typename Copy>
uint64_t fill_groups(const Copy& q, const std::vector<void*>& out,
                     std::vector<DequantGroup>& groups, bool& vec) {
  uint64_t tiles = 0;
  groups.resize(q.rows.size());
  for (size_t g = 0; g < q.rows.size(); ++g) {
    DequantGroup& d = groups[g];
    d.data = static_cast<const uint8_t*>(q.data[g]);
    d.scale = static_cast<const uint8_t*>(q.scale[g]);
    d.out = out[g];
    d.rows = q.rows[g];
    d.tile_begin = static_cast<uint32_t>(tiles);
    if (d.rows == 0) continue;
    vec = vec && cuda::aligned16(d.data) && cuda::aligned16(d.scale) && cuda::aligned16(d.out);
    const uint64_t n = static_cast<uint64_t>(d.rows * q.cols);
    tiles += (n + Config::kPerTile - 1) / Config::kPerTile;
  }
  return tiles;
}

template <DType kEl, bool kBf16>
void launch_mxfp8(CudaBackend& be, const DequantArgs& a, bool vec) {
  if (vec)
    mxfp8_dequantize_kernel<kEl, kBf16, true>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a);
  else
    mxfp8_dequantize_kernel<kEl, kBf16, false>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Status dequantize_mxfp8_sm90(CudaBackend& be, const Mxfp8Copy& q, DType out_dtype,
                             const std::vector<void*>& out) {
  DequantArgs a{};
  a.cols = q.cols;
  a.columnwise = q.columnwise;
  bool vec = q.cols % 16 == 0;
  std::vector<DequantGroup> groups;
  const uint64_t tiles = fill_groups(q, out, groups, vec);
  a.groups = cuda::make_group_table<DequantGroup, Config::kInlineGroups>(be, groups, tiles);
  const bool bf16 = out_dtype == DType::kBF16;
  if (q.element == DType::kE5M2)
    bf16 ? launch_mxfp8<DType::kE5M2, true>(be, a, vec)
         : launch_mxfp8<DType::kE5M2, false>(be, a, vec);
  else
    bf16 ? launch_mxfp8<DType::kE4M3, true>(be, a, vec)
         : launch_mxfp8<DType::kE4M3, false>(be, a, vec);
  return Status::ok();
}

Status dequantize_nvfp4_sm90(CudaBackend& be, const Nvfp4Copy& q, DType out_dtype,
                             const std::vector<void*>& out) {
  DequantArgs a{};
  a.cols = q.cols;
  a.columnwise = false;
  a.s_dec = static_cast<const float*>(q.decode_scale);
  bool vec = true;
  std::vector<DequantGroup> groups;
  const uint64_t tiles = fill_groups(q, out, groups, vec);
  a.groups = cuda::make_group_table<DequantGroup, Config::kInlineGroups>(be, groups, tiles);
  const bool bf16 = out_dtype == DType::kBF16;
  if (bf16)
    vec ? nvfp4_dequantize_kernel<true, true>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a)
        : nvfp4_dequantize_kernel<true, false>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a);
  else
    vec ? nvfp4_dequantize_kernel<false, true>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a)
        : nvfp4_dequantize_kernel<false, false>
        <<<a.groups.total_tiles, Config::kThreads, 0, be.stream()>>>(a);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
