// Tensor views, owning allocation and shape helpers.
#include "core/tensor.h"

#include "core/check.h"

namespace packmoe {

std::string_view device_name(Device d) { return d == Device::kCPU ? "cpu" : "cuda"; }

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    PACKMOE_CHECK(d >= 0, "negative dimension");
    n *= d;
  }
  return n;
}

std::string shape_string(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

Tensor Tensor::empty(Allocator& alloc, DType dtype, Shape shape) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.device_ = alloc.device();
  size_t bytes = t.nbytes();
  PACKMOE_CHECK(dtype_bits(dtype) >= 8 || t.numel() % 2 == 0, "E2M1 tensors hold an even count");
  void* p = bytes ? alloc.allocate(bytes) : nullptr;
  t.data_ = p;
  Allocator* a = &alloc;
  t.buffer_ = std::shared_ptr<void>(p, [a](void* q) { if (q) a->deallocate(q); });
  return t;
}

Tensor Tensor::view(void* data, DType dtype, Shape shape, Device device) {
  Tensor t;
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.device_ = device;
  return t;
}

Tensor Tensor::select0(int64_t i) const {
  PACKMOE_CHECK(rank() >= 1 && i >= 0 && i < shape_[0], "select0(" << i << ") of " << shape_string(shape_));
  Tensor t = *this;
  t.shape_ = Shape(shape_.begin() + 1, shape_.end());
  t.data_ = static_cast<uint8_t*>(data_) + dtype_bytes_for(dtype_, i * t.numel());
  t.sidecar_.reset();
  return t;
}

Tensor Tensor::reshaped(Shape shape) const {
  PACKMOE_CHECK(shape_numel(shape) == numel(), shape_string(shape_) << " -> " << shape_string(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::set_sidecar(ScaleSidecar sidecar) {
  sidecar_ = std::make_shared<const ScaleSidecar>(std::move(sidecar));
}

}  // namespace packmoe
