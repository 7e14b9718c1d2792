// GEMM-ready ("swizzled") scale layout of docs/formats.md, shared by MXFP8 and NVFP4: the compact
// scale matrix S[rows][cols] is padded to (roundup(rows,128), roundup(cols,4)) with zeros and
// stored as 128x4 tiles, tile-major, inner order (i%32)*16 + ((i%128)/32)*4 + (j%4).
// Swizzled scales are derived from compact ones and never communicated.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.h"

namespace packmoe {

PACKMOE_HD int64_t swizzled_scale_bytes(int64_t rows, int64_t cols) {
  return ((rows + 127) / 128 * 128) * ((cols + 3) / 4 * 4);
}

// Byte offset of compact S[i][j] in the swizzled buffer.
PACKMOE_HD int64_t swizzled_scale_index(int64_t i, int64_t j, int64_t cols) {
  int64_t tiles_x = (cols + 3) / 4;
  int64_t tile = (i / 128) * tiles_x + (j / 4);
  return tile * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4);
}

// CPU reference: compact (rows, cols) -> swizzled; `transpose` swizzles S^T instead (MXFP8
// columnwise scales (rows/32, K) become the (K, rows/32) matrix the GEMM reads).
void swizzle_scales_cpu(const uint8_t* compact, int64_t rows, int64_t cols, bool transpose,
                        uint8_t* swizzled);

}  // namespace packmoe
