// CPU backend: 64-byte aligned host memory (the op table is backend/cpu/cpu_kernels.cpp).
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>


namespace packmoe {

// The process-wide CPU backend (base code such as nn/ and io/ allocates host memory from it).
Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

void* CpuBackend::allocate(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  PACKMOE_CHECK(p != nullptr, "out of host memory allocating " << bytes << " bytes");
  return p;
}

void CpuBackend::deallocate(void* ptr) { std::free(ptr); }

void CpuBackend::copy(void* dst, const void* src, size_t bytes, CopyKind) {
  if (bytes) std::memcpy(dst, src, bytes);
}

void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

double CpuBackend::time_ms(const std::function<void()>& body, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) body();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    body();
    auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

}  // namespace packmoe
