// The grouped GEMM dispatcher's choice on CUDA (grouped_gemm_cuda.cu), shared with the
// device-count path: which implementation runs a call, and the sm_90a kernel's view of its shapes.
// Invariant: the choice is a function of the KernelPolicy, the device and the shapes only, never
// of pointers, so a packed weight and separate buffers run the same code.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/grouped_gemm_sm90.h"
#include "backend/ops/gemm.h"

namespace packmoe::gemm_cuda {

// The implementations behind the one entry point: the sm_90a wgmma kernel (grouped_gemm_sm90.cu)
// and one cuBLASLt matmul per group (grouped_gemm_cublas.cu). Both read the same prepared BF16
// operands.
enum class GemmPath { kCublasLt, kSm90 };

// GemmImpl::kCublasLt (kernel_policy.h) forces cuBLASLt; otherwise the sm_90a kernel runs on
// compute capability 9.0 wherever its shape rules allow (grouped_gemm_sm90.h) for counts `m`.
GemmPath choose_path(CudaBackend& be, const GroupedGemmArgs& a, const std::vector<int64_t>& m);

// The sm_90a kernel's view of the op, shapes only (no pointers, no counts): which per-group
// dimension is the token count (mk_g for fprop / dgrad, kred_g for wgrad), the other one, the
// output columns nk and which operands are K-major. The kernel's A is always the lhs (X or dY), B
// the rhs (W or X). Both the host-count and the device-count paths start from it.
Sm90DeviceGemm sm90_op_shape(const GroupedGemmArgs& a);

}  // namespace packmoe::gemm_cuda
