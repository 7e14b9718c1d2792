// CPU backend: host memory, and the table of the reference implementations of every op (the
// *_cpu functions of backend/cpu/ and formats/; table in backend/cpu/cpu_kernels.cpp).
#pragma once

#include "backend/backend.h"

namespace packmoe {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr) override;
  std::string name() const override { return "cpu"; }

  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}
  double time_ms(const std::function<void()>& body, int warmup, int iters) override;

  const OpKernels& kernels() const override;
};

// CPU reference of the grouped GEMM (backend/cpu/grouped_gemm_cpu.cpp): dequantize tile by tile
// to FP32, multiply with OpenBLAS.
Status grouped_gemm_cpu(const GroupedGemmArgs& args);

}  // namespace packmoe
