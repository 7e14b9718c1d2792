// The columnwise copy of a 2D-scaled weight is a function of its rowwise copy: MXFP8 32x32 tiles
// give identical element bytes in both copies and one scale per tile; NVFP4 16x16 tiles give an
// exact transpose of the E2M1 codes and of the tile scales. So a data-parallel gather moves only
// the rowwise copy and every rank derives the columnwise one, byte for byte what the quantizer
// writes (formats/mxfp8.cpp, formats/nvfp4.cpp). CPU reference; the CUDA kernel writes the same.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace packmoe {

enum class Tiled2dFormat : uint8_t { kMxfp8, kNvfp4 };

// G groups of one (N, K) weight each, N and K multiples of the tile (32 MXFP8, 16 NVFP4).
struct Weight2dCopies {
  Tiled2dFormat format = Tiled2dFormat::kMxfp8;
  int64_t rows = 0;                    // N
  int64_t cols = 0;                    // K
  std::vector<const void*> row_data;   // MXFP8 (N, K) bytes        NVFP4 (N, K/2) bytes
  std::vector<const void*> row_scale;  // MXFP8 (N, K/32) E8M0      NVFP4 (N, K/16) E4M3
  std::vector<void*> col_data;         // MXFP8 (N, K)              NVFP4 (K, N/2), transposed
  std::vector<void*> col_scale;        // MXFP8 (N/32, K)           NVFP4 (K, N/16)
};

// Shapes and pointers; touches no memory.
Status validate_weight_2d_columnwise(const Weight2dCopies& w);
// col_data, col_scale from row_data, row_scale (host pointers).
Status weight_2d_columnwise_cpu(const Weight2dCopies& w);

}  // namespace packmoe
