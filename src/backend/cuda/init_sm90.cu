// CUDA init ops (backend/ops/init.h): the normal init, one thread per Philox draw (grid-stride),
// and a constant fill. Invariant: every element goes through init_normal_pair, the CPU
// reference's formula (nvcc --fmad=false, IEEE sqrt), with CUDA's FP64 log / sin / cos: the same
// bytes on every run and launch shape, within kInitNormalMaxUlp of the CPU's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/ops/init.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 8;  // grid-stride: enough blocks to fill the GPU
};

unsigned grid_for(CudaBackend& be, int64_t items) {
  const int64_t wanted = (items + Config::kThreads - 1) / Config::kThreads;
  const int64_t cap = static_cast<int64_t>(be.sm_count()) * Config::kBlocksPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, cap)));
}

// The round keys travel in the parameters: no per-draw key schedule.
__global__ void __launch_bounds__(Config::kThreads)
    init_normal_kernel(const __grid_constant__ PhiloxKeys keys, uint32_t stream, double stddev,
                       float* out, int64_t n) {
  const int64_t pairs = (n + 1) / 2;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < pairs;
       j += step) {
    float even, odd;
    init_normal_pair(philox_draw(keys, static_cast<uint64_t>(j), stream), stddev, even, odd);
    if (2 * j + 1 < n && (reinterpret_cast<uintptr_t>(out) & 7u) == 0) {
      *reinterpret_cast<float2*>(out + 2 * j) = make_float2(even, odd);
    } else {
      out[2 * j] = even;
      if (2 * j + 1 < n) out[2 * j + 1] = odd;
    }
  }
}

__global__ void __launch_bounds__(Config::kThreads) fill_f32_kernel(float value, float* out,
                                                                    int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    out[i] = value;
}

}  // namespace

Status init_normal_sm90(CudaBackend& be, const InitNormalArgs& a) {
  if (a.n == 0) return Status::ok();
  init_normal_kernel<<<grid_for(be, (a.n + 1) / 2), Config::kThreads, 0, be.stream()>>>(
      philox_seed_keys(a.seed), a.stream, a.stddev, a.out, a.n);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status fill_f32_sm90(CudaBackend& be, const FillArgs& a) {
  if (a.n == 0) return Status::ok();
  fill_f32_kernel<<<grid_for(be, a.n), Config::kThreads, 0, be.stream()>>>(a.value, a.out, a.n);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
