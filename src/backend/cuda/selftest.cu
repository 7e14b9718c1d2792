// Exhaustive GPU self-test of the hardware FP8 conversion against the shared software codec.
// Invariant: cuda_fp8_hw_conversion_ok is true only if all 2^32 FP32 inputs give the bytes of
// mxfp8_encode; the MXFP8 kernels consult it, so a mismatching device silently costs speed, never
// correctness.
#include <cuda_runtime.h>

#include <mutex>

#include "backend/cuda/kernels_common.cuh"
#include "backend/cuda/selftest.h"
#include "formats/mxfp8_math.h"

namespace packmoe {
namespace {

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int kBlocksPerSm = 8;
};

// Thread t checks inputs t, t + stride, ... The low half of each cvt gets y, the high half
// y ^ 0x80000000, so each half sees every bit pattern once. `one` is a run-time 1.0f, so the
// compiler cannot fold the multiply the kernels do (x * q) away.
template <DType kEl>
__global__ void __launch_bounds__(Config::kThreads)
    fp8_codec_sweep(float one, unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t local = 0;
  uint32_t local_first = 0xFFFFFFFFu;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < (1ull << 32);
       b += stride) {
    const uint32_t lo_bits = static_cast<uint32_t>(b);
    const uint32_t hi_bits = lo_bits ^ 0x80000000u;
    const float lo = __uint_as_float(lo_bits);
    const float hi = __uint_as_float(hi_bits);
    const uint32_t hw = cuda::cvt_fp8x2<kEl == DType::kE5M2>(lo * one, hi * one);
    const uint32_t sw_lo = mxfp8_encode(lo, one, kEl);
    const uint32_t sw_hi = mxfp8_encode(hi, one, kEl);
    if ((hw & 0xFFu) != sw_lo) {
      ++local;
      local_first = min(local_first, lo_bits);
    }
    if ((hw >> 8) != sw_hi) {
      ++local;
      local_first = min(local_first, hi_bits);
    }
  }
  if (local) {
    atomicAdd(mismatches, static_cast<unsigned long long>(local));
    atomicMin(first, local_first);
  }
}

}  // namespace

uint64_t cuda_count_fp8_codec_mismatches(DType element, uint32_t* first_mismatch) {
  PACKMOE_CHECK(element == DType::kE4M3 || element == DType::kE5M2,
                "FP8 self-test of " << dtype_name(element));
  Result<Backend*> backend = cuda_backend_instance();
  PACKMOE_CHECK(backend.is_ok(), backend.status().message());
  CudaBackend& be = static_cast<CudaBackend&>(*backend.value());

  struct Counters {
    unsigned long long mismatches;
    uint32_t first;
  };
  auto* d = static_cast<Counters*>(be.allocate(sizeof(Counters)));
  const Counters init{0, 0xFFFFFFFFu};
  be.copy(d, &init, sizeof(init), Backend::CopyKind::kHostToDevice);
  const unsigned blocks = static_cast<unsigned>(be.sm_count() * Config::kBlocksPerSm);
  if (element == DType::kE5M2)
    fp8_codec_sweep<DType::kE5M2>
        <<<blocks, Config::kThreads, 0, be.stream()>>>(1.0f, &d->mismatches, &d->first);
  else
    fp8_codec_sweep<DType::kE4M3>
        <<<blocks, Config::kThreads, 0, be.stream()>>>(1.0f, &d->mismatches, &d->first);
  PACKMOE_CUDA_CHECK_LAUNCH();
  Counters result{};
  be.copy(&result, d, sizeof(result), Backend::CopyKind::kDeviceToHost);
  be.deallocate(d);
  if (first_mismatch) *first_mismatch = result.first;
  return result.mismatches;
}

bool cuda_fp8_hw_conversion_ok(CudaBackend& be, DType element) {
  // Once per process and element type (about 10-20 ms each on an H200).
  static std::once_flag once[2];
  static bool ok[2] = {false, false};
  const int i = element == DType::kE5M2 ? 1 : 0;
  std::call_once(once[i], [&] { ok[i] = cuda_count_fp8_codec_mismatches(element) == 0; });
  return ok[i];
}

}  // namespace packmoe
