// DispatchPayload: rows grouped by expert in the expert recipe's quantized rowwise form, as
// `--dispatch-dtype recipe` sends the FC1 input (nn/token_dispatcher.h). ONE byte buffer of W =
// dispatch_row_bytes bytes per row: group g's region starts at W * (rows before g) and holds its
// m_g rows of codes, then their m_g rows of block scales (the formats' compact rowwise layouts:
// MXFP8 (m_g, C) E4M3 + (m_g, C/32) E8M0, NVFP4 (m_g, C/2) E2M1 pairs + (m_g, C/16) E4M3).
// Invariant: every run of consecutive groups is one contiguous byte range, (its rows) x W, so a
// dispatcher moves it as rows of W bytes and the receiver's source-major groups keep the layout.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace packmoe {

struct DispatchPayload {
  Tensor rows;  // (R, W) U8, R >= the groups' rows
  Tensor amax;  // NVFP4: (G,) F32, each group's amax (its S_enc); MXFP8: empty
};

// Group g's code and scale pointers in a payload at `base` with groups m.
struct PayloadGroups {
  std::vector<void*> data;   // (m_g, data_row_bytes) each
  std::vector<void*> scale;  // (m_g, scale_row_bytes) each
};
PayloadGroups carve_payload(void* base, const std::vector<int64_t>& m, int64_t data_row_bytes,
                            int64_t scale_row_bytes);

}  // namespace packmoe
