// Parameter init ops, written straight into the backend's memory: the deterministic normal init
// (Philox stream + Box-Muller in FP64) and a constant fill. Invariant: element i of a normal init
// is a pure function of (seed, stream, i) (core/philox.h), so every thread count and launch shape
// of one backend give the same bytes. FP64 log / sin / cos come from the platform (glibc on the
// CPU, CUDA's libdevice on the GPU), which differ in the last FP64 bits only: the FP32 results of
// the two backends are equal or adjacent floats (kInitNormalMaxUlp; tests/cuda/test_cuda_init.cpp
// counts how many differ).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/hd.h"
#include "core/philox.h"
#include "core/status.h"

namespace packmoe {

// The largest distance, in FP32 ulps of the CPU value, between a CUDA and a CPU init element:
// each FP64 value differs by a few FP64 ulps (log <= 1, sin / cos <= 2 on CUDA, < 1 in glibc),
// far below half an FP32 ulp, so one rounding to FP32 moves it by at most one FP32 step.
inline constexpr int kInitNormalMaxUlp = 1;

// out[i], i < n, F32 in the backend's memory. Draw j = philox_draw(seed, j, stream) gives elements
// 2j and 2j + 1 (the last draw of an odd n gives one): with u0 = (v[0] + 1) / 2^32 and
// u1 = (v[1] + 1) / 2^32 in (0, 1] (never 0, so log is finite), in FP64, every operation in the
// order written (no FMA):
//   r = sqrt(-2 log u0), a = (2 pi) u1
//   out[2j] = f32(stddev * r * cos a), out[2j + 1] = f32(stddev * r * sin a)  (round to nearest)
struct InitNormalArgs {
  uint64_t seed = 0;
  uint32_t stream = 0;  // the model's init: the parameter's index in model_param_specs
  double stddev = 0;
  float* out = nullptr;  // (n) F32
  int64_t n = 0;
};

// Elements 2j and 2j + 1 of an InitNormalArgs init from draw j's bits (the one formula of both
// backends).
PACKMOE_HD void init_normal_pair(const Philox4& r, double stddev, float& even, float& odd) {
  constexpr double kTwoPi = 2.0 * 3.14159265358979323846;
  const double u0 = (static_cast<double>(r.v[0]) + 1.0) / 4294967296.0;
  const double u1 = (static_cast<double>(r.v[1]) + 1.0) / 4294967296.0;
  const double radius = sqrt(-2.0 * log(u0));
  const double angle = kTwoPi * u1;
  even = static_cast<float>(stddev * radius * cos(angle));
  odd = static_cast<float>(stddev * radius * sin(angle));
}

// out[i] = value for i < n (F32, the backend's memory).
struct FillArgs {
  float value = 0;
  float* out = nullptr;  // (n) F32
  int64_t n = 0;
};

Status validate_init_normal(const InitNormalArgs& a);
Status validate_fill(const FillArgs& a);

// CPU reference (host pointers; OpenMP over the draws).
Status init_normal_cpu(const InitNormalArgs& a);
Status fill_f32_cpu(const FillArgs& a);

// ---- entries: validate once, then run the backend's implementation (backend/ops/init.cpp) ----
class Backend;
namespace ops {
Status init_normal(Backend& b, const InitNormalArgs& a);
Status fill_f32(Backend& b, const FillArgs& a);
}  // namespace ops

// One device's implementation of the family (backend/cpu/cpu_kernels.cpp,
// backend/cuda/cuda_kernels.cu). Arguments arrive validated.
struct InitKernels {
  Status (*init_normal)(Backend&, const InitNormalArgs&);
  Status (*fill_f32)(Backend&, const FillArgs&);
};

}  // namespace packmoe
