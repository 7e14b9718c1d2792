// GEMM-ready scale swizzle (formats/swizzle.h, docs/formats.md): compact (rows, cols) scales, or
// their transpose, into padded 128x4 tiles. One thread writes one 4-byte word of the output, so
// the whole padded buffer (zeros in the padding) is written and compares bytewise with the CPU.
// Invariant: output positions come from swizzled_scale_index, the function the CPU uses.
#include <cuda_runtime.h>

#include "backend/cuda/kernels_common.cuh"
#include "formats/swizzle.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kTileBytes = 512;  // one 128x4 tile
  static_assert(kTileBytes % 4 == 0, "whole words");
};

// Output word w holds S[i][j0 .. j0+3] of the swizzled matrix S (s_rows, s_cols), where S is the
// compact matrix or its transpose. Inverting swizzled_scale_index for the word's first byte:
// tile = w / 128, (i % 32) = (w % 128) / 4, (i % 128) / 32 = w % 4.
__global__ void __launch_bounds__(Config::kThreads)
    swizzle_scales_kernel(const uint8_t* compact, int64_t rows, int64_t cols, bool transpose,
                          int64_t s_rows, int64_t s_cols, uint8_t* swizzled, int64_t words,
                          bool aligned) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * Config::kThreads + threadIdx.x;
  if (w >= words) return;
  const int64_t tiles_x = (s_cols + 3) / 4;
  const int64_t tile = w / (Config::kTileBytes / 4);
  const int64_t in_tile = w % (Config::kTileBytes / 4);
  const int64_t i = (tile / tiles_x) * 128 + (in_tile % 4) * 32 + in_tile / 4;
  const int64_t j0 = (tile % tiles_x) * 4;
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int64_t j = j0 + b;
    if (i < s_rows && j < s_cols) {
      const uint8_t v = transpose ? compact[j * cols + i] : compact[i * cols + j];
      word |= static_cast<uint32_t>(v) << (8 * b);
    }
  }
  // at == 4 * w: the inverse above is exact, and padding rows/columns get their zeros here too.
  const int64_t at = swizzled_scale_index(i, j0, s_cols);
  if (aligned) {
    *reinterpret_cast<uint32_t*>(swizzled + at) = word;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) swizzled[at + b] = static_cast<uint8_t>(word >> (8 * b));
  }
}

}  // namespace

Status swizzle_scales_sm90(CudaBackend& be, const void* compact, int64_t rows, int64_t cols,
                           bool transpose, void* swizzled) {
  if (rows <= 0 || cols <= 0) return Status::error("swizzle_scales: empty scale matrix");
  const int64_t s_rows = transpose ? cols : rows;
  const int64_t s_cols = transpose ? rows : cols;
  const int64_t words = swizzled_scale_bytes(s_rows, s_cols) / 4;
  const bool aligned = (reinterpret_cast<uintptr_t>(swizzled) & 3u) == 0;
  swizzle_scales_kernel<<<cuda::blocks_for(words, Config::kThreads), Config::kThreads, 0,
                          be.stream()>>>(static_cast<const uint8_t*>(compact), rows, cols,
                                         transpose, s_rows, s_cols, static_cast<uint8_t*>(swizzled),
                                         words, aligned);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
