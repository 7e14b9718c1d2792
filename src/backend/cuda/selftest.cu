// GPU self-tests of the fast conversions against the shared software codecs: the hardware FP8
// cvt (all 2^32 FP32 inputs), the E2M1 encoders and value forms, the hardware BF16 rounding (one
// and two values per cvt), the RHT's scaling FMA of kernels_common.cuh (all 2^32 FP32 products; SR
// with two random bytes per input that together take every value 256 times), the hardware E4M3
// decode (all 256 codes), and the branch-free E8M0 scale code (every amax >= 0).
// Invariant: cuda_fp8_hw_conversion_ok / cuda_nvfp4_fast_codecs_ok are true only if no byte
// differs; the kernels consult them, so a mismatching device costs speed (with one warning line
// on stderr), never correctness.
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <string>

#include "backend/cuda/grouped_gemm_sm90_convert.cuh"  // f32x2_to_bf16x2
#include "backend/cuda/kernels_common.cuh"
#include "backend/cuda/selftest.h"
#include "formats/mxfp8_math.h"
#include "formats/nvfp4_math.h"  // rht16_scaled

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

// Thread t checks products y = bits * one for bits = t, t + stride, ...: e2m1_rn_fast against
// f32_to_e2m1 and e2m1_sr_fast against f32_to_e2m1_sr with random bytes r and r ^ 0x80, r taken
// from the top byte of a multiplicative hash of the input (so every r meets ~2^24 inputs of every
// binade), the rounded magnitudes of e2m1_rn_round / e2m1_sr_round and the signed values of
// e2m1_rn_value / e2m1_sr_value against the codes' values; the BF16 roundings and the RHT scaling
// of y; and the low byte's E4M3 decode once per code. The multiply by a run-time 1.0f is the
// kernels' x * r: NaNs become the canonical NaN.
__global__ void __launch_bounds__(Config::kThreads)
    e2m1_codec_sweep(float one, unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t local = 0;
  uint32_t local_first = 0xFFFFFFFFu;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < (1ull << 32);
       b += stride) {
    const uint32_t bits = static_cast<uint32_t>(b);
    const float y = __uint_as_float(bits) * one;
    const uint32_t r1 = (bits * 0x9E3779B1u) >> 24;
    // Equal bits, or both NaN.
    auto same = [](float u, float v) { return __float_as_uint(u) == __float_as_uint(v) || (u != u && v != v); };
    const uint8_t rn = f32_to_e2m1(y);
    bool bad = cuda::e2m1_rn_fast(y) != rn;
    // The rounded magnitude (a + M) - M the quantizer's BF16 values come from, and the signed one.
    const cuda::E2m1Rounded e = cuda::e2m1_rn_round(y);
    bad |= __uint_as_float(e.sum) - e.m != e2m1_to_f32(rn & 7u);
    bad |= __float_as_uint(cuda::e2m1_rn_value(y)) != __float_as_uint(e2m1_to_f32(rn));
#pragma unroll
    for (uint32_t flip = 0; flip <= 0x80u; flip += 0x80u) {
      const uint8_t sr = f32_to_e2m1_sr(y, static_cast<uint8_t>(r1 ^ flip));
      bad |= cuda::e2m1_sr_fast(y, r1 ^ flip) != sr;
      const cuda::E2m1Rounded s = cuda::e2m1_sr_round(y, r1 ^ flip);
      bad |= __uint_as_float(s.sum & ~0xFFu) - s.m != e2m1_to_f32(sr & 7u);
      bad |= __float_as_uint(cuda::e2m1_sr_value(y, r1 ^ flip)) != __float_as_uint(e2m1_to_f32(sr));
    }
    // BF16 rounding of the RHT outputs, one and two per cvt; the RHT's scaling as one FMA.
    const float sb = bf16_to_f32(f32_to_bf16(y));
    bad |= !same(cuda::round_bf16_hw(y), sb);
    const uint32_t pair = gemm_convert::f32x2_to_bf16x2(y, -y);
    bad |= !same(__uint_as_float(pair << 16), sb);
    bad |= !same(__uint_as_float(pair & 0xFFFF0000u), bf16_to_f32(f32_to_bf16(-y)));
    bad |= !same(cuda::rht16_scaled_fma(y), rht16_scaled(y));
    if (bits < 256u) bad |= !same(cuda::e4m3_to_f32_hw(bits), e4m3_to_f32(static_cast<uint8_t>(bits)));
    if (bad) {
      ++local;
      local_first = min(local_first, bits);
    }
  }
  if (local) {
    atomicAdd(mismatches, static_cast<unsigned long long>(local));
    atomicMin(first, local_first);
  }
}

// Every amax >= 0 that is not NaN (bit patterns 0 .. 0x7F800000, Inf included), for both FP8
// elements: e8m0_code_fast / e8m0_rcp_fast against mxfp8_scale_code / e8m0_reciprocal.
__global__ void __launch_bounds__(Config::kThreads)
    e8m0_scale_sweep(unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t local = 0;
  uint32_t local_first = 0xFFFFFFFFu;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b <= 0x7F800000ull; b += stride) {
    const uint32_t bits = static_cast<uint32_t>(b);
    const float amax = __uint_as_float(bits);
    bool bad = false;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const DType el = e ? DType::kE5M2 : DType::kE4M3;
      const uint32_t code = cuda::e8m0_code_fast(amax * mxfp8_max_norm_rcp(el));
      const uint8_t ref = mxfp8_scale_code(amax, el);
      bad |= code != ref;
      bad |= __float_as_uint(cuda::e8m0_rcp_fast(code)) != __float_as_uint(e8m0_reciprocal(ref));
    }
    if (bad) {
      ++local;
      local_first = min(local_first, bits);
    }
  }
  if (local) {
    atomicAdd(mismatches, static_cast<unsigned long long>(local));
    atomicMin(first, local_first);
  }
}

