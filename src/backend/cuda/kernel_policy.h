// The CUDA kernels' tuning choices, as one explicit policy object: which grouped GEMM runs, the
// sm_90a kernel's tile shape, grid and in-kernel dequantize, and the NVFP4 quantizer's grid. The
// defaults are production's; tests and benchmarks set other values to reach every path.
// Invariant: a choice only changes which code runs (or how many CTAs run it), never a result
// byte; the tests prove every variant gives the default's bytes.
#pragma once

#include "core/status.h"

namespace packmoe {

// Which grouped GEMM implementation runs (backend/cuda/grouped_gemm_cuda.cu chooses).
enum class GemmImpl {
  kAuto,      // the sm_90a kernel on compute capability 9.0 wherever its shape rules allow
  kCublasLt,  // one cuBLASLt matmul per group (the baseline the benchmark prints beside it)
};

// Which quantized operand copies the sm_90a kernel dequantizes itself while it runs (its converter
// warps) instead of a pre-pass launch before it. Either way the same BF16 values reach the same
// wgmmas. The default streams only where it measured faster (docs/gemm-sm90.md).
enum class Sm90Dequant {
  kRowwiseMxfp8,  // the MXFP8 rowwise copies stream, the others go through the pre-pass
  kAll,           // every quantized copy streams
  kNone,          // every quantized copy goes through the pre-pass
};

struct GemmPolicy {
  GemmImpl impl = GemmImpl::kAuto;
  Sm90Dequant dequant = Sm90Dequant::kRowwiseMxfp8;
  int tile_n = 0;    // sm_90a tile width: 0 = the heuristic's (grouped_gemm_sm90_tiles.h), 128, 256
  int cluster = 0;   // sm_90a cluster size: 0 = the heuristic's, 1, 2
  int max_ctas = 0;  // sm_90a persistent grid: 0 = every resident CTA, else at most this many
};

struct QuantizePolicy {
  int nvfp4_max_ctas = 0;  // NVFP4 amax / quantize grids: 0 = every resident CTA, else at most
};

struct KernelPolicy {
  GemmPolicy gemm;
  QuantizePolicy quantize;
};

// The process-wide policy (the defaults until set). Calls already queued keep the policy they
// were launched with; set it between calls, not while another thread runs CUDA ops.
KernelPolicy kernel_policy();
// An error (nothing changed) when a value is outside the ranges above.
Status set_kernel_policy(const KernelPolicy& policy);

// Sets `policy` for the life of the object, then restores the previous one (tests, benchmarks).
// Aborts on an invalid policy (a programming error in the caller).
class ScopedKernelPolicy {
 public:
  explicit ScopedKernelPolicy(const KernelPolicy& policy);
  ~ScopedKernelPolicy();
  ScopedKernelPolicy(const ScopedKernelPolicy&) = delete;
  ScopedKernelPolicy& operator=(const ScopedKernelPolicy&) = delete;

 private:
  KernelPolicy previous_;
};

}  // namespace packmoe
