// Probe (not part of the build): how many MXFP8 E4M3 elements per clock an SM turns into scaled
// BF16, for the conversion sequences a fused GEMM loader could use (docs/gemm-sm90.md, "Next").
// Data stays in registers, so only the conversion itself is timed. Sequences:
//   cvt   the exact sequence of grouped_gemm_sm90_convert.cuh (e4m3x2 -> f16x2, two f16 -> f32,
//         two FMUL by 2^(s - 127), bf16x2 pack)
//   f16   the e4m3x2 -> f16x2 cvt alone
//   int   an integer re-bias for normal codes and zeros (PRMT, shifts, IADD, LOP3); its bytes are
//         checked against `cvt` for every code and every scale code 7..246, where it applies
//   loop  the loop alone (three integer instructions per pair: feedback and the XOR sink)
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++20 --fmad=false -gencode=arch=compute_90a,code=sm_90a -I src \
//     tools/probes/fp8_convert_rate.cu -o /tmp/probe && /tmp/probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "backend/cuda/grouped_gemm_sm90_convert.cuh"

namespace {

constexpr int kThreads = 256, kChains = 8, kIters = 4096;

__device__ __forceinline__ float scale_of(uint32_t code) { return __uint_as_float(code << 23); }

// Two E4M3 codes (low byte first) of a normal or zero magnitude times 2^(code - 127), for codes
// 7..246, as BF16x2: exponent field e + code - 7, mantissa m << 4, sign kept, zero kept.
__device__ __forceinline__ uint32_t int_rebias(uint32_t pair, uint32_t bias2) {
  uint32_t v;
  asm("prmt.b32 %0, %1, 0, 0x4140;" : "=r"(v) : "r"(pair));  // bytes to the two 16-bit lanes
  const uint32_t mag = v & 0x007F007Fu;
  const uint32_t nz = ((mag + 0x007F007Fu) >> 7) & 0x00010001u;  // 1 where the magnitude is not 0
  const uint32_t r = ((mag << 4) + bias2) & (nz * 0xFFFFu);
  return r | ((v << 8) & 0x80008000u);
}

template <int kVariant>
__global__ void __launch_bounds__(kThreads) convert_loop(uint32_t seed, uint32_t code, uint32_t* sink) {
  uint32_t x[kChains], acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) x[c] = (seed * (threadIdx.x + 1) + 0x9E3779B9u * c) & 0x3F3F3F3Fu;
  const float sc = scale_of(code);
  const uint32_t bias = (code - 7) << 7, bias2 = bias | (bias << 16);
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      uint32_t y;
      if constexpr (kVariant == 0)
        y = packmoe::gemm_convert::fp8x2_scaled_to_bf16x2<false>(x[c], sc);
      else if constexpr (kVariant == 1)
        y = packmoe::gemm_convert::fp8x2_to_f16x2<false>(x[c]);
      else if constexpr (kVariant == 2)
        y = int_rebias(x[c], bias2);
      else
        y = x[c] * 3u;
      acc ^= y;
      x[c] = (x[c] + y) & 0x3F3F3F3Fu;  // the next input depends on this output
    }
  }
  if (acc == 0x12345678u) sink[threadIdx.x] = acc;  // keeps the work alive
}

// Every E4M3 pair (a, b) with normal or zero magnitudes, every scale code 7..246: `int` == `cvt`.
__global__ void check_int(uint32_t* mismatches) {
  const uint32_t code = 7 + blockIdx.x;  // 240 blocks
  const float sc = scale_of(code);
  const uint32_t bias = (code - 7) << 7, bias2 = bias | (bias << 16);
  for (uint32_t p = threadIdx.x; p < 65536; p += blockDim.x) {
    const uint32_t a = p & 0xFF, b = p >> 8;
    auto ok = [](uint32_t c) { return (c & 0x7F) == 0 || ((c & 0x78) != 0 && (c & 0x7F) != 0x7F); };
    if (!ok(a) || !ok(b)) continue;  // subnormals and NaN take the exact fallback
    if (int_rebias(p, bias2) != packmoe::gemm_convert::fp8x2_scaled_to_bf16x2<false>(p, sc))
      atomicAdd(mismatches, 1u);
  }
}

template <int kVariant>
double elements_per_clock_per_sm(int sms, int clock_khz, uint32_t* sink) {
  const int blocks = sms * 8;
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  convert_loop<kVariant><<<blocks, kThreads>>>(1, 130, sink);  // warm-up
  cudaEventRecord(t0);
  convert_loop<kVariant><<<blocks, kThreads>>>(7, 130, sink);
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  const double elements = 2.0 * blocks * kThreads * kChains * kIters;
  return elements / (ms * 1e-3 * clock_khz * 1e3 * sms);
}

}  // namespace

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  uint32_t* d = nullptr;
  cudaMalloc(&d, 4096);
  cudaMemset(d, 0, 4096);
  check_int<<<240, 256>>>(d);
  uint32_t mism = 0;
  cudaMemcpy(&mism, d, 4, cudaMemcpyDeviceToHost);
  std::printf("int re-bias vs cvt sequence: %u mismatching pairs (normal and zero codes, scale codes 7..246)\n", mism);
  std::printf("elements per clock per SM at the %d MHz rated clock (%d SMs):\n", clock_khz / 1000, sms);
  std::printf("  cvt sequence (exact, the pre-pass's)  %.2f\n", elements_per_clock_per_sm<0>(sms, clock_khz, d));
  std::printf("  e4m3x2 -> f16x2 cvt alone             %.2f\n", elements_per_clock_per_sm<1>(sms, clock_khz, d));
  std::printf("  integer re-bias (normals and zeros)   %.2f\n", elements_per_clock_per_sm<2>(sms, clock_khz, d));
  std::printf("  loop alone                            %.2f\n", elements_per_clock_per_sm<3>(sms, clock_khz, d));
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "probe: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return mism == 0 ? 0 : 1;
}
