// Backend helpers shared by every implementation.
#include "backend/backend.h"

namespace packmoe {

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
