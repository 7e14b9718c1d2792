// Arguments of the grouped GEMM op family (docs/gemm.md, docs/formats.md), one group per expert
// g with m_g tokens, weight W_g (N, K), FP32 accumulation:
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
  // Optional, a quantized token-side copy (the lhs; the rhs of wgrad) with host counts only: G
  // pointers to the BF16 values of the stored matrix of the table above, without NVFP4's S_dec
  // (the quantizers' row_bf16 / col_bf16 outputs), i.e. exactly what the GEMM would dequantize
  // the copy to. The CUDA backend reads them instead of dequantizing; the CPU backend dequantizes
  // as always (the same values by definition). Never for a weight (no BF16 weight copies).
  // With them, `data` and `scale` may both be left empty: the copy is kept as its values only
  // (what a quantizer writes when nothing reads the FP8 / FP4 bytes), and every backend reads the
  // values.
  std::vector<const void*> bf16;
  bool values_only() const { return !bf16.empty() && data.empty() && scale.empty(); }
};

struct GroupedGemmArgs {
  GemmOp op = GemmOp::kFprop;
  int64_t n = 0;  // N: weight rows (out features)
  int64_t k = 0;  // K: weight columns (in features)
  // Tokens per group: on the host (`m`) or in the backend's memory (`m_device`: (G,) int64 with
  // `groups` = G and `m_capacity`). Every m_g is a multiple of gemm_token_alignment(format).
  //
  // With `m_device` the token-side operands (fprop lhs X and out Y, dgrad lhs dY and out dX,
  // wgrad lhs dY and rhs X) are ONE packed buffer each: give one data pointer (and one scale
  // pointer) for them. Group g's part starts at token row off_g = sum_{h<g} m_h: the per-group
  // compact layouts of the table above lie one after another, so it starts off_g * (bytes one
  // token adds) into the buffer (token_strides below; e.g. MXFP8 columnwise scales (m/32, K) at
  // row off_g/32, NVFP4 columnwise^T data (K, m_g/2) at byte off_g*K/2). Weight-side pointers
  // (fprop/dgrad rhs W, wgrad out) stay G pointers. `m_capacity` (host) is how many token rows
  // the packed buffers hold (a multiple of the alignment); the counts must sum to at most it.
  // The CPU backend checks the counts and returns an error. The CUDA backend on sm_90a reads them
  // only on the device (no host synchronisation; CUDA-graph capture works, docs/gemm-sm90.md):
  // a bad count there (negative, misaligned, sum over m_capacity) prints one line and traps the
  // kernel, which ends the CUDA context. Elsewhere it copies the counts to the host first (a
  // synchronisation, not capturable). The host cannot tell which groups are empty, so every
  // pointer of an m_device call must be valid.
  std::vector<int64_t> m;
  const void* m_device = nullptr;
  int64_t groups = 0;      // G (needed when m is on the device)
  int64_t m_capacity = 0;  // token rows of the packed buffers (m_device only)
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

// Bytes one token adds to each token-side packed buffer (0: a weight-side operand, G pointers).
struct TokenStrides {
  int64_t lhs_data = 0, lhs_scale = 0;
  int64_t rhs_data = 0, rhs_scale = 0;
  int64_t out = 0;
};
TokenStrides token_strides(const GroupedGemmArgs& args);

// Exactly one of `m` / `m_device` is given, `groups` agrees with it, and `m_capacity` is given
// (a positive multiple of the alignment) exactly when m_device is. Touches no memory.
Status validate_token_source(const GroupedGemmArgs& args);

// m_device calls: one pointer per token-side operand, G per weight-side one. Touches no memory.
Status validate_packed_tokens(const GroupedGemmArgs& args);

// Host copies `m` of device counts: none negative, each a multiple of the alignment, the sum at
// most m_capacity.
Status check_device_counts(const GroupedGemmArgs& args, const std::vector<int64_t>& m);

// The host-`m` form of an m_device call whose counts `m` are known: G per-group pointers into
// the packed token buffers (group g at off_g times the token strides).
GroupedGemmArgs expand_packed_tokens(const GroupedGemmArgs& args, const std::vector<int64_t>& m);

// Shape / usage checks with clear messages; `m` are the host token counts. Touches no memory.
Status validate_grouped_gemm(const GroupedGemmArgs& args, const std::vector<int64_t>& m);

// ---- entry: runs the backend's implementation (backend/ops/gemm.cpp). The implementations
// validate (validate_grouped_gemm needs the token counts, which may live in device memory, and
// only the device side knows how to read them).
class Backend;
namespace ops {
Status grouped_gemm(Backend& b, const GroupedGemmArgs& args);
}  // namespace ops

// One device's implementation (backend/cpu/cpu_kernels.cpp, backend/cuda/cuda_kernels.cu).
struct GemmKernels {
  Status (*grouped_gemm)(Backend&, const GroupedGemmArgs&);
};

}  // namespace packmoe
