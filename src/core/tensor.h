// Tensor: a view of typed memory (dtype, shape, device), owning or not. Owning tensors share
// their buffer (copies are cheap views of the same bytes). Quantized data carries a scale
// sidecar: the block scales, and for NVFP4 the per-tensor (per-expert) amax.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace packmoe {

enum class Device : uint8_t { kCPU, kCUDA };
std::string_view device_name(Device d);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_string(const Shape& s);

// Memory provider of one device; backends implement it. Core never sees CUDA.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
};

struct ScaleSidecar;

class Tensor {
 public:
  Tensor() = default;
  // Owning, uninitialised memory from `alloc`.
  static Tensor empty(Allocator& alloc, DType dtype, Shape shape);
  // Non-owning view of memory that outlives the tensor.
  static Tensor view(void* data, DType dtype, Shape shape, Device device);

  bool defined() const { return data_ != nullptr || numel() == 0; }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int rank() const { return static_cast<int>(shape_.size()); }
  Device device() const { return device_; }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return dtype_bytes_for(dtype_, numel()); }
  bool owns_memory() const { return buffer_ != nullptr; }

  // Index i of the leading dimension, as a view sharing the buffer: (E, N, K) -> (N, K).
  Tensor select0(int64_t i) const;
  // Same bytes, other shape (numel must match).
  Tensor reshaped(Shape shape) const;

  // Scale sidecar of quantized data; null for plain tensors.
  const ScaleSidecar* sidecar() const { return sidecar_.get(); }
  void set_sidecar(ScaleSidecar sidecar);

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Device device_ = Device::kCPU;
  std::shared_ptr<void> buffer_;  // keeps owning memory alive; null for views
  std::shared_ptr<const ScaleSidecar> sidecar_;
};

enum class ScaleLayout : uint8_t {
  kCompact,   // row-major [rows, blocks] (MXFP8 columnwise: [rows/32, K]); what is communicated
  kSwizzled,  // GEMM-ready 128x4 tiles (docs/formats.md), padded; derived, never communicated
};

struct ScaleSidecar {
  Tensor scale;  // block decode scales: E8M0 (MXFP8) or E4M3 (NVFP4)
  Tensor amax;   // NVFP4: (G,) F32, one per group (expert); undefined for MXFP8
  ScaleLayout layout = ScaleLayout::kCompact;
  int block_rows = 1;  // block extent along rows (1, 16 or 32)
  int block_cols = 32;  // block extent along columns
};

}  // namespace packmoe
