// The init ops on CUDA (backend/ops/init.h) against the CPU reference: every element within
// kInitNormalMaxUlp FP32 ulps of the CPU's (CUDA's FP64 log / sin / cos differ from glibc's in the
// last FP64 bits only), the number of elements that differ at all printed and bounded; two runs
// bitwise equal; an unaligned output (the scalar store path) gives the same bytes as an aligned
// one; random_model_weights on the device against the host's, parameter by parameter. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/init.h"
#include "nn/model.h"
#include "common/cuda_vs_cpu.h"
#include "train/model_config.h"

namespace packmoe {
namespace {

int64_t ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  // Map the sign-magnitude bits onto a monotone integer line.
  const int64_t la = ia < 0 ? -static_cast<int64_t>(ia & 0x7FFFFFFF) : ia;
  const int64_t lb = ib < 0 ? -static_cast<int64_t>(ib & 0x7FFFFFFF) : ib;
  return la > lb ? la - lb : lb - la;
}

std::vector<float> download(Backend& gpu, const float* dev, int64_t n) {
  std::vector<float> out(n);
  gpu.copy(out.data(), dev, n * sizeof(float), Backend::CopyKind::kDeviceToHost);
  gpu.synchronize();
  return out;
}

struct Diff {
  int64_t differ = 0;
  int64_t max_ulp = 0;
};

Diff compare(const std::vector<float>& cuda, const float* cpu, int64_t n) {
  Diff d;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t u = ulp_distance(cuda[i], cpu[i]);
    d.differ += u != 0;
    d.max_ulp = std::max(d.max_ulp, u);
  }
  return d;
}

TEST(CudaInit, NormalWithinTheBoundOfTheCpuAndDeterministic) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const int64_t n = (int64_t{1} << 24) + 3;  // odd: the last draw gives one element
  Tensor dev = Tensor::empty(*gpu, DType::kF32, {n + 1});
  int64_t total = 0, differ = 0;
  for (uint32_t stream : {0u, 1u, 17u, 4000000000u}) {
    InitNormalArgs a;
    a.seed = 1234 + stream;
    a.stream = stream;
    a.stddev = 0.02;
    a.n = n;
    std::vector<float> cpu(n);
    a.out = cpu.data();
    ASSERT_TRUE(ops::init_normal(cpu_backend(), a).is_ok());
    a.out = dev.data_as<float>();
    ASSERT_TRUE(ops::init_normal(*gpu, a).is_ok());
    const std::vector<float> first = download(*gpu, a.out, n);
    const Diff d = compare(first, cpu.data(), n);
    EXPECT_LE(d.max_ulp, kInitNormalMaxUlp) << "stream " << stream;
    total += n;
    differ += d.differ;
    // A second run, then one into an unaligned output (scalar stores): the same bytes.
    ASSERT_TRUE(ops::init_normal(*gpu, a).is_ok());
    EXPECT_EQ(std::memcmp(download(*gpu, a.out, n).data(), first.data(), n * 4), 0);
    a.out = dev.data_as<float>() + 1;
    ASSERT_TRUE(ops::init_normal(*gpu, a).is_ok());
    EXPECT_EQ(std::memcmp(download(*gpu, a.out, n).data(), first.data(), n * 4), 0);
  }
  std::printf("[cuda init] %lld of %lld elements differ from the CPU's (each by <= %d ulp)\n",
              static_cast<long long>(differ), static_cast<long long>(total), kInitNormalMaxUlp);
  // Expected about 1e-8 of them (a difference of a few FP64 ulps flips the FP32 rounding only
  // that close to a rounding midpoint); far more means another formula on the device.
  EXPECT_LE(differ, total / 100000);
}

TEST(CudaInit, ModelWeightsOnTheDeviceMatchTheHost) {
  PACKMOE_SKIP_WITHOUT_GPU();
  ModelConfig c = train::model_config_preset("small").value();
  const ModelWeights host = random_model_weights(c, 77);
  const ModelWeights dev = random_model_weights(*gpu, c, 77);
  ASSERT_TRUE(validate_model_weights(c, dev, Device::kCUDA).is_ok());
  int64_t total = 0, differ = 0;
  for (const ParamSpec& spec : model_param_specs(c)) {
    const Tensor& h = host.at(spec.name);
    const Tensor& d = dev.at(spec.name);
    ASSERT_EQ(d.device(), Device::kCUDA) << spec.name;
    const Diff diff = compare(download(*gpu, d.data_as<const float>(), d.numel()),
                              h.data_as<const float>(), h.numel());
    EXPECT_LE(diff.max_ulp, spec.init == ParamInit::kOnes ? 0 : kInitNormalMaxUlp) << spec.name;
    total += h.numel();
    differ += diff.differ;
  }
  std::printf("[cuda init] small preset: %lld of %lld parameters differ from the CPU's\n",
              static_cast<long long>(differ), static_cast<long long>(total));
  EXPECT_LE(differ, total / 100000);
}

}  // namespace
}  // namespace packmoe
