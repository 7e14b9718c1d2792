// CPU reference of the GEMM-ready scale swizzle (formats/swizzle.h, docs/formats.md). The whole
// padded buffer is written: padding bytes are zero, so swizzled buffers compare bytewise.
#include "formats/swizzle.h"

#include <cstring>

namespace packmoe {

void swizzle_scales_cpu(const uint8_t* compact, int64_t rows, int64_t cols, bool transpose,
                        uint8_t* swizzled) {
  // The swizzled matrix is S (rows, cols) or S^T (cols, rows).
  const int64_t s_rows = transpose ? cols : rows;
  const int64_t s_cols = transpose ? rows : cols;
  std::memset(swizzled, 0, static_cast<size_t>(swizzled_scale_bytes(s_rows, s_cols)));
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t v = compact[i * cols + j];
      if (transpose)
        swizzled[swizzled_scale_index(j, i, s_cols)] = v;
      else
        swizzled[swizzled_scale_index(i, j, s_cols)] = v;
    }
  }
}

}  // namespace packmoe
