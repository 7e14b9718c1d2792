// The grouped GEMM when the token counts live only in device memory (GroupedGemmArgs::m_device)
// on the sm_90a kernel (grouped_gemm_device_counts.cu): nothing reads the counts on the host, so
// the call never synchronises after its first run and can be captured in a CUDA graph.
// Invariant: it gives the bytes of the same call with host counts (the device schedule builds the
// host path's work table and maps).
#pragma once

#include "backend/cuda/cuda_backend.h"
#include "backend/ops/gemm.h"
#include "core/status.h"

namespace packmoe::gemm_cuda {

// True while be.stream() is being captured into a CUDA graph.
bool stream_capturing(CudaBackend& be);

// Queues the call when the no-sync path takes it (an sm_90a device under the policy, at most
// kSm90MaxDeviceGroups groups, shapes and pointers the kernel takes for any counts): true. False:
// nothing queued, the caller copies the counts to the host. Validated packed-token arguments.
Result<bool> grouped_gemm_device_counts(CudaBackend& be, const GroupedGemmArgs& a);

}  // namespace packmoe::gemm_cuda
