// Quantize op family: the low-precision formats of formats/ (MXFP8, NVFP4, 2D weights, scale
// swizzling) as backend ops over grouped matrices. Invariant: every backend writes the bytes of the
// CPU reference functions in formats/ (the formats' contract: docs/formats.md); the entries check
// the arguments once with the formats' validate_* functions.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/weight_2d.h"

namespace packmoe {

class Backend;
namespace ops {
Status quantize_mxfp8(Backend& b, const GroupedMatrices& in, const Mxfp8Config& cfg,
                      const Mxfp8Outputs& out);
Status dequantize_mxfp8(Backend& b, const Mxfp8Copy& q, DType out_dtype,
                        const std::vector<void*>& out);
Status quantize_nvfp4(Backend& b, const GroupedMatrices& in, const Nvfp4Config& cfg,
                      const Nvfp4Outputs& out);
Status dequantize_nvfp4(Backend& b, const Nvfp4Copy& q, DType out_dtype,
                        const std::vector<void*>& out);
// amax (G,) = each group's NaN-ignoring amax (formats/nvfp4.h nvfp4_amax_cpu).
Status nvfp4_amax(Backend& b, const GroupedMatrices& in, float* amax);
// The columnwise copy of 2D-scaled weights from their rowwise copy (formats/weight_2d.h).
Status weight_2d_columnwise(Backend& b, const Weight2dCopies& w);
// Compact (rows, cols) E8M0 / E4M3 scales -> swizzled (formats/swizzle.h); `transpose` swizzles
// S^T.
Status swizzle_scales(Backend& b, const void* compact, int64_t rows, int64_t cols, bool transpose,
                      void* swizzled);
}  // namespace ops

// One device's implementation of the family; every pointer is set (backend/cpu/cpu_kernels.cpp,
// backend/cuda/cuda_kernels.cu). Arguments arrive validated.
struct QuantizeKernels {
  Status (*quantize_mxfp8)(Backend&, const GroupedMatrices&, const Mxfp8Config&,
                           const Mxfp8Outputs&);
  Status (*dequantize_mxfp8)(Backend&, const Mxfp8Copy&, DType, const std::vector<void*>&);
  Status (*quantize_nvfp4)(Backend&, const GroupedMatrices&, const Nvfp4Config&,
                           const Nvfp4Outputs&);
  Status (*dequantize_nvfp4)(Backend&, const Nvfp4Copy&, DType, const std::vector<void*>&);
  Status (*nvfp4_amax)(Backend&, const GroupedMatrices&, float*);
  Status (*weight_2d_columnwise)(Backend&, const Weight2dCopies&);
  Status (*swizzle_scales)(Backend&, const void*, int64_t, int64_t, bool, void*);
};

}  // namespace packmoe
