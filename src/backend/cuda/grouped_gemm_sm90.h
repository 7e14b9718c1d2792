// The sm_90a grouped GEMM (grouped_gemm_sm90.cu): one persistent launch over all groups of
//   D_g (mk_g, nk) = A_g (mk_g, kred_g) . B_g (kred_g, nk)      FP32 accumulation
// on BF16 operands in device memory, each either K-major (the reduction dim contiguous) or
// MN-major, with TMA loads into 128-byte swizzled shared memory (multicast within 2-CTA
// clusters), a producer warp and two wgmma consumer warpgroups, and a TMA-store epilogue that
// writes FP32 or BF16, optionally scaled by alpha_g = alpha_lhs[g] * alpha_rhs[g] (NVFP4) and
// added to the FP32 output (wgrad into main_grad). The result depends on shapes and values only:
// tiles, their summation order and the tile shape are functions of (mk, kred, nk), never of
// pointers. grouped_gemm_cuda.cu prepares the operands (quantized ones dequantized exactly to BF16,
// misaligned ones staged) and calls this; quantized operands may be dequantized into their BF16
// storage by the kernel itself while it runs (a_dequant / b_dequant: the pre-pass's work, in-launch).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/grouped_gemm_dequant_job.h"
#include "backend/cuda/grouped_gemm_sm90_tiles.h"
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
  // Streaming dequantize: per group, the quantized copy (grouped_gemm_dequant_job.h; no elements:
  // that operand is BF16 already) that the kernel itself converts into a[g] / b[g] before any
  // tile of the group reads them; empty vectors: nothing to convert.
  std::vector<gemm_convert::DequantJob> a_dequant, b_dequant;
};

// The device runs sm_90a code (compute capability 9.0 exactly).
bool sm90_gemm_device_ok(CudaBackend& be);

// Every row length is a multiple of 8 elements (16 bytes: TMA strides, vector stores) and every
// dimension below 2^31. Shapes only.
bool sm90_gemm_shape_ok(const Sm90Gemm& p);

// Queues the GEMM on be.stream(); no host synchronisation.
Status grouped_gemm_sm90(CudaBackend& be, const Sm90Gemm& p);

// ---- token counts in device memory -------------------------------------------------------------
// The same GEMM when the G token counts m_g live only in device memory (no host copy, CUDA-graph
// capturable). Token-side operands are packed: group g's part starts at token row off_g =
// sum_{h<g} m_h, i.e. at base + off_g * token_bytes. fprop / dgrad: mk_g = m_g (A and out are
// token-side, B per group); wgrad: kred_g = m_g (A and B token-side, out per group).

struct Sm90DeviceOperand {
  std::vector<const void*> ptr;  // (G,) weight-side: each group's own (16-byte aligned)
  const void* base = nullptr;    // token-side: the packed buffer (16-byte aligned)
  int64_t token_bytes = 0;       // token-side: bytes one token adds (0: weight-side)
};

struct Sm90DeviceGemm {
  int64_t groups = 0;    // G (at most kSm90MaxDeviceGroups)
  int64_t capacity = 0;  // token rows of the packed buffers; the counts sum to at most this
  int64_t align = 1;     // every m_g is a multiple of it (checked on the device)
  bool tokens_reduce = false;  // wgrad
  int64_t fixed = 0;     // the per-group dimension that is not m_g: kred (fprop, dgrad), mk (wgrad)
  int64_t nk = 0;
  bool a_k_major = true, b_k_major = true;
  bool out_bf16 = false, accumulate = false;
  const float* alpha_lhs = nullptr;  // (G,) on the device, or null
  const float* alpha_rhs = nullptr;
  Sm90DeviceOperand a, b, out;
  Sm90Tiles tiles;  // from sm90_device_tiles
};

constexpr int64_t kSm90MaxDeviceGroups = 1024;

// The sm_90a geometry of `p` with per-group counts `m` (the host's counts, or host-chosen ones
// standing in for the device's: shape rules and the tile choice): mk / kred per group as Sm90Gemm
// has them, pointers left empty.
Sm90Gemm sm90_device_geometry(const Sm90DeviceGemm& p, const std::vector<int64_t>& m);

// The tile shape for `p` without its counts: the heuristic on an even split of the capacity
// (sm90_uniform_split), unless GemmPolicy (kernel_policy.h) forces tile_n / cluster. Same bytes as
// any other tile shape (the summation order does not depend on it).
Sm90Tiles sm90_device_tiles(CudaBackend& be, const Sm90DeviceGemm& p);

// Device memory of one call signature (templates, maps, table): made on a call outside graph
// capture (encodes maps, allocates, uploads: synchronises), kept for the life of the process (a
// captured graph may read it), never overwritten by another signature.
struct Sm90DevicePlan;
const Sm90DevicePlan* make_sm90_device_plan(CudaBackend& be, const Sm90DeviceGemm& p);

// Queues the schedule kernel and the GEMM on be.stream(): no host synchronisation, nothing read
// from host memory at run (or graph replay) time but the launch parameters.
Status grouped_gemm_sm90_device(CudaBackend& be, const Sm90DevicePlan& plan, const int64_t* m_device);

}  // namespace packmoe