struct Counters {
  unsigned long long mismatches;
  uint32_t first;
};

// Runs `launch(counters)` on the backend's stream and returns the counters.
template <typename F>
Counters run_sweep(CudaBackend& be, F&& launch) {
  auto* d = static_cast<Counters*>(be.allocate(sizeof(Counters)));
  const Counters init{0, 0xFFFFFFFFu};
  be.copy(d, &init, sizeof(init), Backend::CopyKind::kHostToDevice);
  launch(d);
  PACKMOE_CUDA_CHECK_LAUNCH();
  Counters result{};
  be.copy(&result, d, sizeof(result), Backend::CopyKind::kDeviceToHost);
  be.deallocate(d);
  return result;
}

CudaBackend& the_backend() {
  Result<Backend*> backend = cuda_backend_instance();
  PACKMOE_CHECK(backend.is_ok(), backend.status().message());
  return static_cast<CudaBackend&>(*backend.value());
}

}  // namespace

uint64_t cuda_count_e2m1_codec_mismatches(uint32_t* first_mismatch) {
  CudaBackend& be = the_backend();
  const unsigned blocks = static_cast<unsigned>(be.sm_count() * Config::kBlocksPerSm);
  const Counters result = run_sweep(be, [&](Counters* d) {
    e2m1_codec_sweep<<<blocks, Config::kThreads, 0, be.stream()>>>(1.0f, &d->mismatches,
                                                                   &d->first);
  });
  if (first_mismatch) *first_mismatch = result.first;
  return result.mismatches;
}

uint64_t cuda_count_e8m0_scale_mismatches(uint32_t* first_mismatch) {
  CudaBackend& be = the_backend();
  const unsigned blocks = static_cast<unsigned>(be.sm_count() * Config::kBlocksPerSm);
  const Counters result = run_sweep(be, [&](Counters* d) {
    e8m0_scale_sweep<<<blocks, Config::kThreads, 0, be.stream()>>>(&d->mismatches, &d->first);
  });
  if (first_mismatch) *first_mismatch = result.first;
  return result.mismatches;
}

uint64_t cuda_count_fp8_codec_mismatches(DType element, uint32_t* first_mismatch) {
  PACKMOE_CHECK(element == DType::kE4M3 || element == DType::kE5M2,
                "FP8 self-test of " << dtype_name(element));
  CudaBackend& be = the_backend();
  const unsigned blocks = static_cast<unsigned>(be.sm_count() * Config::kBlocksPerSm);
  const Counters result = run_sweep(be, [&](Counters* d) {
    if (element == DType::kE5M2)
      fp8_codec_sweep<DType::kE5M2>
          <<<blocks, Config::kThreads, 0, be.stream()>>>(1.0f, &d->mismatches, &d->first);
    else
      fp8_codec_sweep<DType::kE4M3>
          <<<blocks, Config::kThreads, 0, be.stream()>>>(1.0f, &d->mismatches, &d->first);
  });
  if (first_mismatch) *first_mismatch = result.first;
  return result.mismatches;
}

bool cuda_fp8_hw_conversion_ok(CudaBackend& be, DType element) {
  // Once per process and element type (about 10-20 ms each on an H200).
  static std::once_flag once[2];
  static bool ok[2] = {false, false};
  const int i = element == DType::kE5M2 ? 1 : 0;
  std::call_once(once[i], [&] {
    uint32_t first = 0;
    const uint64_t n = cuda_count_fp8_codec_mismatches(element, &first);
    ok[i] = n == 0;
    if (!ok[i])
      std::fprintf(stderr,
                   "packmoe: warning: on %s the hardware FP32->%s conversion differs from the "
                   "software codec for %llu inputs (first 0x%08x); the MXFP8 and NVFP4 kernels "
                   "use the slower software codec instead\n",
                   be.name().c_str(), std::string(dtype_name(element)).c_str(),
                   static_cast<unsigned long long>(n),
                   first);
  });
  return ok[i];
}

bool cuda_mxfp8_fast_scale_ok(CudaBackend& be) {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [&] {
    uint32_t first = 0;
    const uint64_t n = cuda_count_e8m0_scale_mismatches(&first);
    if (n != 0)
      std::fprintf(stderr,
                   "packmoe: warning: on %s the fast E8M0 scale code differs from the software "
                   "codec for %llu amax values (first 0x%08x); the MXFP8 kernels use the slower "
                   "software codec instead\n",
                   be.name().c_str(), static_cast<unsigned long long>(n), first);
    ok = n == 0;
  });
  return ok;
}

bool cuda_nvfp4_fast_codecs_ok(CudaBackend& be) {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [&] {
    uint32_t first = 0;
    const uint64_t n = cuda_count_e2m1_codec_mismatches(&first);
    if (n != 0)
      std::fprintf(stderr,
                   "packmoe: warning: on %s the fast E2M1 encoders differ from the software codec "
                   "for %llu inputs (first 0x%08x); the NVFP4 kernels use the slower software "
                   "codec instead\n",
                   be.name().c_str(), static_cast<unsigned long long>(n), first);
    ok = n == 0;
  });
  // The NVFP4 kernels use the hardware E4M3 cvt for their block scales under the same flag.
  return ok && cuda_fp8_hw_conversion_ok(be, DType::kE4M3);
}

}  // namespace packmoe
