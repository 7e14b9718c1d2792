// Backend: one device's memory, copies, synchronisation and timing, plus the table of its op
// implementations (OpKernels). Ops are called through the entries of backend/ops/*.h, which
// validate once and dispatch here. CPU is the reference semantics; pointers passed to ops address
// this backend's memory.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "backend/ops/elementwise.h"
#include "backend/ops/gemm.h"
#include "backend/ops/init.h"
#include "backend/ops/model.h"
#include "backend/ops/moe.h"
#include "backend/ops/quantize.h"

namespace packmoe {

// The op families of one device, each a table of implementation functions (backend/ops/*.h).
struct OpKernels {
  const QuantizeKernels* quantize;
  const GemmKernels* gemm;
  const MoeKernels* moe;
  const ElementwiseKernels* elementwise;
  const ModelKernels* model;
  const InitKernels* init;
};

class Backend : public Allocator {
 public:
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"

  // ---- memory ------------------------------------------------------------------------------
  // Copies between host memory and this backend's memory (either side may be either).
  enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // This backend's memory: bytes in use now, bytes held from the device now, and the most ever
  // held (CUDA: the stream-ordered pool's reserve and its high-water mark, what nvidia-smi sees
  // of it). The CPU reports none.
  struct MemoryUse {
    size_t in_use = 0, reserved = 0, peak_reserved = 0;
  };
  virtual std::optional<MemoryUse> memory_use() const { return std::nullopt; }
  // Hands the memory that no live allocation uses back to the device (CUDA: waits for the stream,
  // then trims the pool), so a later large allocation does not sit beside freed blocks it cannot
  // reuse. Callers use it after freeing large start-up buffers. The CPU has nothing to return.
  virtual void release_unused_memory() {}

  // Median milliseconds of `body` over `iters` runs after `warmup` runs, measured with the
  // device's own clock (CUDA events on GPU).
  virtual double time_ms(const std::function<void()>& body, int warmup, int iters) = 0;

  // The implementations of every op on this device. Callers use the entries of backend/ops/*.h
  // (ops::grouped_gemm(backend, args), ...), which check the arguments once and call these.
  virtual const OpKernels& kernels() const = 0;

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
