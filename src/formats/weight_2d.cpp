// CPU reference of the columnwise copy of a 2D-scaled weight from its rowwise copy.
#include "formats/weight_2d.h"

#include <cstring>
#include <string>

#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace packmoe {

Status validate_weight_2d_columnwise(const Weight2dCopies& w) {
  const std::string what = "weight_2d_columnwise: ";
  const int64_t tile = w.format == Tiled2dFormat::kMxfp8 ? kMxfp8Block : kNvfp4Block;
  if (w.rows <= 0 || w.cols <= 0 || w.rows % tile != 0 || w.cols % tile != 0)
    return Status::error(what + "a (" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                         ") weight is not made of " + std::to_string(tile) + "x" +
                         std::to_string(tile) + " tiles");
  const size_t g = w.row_data.size();
  if (g == 0) return Status::error(what + "no groups");
  if (w.row_scale.size() != g || w.col_data.size() != g || w.col_scale.size() != g)
    return Status::error(what + "row_data, row_scale, col_data and col_scale need " +
                         std::to_string(g) + " pointers each");
  for (size_t i = 0; i < g; ++i)
    if (!w.row_data[i] || !w.row_scale[i] || !w.col_data[i] || !w.col_scale[i])
      return Status::error(what + "group " + std::to_string(i) + " has a null pointer");
  return Status::ok();
}

Status weight_2d_columnwise_cpu(const Weight2dCopies& w) {
  PACKMOE_RETURN_IF_ERROR(validate_weight_2d_columnwise(w));
  const int64_t n = w.rows, k = w.cols;
  for (size_t g = 0; g < w.row_data.size(); ++g) {
    const uint8_t* rd = static_cast<const uint8_t*>(w.row_data[g]);
    const uint8_t* rs = static_cast<const uint8_t*>(w.row_scale[g]);
    uint8_t* cd = static_cast<uint8_t*>(w.col_data[g]);
    uint8_t* cs = static_cast<uint8_t*>(w.col_scale[g]);
    if (w.format == Tiled2dFormat::kMxfp8) {
      constexpr int64_t kB = kMxfp8Block;
      std::memcpy(cd, rd, n * k);
      // col_scale[rb][c] = the scale of tile (rb, c / 32), which row rb * 32 carries.
#pragma omp parallel for schedule(static)
      for (int64_t rb = 0; rb < n / kB; ++rb)
        for (int64_t c = 0; c < k; ++c) cs[rb * k + c] = rs[rb * kB * (k / kB) + c / kB];
      continue;
    }
    constexpr int64_t kB = kNvfp4Block;
    // Code (r, c) is nibble c & 1 of row byte (r, c / 2); the transposed byte (c, r / 2) holds
    // rows r (low nibble, r even) and r + 1 (high nibble).
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < k; ++c) {
      const int shift = static_cast<int>(c & 1) * 4;
      for (int64_t r = 0; r < n; r += 2) {
        const uint8_t lo = (rd[r * (k / 2) + c / 2] >> shift) & 0xF;
        const uint8_t hi = (rd[(r + 1) * (k / 2) + c / 2] >> shift) & 0xF;
        cd[c * (n / 2) + r / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
      for (int64_t rb = 0; rb < n / kB; ++rb)
        cs[c * (n / kB) + rb] = rs[rb * kB * (k / kB) + c / kB];
    }
  }
  return Status::ok();
}

}  // namespace packmoe
