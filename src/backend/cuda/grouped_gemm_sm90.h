// The sm_90a grouped GEMM (grouped_gemm_sm90.cu): one persistent launch over all groups of
//   D_g (mk_g, nk) = A_g (mk_g, kred_g) . B_g (kred_g, nk)      FP32 accumulation
// on BF16 operands in device memory, each either K-major (the reduction dim contiguous) or
// MN-major, with TMA loads into 128-byte swizzled shared memory (multicast within 2-CTA
// clusters), a producer warp and two wgmma consumer warpgroups, and a TMA-store epilogue that
// writes FP32 or BF16, optionally scaled by alpha_g = alpha_lhs[g] * alpha_rhs[g] (NVFP4) and
// added to the FP32 output (wgrad into main_grad). The result depends on shapes and values only: tiles, their summation order and the
// tile shape are functions of (mk, kred, nk), never of pointers. grouped_gemm_cublas.cu prepares
// the operands (quantized ones dequantized exactly to BF16, misaligned ones staged) and calls this;
// MXFP8 E4M3 K-major operands may instead come as FP8 bytes and scales (mxfp8_e4m3), dequantized
// in the kernel to the same BF16 values.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/status.h"

namespace packmoe {

struct Sm90Gemm {
  int64_t nk = 0;                  // output columns (all groups)
  std::vector<int64_t> mk, kred;   // per group: output rows, reduction length (0: no work)
  // Per group BF16 row-major storage, 16-byte aligned:
  //   A: a_k_major ? (mk_g, kred_g) : (kred_g, mk_g)     B: b_k_major ? (nk, kred_g) : (kred_g, nk)
  std::vector<const void*> a, b;
  bool a_k_major = true, b_k_major = true;
  std::vector<void*> out;          // (mk_g, nk) row-major, 16-byte aligned
  bool out_bf16 = false;
  bool accumulate = false;         // FP32 out only: out += alpha * A.B (alpha * A.B rounded to
                                   // FP32 once, then added: one more rounding)
  const float* alpha_lhs = nullptr;  // (G,) on the device, or null for alpha = 1
  const float* alpha_rhs = nullptr;
  // Fused MXFP8 operands (fprop): A and B are the rowwise E4M3 copies, (mk_g, kred_g) and
  // (nk, kred_g) FP8 bytes with (rows, kred_g / 32) E8M0 scales in a_scale / b_scale, dequantized
  // in the kernel to exactly the BF16 values of the dequantize pre-pass (no BF16 copy in memory).
  bool mxfp8_e4m3 = false;
  std::vector<const void*> a_scale, b_scale;
};

// The device runs sm_90a code (compute capability 9.0 exactly).
bool sm90_gemm_device_ok(CudaBackend& be);

// Every row length is a multiple of 8 elements (16 bytes: TMA strides, vector stores) and every
// dimension below 2^31; fused MXFP8: both operands K-major, reductions multiples of 32. Shapes only.
bool sm90_gemm_shape_ok(const Sm90Gemm& p);

// Queues the GEMM on be.stream(); no host synchronisation.
Status grouped_gemm_sm90(CudaBackend& be, const Sm90Gemm& p);

}  // namespace packmoe
