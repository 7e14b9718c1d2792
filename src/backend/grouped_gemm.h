// Arguments of the grouped GEMM op family (reference section A.5), one group per expert g with
// m_g tokens, weight W_g (N, K), FP32 accumulation:
//   fprop  Y_g  (m_g, N) = X_g  (m_g, K) . W_g^T        lhs = X,  rhs = W   (reduction K)
//   dgrad  dX_g (m_g, K) = dY_g (m_g, N) . W_g          lhs = dY, rhs = W   (reduction N)
//   wgrad  dW_g (N, K)   = dY_g^T . X_g                 lhs = dY, rhs = X   (reduction m_g)
// Both operands share one format. Which stored copy each GEMM reads (blocks always run along the
// reduction dim) is fixed by the op and the format:
//   op     operand  BF16      MXFP8 copy: data, scale            NVFP4 copy: data bytes, scale
//   fprop  X        (m, K)    rowwise (m, K), (m, K/32)          rowwise (m, K/2), (m, K/16)
//   fprop  W        (N, K)    rowwise (N, K), (N, K/32)          rowwise (N, K/2), (N, K/16)
//   dgrad  dY       (m, N)    rowwise (m, N), (m, N/32)          rowwise (m, N/2), (m, N/16)
//   dgrad  W        (N, K)    columnwise (N, K), (N/32, K)       columnwise^T (K, N/2), (K, N/16)
//   wgrad  dY       (m, N)    columnwise (m, N), (m/32, N)       columnwise^T (N, m/2), (N, m/16)
//   wgrad  X        (m, K)    columnwise (m, K), (m/32, K)       columnwise^T (K, m/2), (K, m/16)
// NVFP4 per-tensor decode scales are applied to the output as alpha = S_dec(lhs) * S_dec(rhs),
// as a native block-scaled GEMM does. Weight pointers may be one packed (E, N, K) buffer or E
// separate buffers: the result is the same bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace packmoe {

enum class GemmOp { kFprop, kDgrad, kWgrad };
enum class OperandFormat { kBF16, kMxfp8, kNvfp4 };

struct GemmOperand {
  OperandFormat format = OperandFormat::kBF16;
  DType element = DType::kE4M3;    // MXFP8 element type (kE4M3 or kE5M2)
  std::vector<const void*> data;   // G pointers, stored matrix of the table above
  std::vector<const void*> scale;  // G pointers, compact block scales (MXFP8, NVFP4)
  const void* decode_scale = nullptr;  // NVFP4: (G,) F32 per-group S_dec = nvfp4_decode_scale(amax)
};

struct GroupedGemmArgs {
  GemmOp op = GemmOp::kFprop;
  int64_t n = 0;  // N: weight rows (out features)
  int64_t k = 0;  // K: weight columns (in features)
  // Tokens per group: on the host (`m`) or in the backend's memory (`m_device`, (G,) int64; the
  // CUDA backend copies it to the host once per call: a synchronisation).
  std::vector<int64_t> m;
  const void* m_device = nullptr;
  int64_t groups = 0;  // G (needed when m is on the device)
  GemmOperand lhs;
  GemmOperand rhs;
  DType out_dtype = DType::kF32;  // kF32 or kBF16
  std::vector<void*> out;         // G pointers: fprop (m_g, N), dgrad (m_g, K), wgrad (N, K)
  // wgrad only: add into FP32 `out` (main_grad) instead of overwriting. Groups with m_g = 0 leave
  // main_grad untouched when accumulating and get zeros when overwriting; fprop/dgrad write
  // nothing for them.
  bool accumulate = false;
};

// Token alignment the format needs (the MoE permutation pads each group to it): MXFP8 32,
// NVFP4 16, BF16 1.
int64_t gemm_token_alignment(OperandFormat f);

// Exactly one of `m` / `m_device` is given, and `groups` agrees with it. Touches no memory.
Status validate_token_source(const GroupedGemmArgs& args);

// Shape / usage checks with clear messages; `m` are the host token counts. Touches no memory.
Status validate_grouped_gemm(const GroupedGemmArgs& args, const std::vector<int64_t>& m);

}  // namespace packmoe
