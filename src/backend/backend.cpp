// Backend helpers shared by every implementation.
#include "backend/backend.h"

namespace packmoe {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kQuantizeMxfp8: return "quantize_mxfp8";
    case Op::kDequantizeMxfp8: return "dequantize_mxfp8";
    case Op::kQuantizeNvfp4: return "quantize_nvfp4";
    case Op::kDequantizeNvfp4: return "dequantize_nvfp4";
    case Op::kSwizzleScales: return "swizzle_scales";
    case Op::kGroupedGemm: return "grouped_gemm";
  }
  return "unknown";
}

Tensor Backend::to_device(const Tensor& host) {
  PACKMOE_CHECK(host.device() == Device::kCPU, "to_device expects a CPU tensor");
  Tensor t = Tensor::empty(*this, host.dtype(), host.shape());
  if (t.nbytes()) copy(t.data(), host.data(), t.nbytes(), CopyKind::kHostToDevice);
  return t;
}

Tensor Backend::to_host(const Tensor& dev, Allocator& host_alloc) {
  PACKMOE_CHECK(dev.device() == device(), "to_host expects a tensor of this backend");
  Tensor t = Tensor::empty(host_alloc, dev.dtype(), dev.shape());
  if (t.nbytes()) copy(t.data(), dev.data(), t.nbytes(), CopyKind::kDeviceToHost);
  return t;
}

}  // namespace packmoe
