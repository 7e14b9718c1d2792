// A random LM-head + cross-entropy case on any backend, and its unfused FP64 reference: logits
// (T, V) = h W^T on the BF16 values as reals, the softmax, the mean loss over the non-ignored
// targets, dlogits = (p - onehot) * loss_scale / n, dh = dlogits W, dW = dlogits^T h. Shared by
// tests/unit/test_lm_head_loss.cpp (CPU) and tests/cuda/test_cuda_lm_head_loss.cpp.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/grouped_param.h"
#include "nn/lm_head_loss.h"

namespace packmoe::lm_head_case {

struct Case {
  int64_t T = 0, V = 0, H = 0;
  std::vector<float> w;          // (V, H) F32 init (its BF16 rounding is the GEMM weight)
  std::vector<uint16_t> h;       // (T, H) BF16
  std::vector<int32_t> targets;  // (T), -100 ignored
  std::vector<float> grad0;      // (V, H) main_grad before the call
  float loss_scale = 0.5f;
};

inline Case random_case(std::mt19937& rng, int64_t T, int64_t V, int64_t H, double ignored) {
  Case c;
  c.T = T;
  c.V = V;
  c.H = H;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(V - 1));
  for (int64_t i = 0; i < V * H; ++i) c.w.push_back(n(rng) * 0.3f);
  for (int64_t i = 0; i < T * H; ++i) c.h.push_back(f32_to_bf16(n(rng)));
  for (int64_t t = 0; t < T; ++t) c.targets.push_back(u(rng) < ignored ? -100 : id(rng));
  for (int64_t i = 0; i < V * H; ++i) c.grad0.push_back(n(rng) * 1e-2f);
  return c;
}

struct Reference {
  double loss = 0;
  std::vector<double> dh;  // (T, H)
  std::vector<double> dw;  // (V, H), grad0 not included
};

inline Reference reference(const Case& c) {
  const int64_t T = c.T, V = c.V, H = c.H;
  std::vector<double> w(V * H), h(T * H);
  for (int64_t i = 0; i < V * H; ++i) w[i] = bf16_to_f32(f32_to_bf16(c.w[i]));
  for (int64_t i = 0; i < T * H; ++i) h[i] = bf16_to_f32(c.h[i]);
  int64_t n = 0;
  for (int32_t t : c.targets) n += t != -100;
  Reference r;
  r.dh.assign(T * H, 0.0);
  r.dw.assign(V * H, 0.0);
  std::vector<double> z(V);
  for (int64_t t = 0; t < T; ++t) {
    if (c.targets[t] == -100) continue;
    double m = -INFINITY;
    for (int64_t e = 0; e < V; ++e) {
      double s = 0;
      for (int64_t k = 0; k < H; ++k) s += h[t * H + k] * w[e * H + k];
      z[e] = s;
      m = std::max(m, s);
    }
    double sum = 0;
    for (int64_t e = 0; e < V; ++e) sum += std::exp(z[e] - m);
    r.loss += std::log(sum) + m - z[c.targets[t]];
    for (int64_t e = 0; e < V; ++e) {
      const double d = (std::exp(z[e] - m) / sum - (e == c.targets[t] ? 1.0 : 0.0)) * c.loss_scale /
                       static_cast<double>(n);
      for (int64_t k = 0; k < H; ++k) {
        r.dh[t * H + k] += d * w[e * H + k];
        r.dw[e * H + k] += d * h[t * H + k];
      }
    }
  }
  if (n > 0) r.loss /= static_cast<double>(n);
  return r;
}

// The head param of a case on `b`, main_grad = grad0.
inline std::unique_ptr<GroupedParam> make_head(Backend& b, const Case& c) {
  Tensor init =
      Tensor::view(const_cast<float*>(c.w.data()), DType::kF32, {1, c.V, c.H}, Device::kCPU);
  auto p = std::make_unique<GroupedParam>(b, QuantRecipe{Recipe::kBF16, false, 0},
                                          PrimaryWeight::kHighPrecision, Layout::kSingle, init);
  b.copy(p->main_grad().group(0), c.grad0.data(), c.grad0.size() * sizeof(float),
         Backend::CopyKind::kHostToDevice);
  return p;
}

// What one lm_head_loss call produced, as host bytes.
struct HeadRun {
  float loss = 0;
  int64_t valid = 0;
  std::vector<float> dh;  // (T, H), training
  std::vector<float> dw;  // (V, H): main_grad after the call
};

inline std::vector<float> floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / sizeof(float));
  std::memcpy(f.data(), bytes.data(), bytes.size());
  return f;
}

inline HeadRun run_head(Backend& b, const Case& c, bool train, const LmHeadChunking& chunking) {
  auto head = make_head(b, c);
  const Tensor h = b.to_device(
      Tensor::view(const_cast<uint16_t*>(c.h.data()), DType::kBF16, {c.T, c.H}, Device::kCPU));
  Result<LmHeadLoss> r = lm_head_loss(
      *head, h, c.targets, train ? std::optional<float>(c.loss_scale) : std::nullopt, chunking);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  HeadRun out;
  if (!r.is_ok()) return out;
  out.loss = r.value().loss;
  out.valid = r.value().valid;
  if (train) {
    std::vector<float> dh(c.T * c.H);
    b.copy(dh.data(), r.value().dh.data(), dh.size() * sizeof(float),
           Backend::CopyKind::kDeviceToHost);
    out.dh = std::move(dh);
  }
  out.dw = floats(head->main_grad().download());
  return out;
}

// ||a - ref|| / ||ref|| (Frobenius); `base` is subtracted from a first (main_grad's old value).
inline double rel_error(const std::vector<float>& a, const std::vector<double>& ref,
                        const std::vector<float>* base = nullptr) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = static_cast<double>(a[i]) - (base ? (*base)[i] : 0.0);
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

inline bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline bool same_bytes(const HeadRun& a, const HeadRun& b) {
  return std::memcmp(&a.loss, &b.loss, sizeof(float)) == 0 && same_bytes(a.dh, b.dh) &&
         same_bytes(a.dw, b.dw);
}

}  // namespace packmoe::lm_head_case
