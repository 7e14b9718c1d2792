// Backend interface: memory, copies, synchronisation, timing and the op table. CPU is the
// reference semantics; CUDA must match it (quantizers bitwise). Pointers passed to ops address
// this backend's memory. Ops check their shapes and return a Status before touching memory.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "backend/grouped_gemm.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace packmoe {

enum class Op {
  kQuantizeMxfp8,
  kDequantizeMxfp8,
  kQuantizeNvfp4,
  kDequantizeNvfp4,
  kSwizzleScales,
  kGroupedGemm,
};
std::string_view op_name(Op op);

class Backend : public Allocator {
 public:
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"

  // ---- memory ------------------------------------------------------------------------------
  // Copies between host memory and this backend's memory (either side may be either).
  enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // Median milliseconds of `body` over `iters` runs after `warmup` runs, measured with the
  // device's own clock (CUDA events on GPU).
  virtual double time_ms(const std::function<void()>& body, int warmup, int iters) = 0;

  // ---- op table ----------------------------------------------------------------------------
  virtual bool supports(Op op) const = 0;

  virtual Status quantize_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg,
                                const Mxfp8Outputs& out) = 0;
  virtual Status dequantize_mxfp8(const Mxfp8Copy& q, DType out_dtype,
                                  const std::vector<void*>& out) = 0;
  virtual Status quantize_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg,
                                const Nvfp4Outputs& out) = 0;
  virtual Status dequantize_nvfp4(const Nvfp4Copy& q, DType out_dtype,
                                  const std::vector<void*>& out) = 0;
  // Compact (rows, cols) scales -> swizzled (formats/swizzle.h); `transpose` swizzles S^T.
  virtual Status swizzle_scales(const void* compact, int64_t rows, int64_t cols, bool transpose,
                                void* swizzled) = 0;

  // Grouped GEMM (backend/grouped_gemm.h): fprop / dgrad / wgrad over G groups.
  virtual Status grouped_gemm(const GroupedGemmArgs& args) = 0;

  // ---- helpers over the primitives above ---------------------------------------------------
  Tensor to_device(const Tensor& host);  // copy of a CPU tensor into this backend's memory
  Tensor to_host(const Tensor& dev, Allocator& host_alloc);
};

// The process-wide backend of a device. CUDA returns an error Status when the build has no CUDA
// backend or no GPU is visible.
Result<Backend*> get_backend(Device device);
Backend& cpu_backend();
bool cuda_available();

}  // namespace packmoe
