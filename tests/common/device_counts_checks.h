// GroupedLinear with its token counts in the backend's memory (forward(x, m_device), what the MoE
// block does) against the same layer with host counts, on any backend: y's and dx's used rows and
// main_grad bitwise equal over two micro-batches (overwrite, then accumulate, an expert without
// tokens), in every recipe, with the wgrad direct or delayed. The device-count inputs carry spare
// capacity rows past the counts' sum filled with NaN, which no GEMM may read into a used row.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/grouped_linear.h"

namespace packmoe::testing {

inline constexpr int64_t kDcE = 4, kDcN = 128, kDcK = 64;

// (rows, cols) BF16 on the host: random in the first `used` rows, NaN after.
inline Tensor bf16_rows(std::mt19937& rng, int64_t rows, int64_t used, int64_t cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor t = Tensor::empty(cpu_backend(), DType::kBF16, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data_as<uint16_t>()[i] = i < used * cols ? f32_to_bf16(dist(rng)) : uint16_t{0x7FC0};
  return t;
}

// The first `rows` rows of a backend tensor, as host bytes.
inline std::vector<uint8_t> head_bytes(Backend& b, const Tensor& t, int64_t rows) {
  const size_t n = t.nbytes() / static_cast<size_t>(t.dim(0)) * static_cast<size_t>(rows);
  std::vector<uint8_t> out(n);
  if (n) b.copy(out.data(), t.data(), n, Backend::CopyKind::kDeviceToHost);
  return out;
}

inline void expect_device_counts_match_host(Backend& b, Recipe r, bool delay) {
  SCOPED_TRACE(std::string(recipe_name(r)) + (delay ? " delayed wgrad" : " direct wgrad"));
  std::mt19937 rng(41 + static_cast<int>(r) * 2 + (delay ? 1 : 0));
  GroupedLinearConfig cfg;
  cfg.recipe.recipe = r;
  cfg.recipe.sr_seed = 7;
  cfg.delay_wgrad = delay;
  Tensor init = Tensor::empty(cpu_backend(), DType::kF32, {kDcE, kDcN, kDcK});
  std::normal_distribution<float> dist(0.0f, 0.1f);
  for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = dist(rng);
  GroupedLinear host(b, cfg, init), device(b, cfg, init);
  host.param().create_master();
  device.param().create_master();
  const int64_t align = token_alignment(r);
  const std::vector<std::vector<int64_t>> micro = {{3, 0, 5, 2}, {1, 4, 0, 6}};  // x align
  GradAccum accum = GradAccum::kOverwrite;
  for (const std::vector<int64_t>& units : micro) {
    std::vector<int64_t> m;
    int64_t used = 0;
    for (int64_t u : units) m.push_back(u * align), used += u * align;
    const int64_t capacity = used + kDcE * align;  // spare rows, as routing_plan_max_rows leaves
    const Tensor x = bf16_rows(rng, capacity, used, kDcK);   // (C, K)
    const Tensor dy = bf16_rows(rng, capacity, used, kDcN);  // (C, N)
    const Tensor counts = b.to_device(
        Tensor::view(m.data(), DType::kI64, {kDcE}, Device::kCPU));  // (E,) I64
    host.set_grad_sr_offset(99);
    device.set_grad_sr_offset(99);

    const Tensor y_host = host.forward(
        b.to_device(Tensor::view(x.data(), DType::kBF16, {used, kDcK}, Device::kCPU)), m);
    const Tensor y_dev = device.forward(b.to_device(x), counts);
    ASSERT_EQ(y_dev.dim(0), capacity);
    EXPECT_TRUE(head_bytes(b, y_dev, used) == head_bytes(b, y_host, used)) << "y";

    const Tensor dx_host = host.backward(
        b.to_device(Tensor::view(dy.data(), DType::kBF16, {used, kDcN}, Device::kCPU)), accum);
    const Tensor dx_dev = device.backward(b.to_device(dy), accum);
    if (delay) {
      host.backward_dw();
      device.backward_dw();
    }
    EXPECT_TRUE(head_bytes(b, dx_dev, used) == head_bytes(b, dx_host, used)) << "dx";
    EXPECT_TRUE(host.param().main_grad().download() == device.param().main_grad().download())
        << "main_grad";
    accum = GradAccum::kAccumulate;
  }
}

}  // namespace packmoe::testing
