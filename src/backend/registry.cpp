// The process-wide backend per device (the CPU one lives in cpu_backend.cpp, in packmoe_base). The CUDA backend is linked only in CUDA builds; this file
// reaches it through one factory function so host code never includes CUDA headers.
#include "backend/cpu/cpu_backend.h"

namespace packmoe {

#if defined(PACKMOE_WITH_CUDA)
// Defined in backend/cuda/cuda_backend.cu: the backend of the current GPU, or an error when no
// GPU is usable.
Result<Backend*> cuda_backend_instance();
#endif

Result<Backend*> get_backend(Device device) {
  if (device == Device::kCPU) return &cpu_backend();
#if defined(PACKMOE_WITH_CUDA)
  return cuda_backend_instance();
#else
  return Status::error("this packmoe was built without CUDA (configure with -DPACKMOE_CUDA=ON)");
#endif
}

bool cuda_available() { return get_backend(Device::kCUDA).is_ok(); }

}  // namespace packmoe
