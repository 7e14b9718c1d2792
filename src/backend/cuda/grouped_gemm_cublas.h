// The grouped GEMM as one cuBLASLt matmul per group (grouped_gemm_cublas.cu): the fallback for
// shapes and GPUs the sm_90a kernel does not take, and the baseline it is measured against.
// Invariant: a group's algorithm is a function of its shape only (chosen once per shape by a
// heuristic told every pointer is 16-byte aligned), with true FP32 accumulation, so a packed
// weight and separate buffers give the same bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/grouped_gemm_operands.h"
#include "backend/ops/gemm.h"
#include "core/status.h"

namespace packmoe::gemm_cuda {

// Queues every active group (m[g] > 0) of `a` on be.stream(): out[g] = op(lhs) op(rhs), or +=
// with a.accumulate, NVFP4 scaled by alpha[g] = S_dec(lhs)[g] * S_dec(rhs)[g]. lhs / rhs are the
// prepared BF16 operands, out the 16-byte aligned outputs (the caller stages misaligned ones).
Status grouped_gemm_cublaslt(CudaBackend& be, const GroupedGemmArgs& a,
                             const std::vector<int64_t>& m, const Prepared& lhs,
                             const Prepared& rhs, const std::vector<void*>& out);

}  // namespace packmoe::gemm_cuda
