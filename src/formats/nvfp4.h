// NVFP4 (docs/formats.md): E2M1 elements (two per byte, low nibble first), one E4M3 scale
// per 16 elements, and one FP32 amax per group (expert) giving the per-tensor scale
// S_enc = 2688 / amax. Weights use 2D 16x16 tiles; activations and gradients 1x16 blocks with
// the Random Hadamard Transform on the columnwise (wgrad) copy and stochastic rounding for
// gradients. The columnwise copy is stored TRANSPOSED: (K, rows_g). CPU reference.
#pragma once

#include <cstdint>
#include <vector>

#include "formats/grouped.h"

namespace packmoe {

inline constexpr int kNvfp4Block = 16;

struct Nvfp4Config {
  bool rowwise = true;
  bool columnwise = false;  // transposed copy, blocks of 16 along rows (tokens)
  bool two_d = false;       // 16x16 tiles (weights); row and column copies are exact transposes
  bool rht = false;         // RHT on the columnwise copy only (not with two_d)
  bool stochastic_rounding = false;
  uint64_t seed = 0;        // SR random stream (seed, offset): numbering below
  uint64_t offset = 0;
  // Per-group amax (G,) F32 in the memory of the backend that runs the op, or null (the groups'
  // own amax). Given, S_enc of group g comes from amax[g]: the group is a row range of a larger
  // tensor (a data-parallel shard of a packed weight) whose amax the ranks agreed on, so every
  // range is scaled as the whole tensor would be. Must be >= the group's own amax (blocks would
  // saturate otherwise); not with the RHT, whose columnwise amax is taken after the transform.
  // The outputs' row_amax / col_amax then only echo it and may be null.
  const float* amax = nullptr;
};

// Stochastic rounding bits (the one definition, CPU and CUDA). Blocks of 16 elements are numbered
// globally: all groups in group order, within group g in the stored layout's row-major block
// order, starting at base_g = sum_{u<g} rows_u * K/16 (the same base for both copies):
//   rowwise    block (r, kb), r < rows_g, kb < K/16:    b = base_g + r * (K/16) + kb
//   columnwise block (c, rb), c < K, rb < rows_g/16:    b = base_g + c * (rows_g/16) + rb
// Element j (0..15) of block b uses byte nvfp4_sr_byte(philox_draw(seed, offset + b, s), j)
// (formats/nvfp4_math.h, core/philox.h), stream s = 0 for the rowwise and 1 for the columnwise
// copy. So quantizing with offset o + 1 draws for block b what offset o draws for block b + 1.
//
// Amax: row_amax[g] is the NaN-ignoring amax of group g's input (0 for an empty group), or the
// given cfg.amax[g]; col_amax[g] equals it, except with RHT where it is the amax of all RHT outputs
// of the group.
// Input is converted to FP32 first (BF16 exactly); RHT additionally rounds it to BF16.

// Per-group output pointers; a copy that is not requested has empty vectors and a null amax.
struct Nvfp4Outputs {
  std::vector<void*> row_data;   // (rows_g, K/2) bytes
  std::vector<void*> row_scale;  // (rows_g, K/16) E4M3
  void* row_amax = nullptr;      // (G,) F32 amax of the input
  std::vector<void*> col_data;   // (K, rows_g/2) bytes
  std::vector<void*> col_scale;  // (K, rows_g/16) E4M3
  void* col_amax = nullptr;      // (G,) F32 amax of the columnwise input (after RHT when on)
  // Optional, 1x16 rowwise copies only: (rows_g, K) BF16, the rowwise copy's values without the
  // per-tensor scale, f32_to_bf16(nvfp4_decode(code, s_b, 1)): exactly what a GEMM dequantizes
  // the copy to (it applies S_dec as alpha), so a GEMM that is given them reads them instead.
  // A rowwise copy given only these (row_data and row_scale empty) is written as its values only.
  std::vector<void*> row_bf16;
  bool row_values_only() const { return !row_bf16.empty() && row_data.empty() && row_scale.empty(); }
};

// One copy for dequantization. A columnwise copy dequantizes to its stored (K, rows_g) layout,
// in the RHT domain when RHT was applied.
struct Nvfp4Copy {
  int64_t cols = 0;                // K of the stored matrix (rowwise: K; columnwise: rows_g)
  std::vector<int64_t> rows;       // stored rows per group (rowwise: rows_g; columnwise: K)
  std::vector<const void*> data;   // (rows, cols/2) bytes
  std::vector<const void*> scale;  // (rows, cols/16) E4M3
  // (G,) F32 per-group DECODE scale nvfp4_decode_scale(amax) (formats/nvfp4_math.h), the value
  // files store as `X_scale_2`. Dequantizing from it is exact whether the scale came from the
  // quantizer's amax or from a file.
  const void* decode_scale = nullptr;
};

Status validate_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg, const Nvfp4Outputs& out);
Status validate_nvfp4_copy(const Nvfp4Copy& q, DType out_dtype, const std::vector<void*>& out);

Status quantize_nvfp4_cpu(const GroupedMatrices& in, const Nvfp4Config& cfg, const Nvfp4Outputs& out);
// amax[g] = the NaN-ignoring amax of group g's input, 0 for an empty group (what quantize_nvfp4
// writes to row_amax): the per-expert amax a rank contributes to a sharded weight's global one.
// K % 16 == 0, as for quantize.
Status validate_nvfp4_amax(const GroupedMatrices& in, const float* amax);
Status nvfp4_amax_cpu(const GroupedMatrices& in, float* amax);
// x = (e2m1 * e4m3(scale)) * decode_scale[g] (nvfp4_decode), written as f32 or bf16 (rows, cols).
Status dequantize_nvfp4_cpu(const Nvfp4Copy& q, DType out_dtype, const std::vector<void*>& out);

}  // namespace packmoe
