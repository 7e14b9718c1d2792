// Forward of the dense decoder CPU ops (backend/ops/model.h) against hand-derived values:
// model_log_f32 against libm, RMSNorm of known vectors (its BF16 output against FP64 and the FP32
// output's RNE, its backward with a residual gradient added), RoPE (position 0 = identity, a
// 90-degree table, inverse = backward), attention (S = 1 returns v, causal mask, equal keys
// average v), cross-entropy (uniform logits = ln V, ignore index), thread-count independence,
// argument errors, and the residual stream's out-of-place add (backend/ops/elementwise.h).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/elementwise.h"
#include "backend/ops/model.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }

int64_t ulp_distance(float a, float b) {
  return std::llabs(static_cast<int64_t>(f32_bits(a)) - static_cast<int64_t>(f32_bits(b)));
}

std::vector<float> randn(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_error(const Status& s, const std::string& part) {
  ASSERT_FALSE(s.is_ok()) << "expected an error containing '" << part << "'";
  EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
}

// ---- model_log_f32 ------------------------------------------------------------------------------

TEST(ModelLog, CloseToLibmAndSpecialValues) {
  // Every 97th float in [2^-149, FLT_MAX]: <= 2 ulp from log rounded to FP32 (from FP64 log).
  int64_t worst = 0;
  for (uint32_t b = 1; b < 0x7F800000u; b += 97 * 1024 + 1) {
    const float x = f32_from_bits(b);
    const float want = static_cast<float>(std::log(static_cast<double>(x)));
    const float got = model_log_f32(x);
    if (want == 0.0f) {
      EXPECT_LE(std::fabs(got), 1e-7f);
      continue;
    }
    worst = std::max(worst, ulp_distance(got, want));
  }
  EXPECT_LE(worst, 2);
  EXPECT_EQ(model_log_f32(1.0f), 0.0f);
  EXPECT_EQ(ulp_distance(model_log_f32(2.0f), static_cast<float>(std::log(2.0))), 0);
  EXPECT_TRUE(std::isnan(model_log_f32(-1.0f)));
  EXPECT_TRUE(std::isnan(model_log_f32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(model_log_f32(0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(model_log_f32(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
}

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST(ModelOps, RmsNormKnownVectors) {
  // Row 0: (2, 2, 2, 2): mean square 4, rstd = 1/2 exactly, y = weight.
  // Row 1: (1, 2, 3, 4): mean square 30/4 = 7.5, y = x / sqrt(7.5) * weight.
  const std::vector<float> x = {2, 2, 2, 2, 1, 2, 3, 4}, w = {1, 1, 1, 2};
  std::vector<float> y(8), rstd(2);
  ASSERT_TRUE(rms_norm_cpu({2, 4, 0.0f, x.data(), w.data(), y.data(), rstd.data()}).is_ok());
  EXPECT_EQ(rstd[0], 0.5f);
  for (int d = 0; d < 4; ++d) EXPECT_EQ(y[d], w[d]);
  const double r = 1.0 / std::sqrt(7.5);
  EXPECT_NEAR(rstd[1], r, 1e-7);
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(y[4 + d], x[4 + d] * r * w[d], 1e-6);
  // eps enters under the root: x = 0 gives rstd = 1 / sqrt(eps), y = 0.
  const std::vector<float> z(4, 0.0f);
  ASSERT_TRUE(rms_norm_cpu({1, 4, 0.25f, z.data(), w.data(), y.data(), rstd.data()}).is_ok());
  EXPECT_EQ(rstd[0], 2.0f);
  EXPECT_EQ(y[0], 0.0f);
}

// Random rows (D = 1, odd, < 32 and not a multiple of 32; some rows all zero): the BF16 output is
// the RNE of the FP32 output bit for bit, rstd is the same, and both are within their rounding
// bounds of an FP64 evaluation of x / sqrt(mean(x^2) + eps) * w.
TEST(ModelOps, RmsNormBf16OutputIsRneOfF32) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  struct Case {
    int64_t N, D;
    float eps;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 1e-6f}, {9, 7, 1e-6f}, {33, 64, 1e-5f},
                                         {17, 100, 1e-6f}, {5, 257, 0.25f}}) {
    std::vector<float> x = randn(c.N * c.D, rng);
    for (int64_t d = 0; d < c.D && c.N > 3; ++d) x[3 * c.D + d] = 0.0f;
    std::vector<float> w = randn(c.D, rng);
    std::vector<float> y(c.N * c.D), rstd(c.N), rstd_b(c.N, -1.0f);
    std::vector<uint16_t> yb(c.N * c.D, 0xFFFF);
    ASSERT_TRUE(rms_norm_cpu({c.N, c.D, c.eps, x.data(), w.data(), y.data(), rstd.data()}).is_ok());
    RmsNormArgs a{c.N, c.D, c.eps, x.data(), w.data(), nullptr, rstd_b.data()};
    a.y_bf16 = yb.data();
    ASSERT_TRUE(rms_norm_cpu(a).is_ok());
    EXPECT_TRUE(same_bits(rstd, rstd_b));
    // FP32 path: R32 sum of D squares, /, +, sqrt, 1/, two products: well within 2^-16 relative
    // for D <= 257. BF16: that plus RNE to 8 significant bits (at most 2^-8 relative).
    const double f32_bound = std::ldexp(1.0, -16), bf16_bound = std::ldexp(1.0, -8) + f32_bound;
    int64_t bad_rne = 0, bad_f32 = 0, bad_bf16 = 0;
    for (int64_t r = 0; r < c.N; ++r) {
      double ss = 0.0;
      for (int64_t d = 0; d < c.D; ++d) ss += double(x[r * c.D + d]) * x[r * c.D + d];
      const double rs = 1.0 / std::sqrt(ss / double(c.D) + double(c.eps));
      for (int64_t d = 0; d < c.D; ++d) {
        const int64_t i = r * c.D + d;
        const double ref = double(x[i]) * rs * double(w[d]);
        bad_rne += yb[i] != f32_to_bf16(y[i]);
        bad_f32 += std::fabs(y[i] - ref) > f32_bound * std::fabs(ref);
        bad_bf16 += std::fabs(bf16_to_f32(yb[i]) - ref) > bf16_bound * std::fabs(ref);
      }
    }
    EXPECT_EQ(bad_rne, 0) << c.N << "x" << c.D;
    EXPECT_EQ(bad_f32, 0) << c.N << "x" << c.D;
    EXPECT_EQ(bad_bf16, 0) << c.N << "x" << c.D;
  }
}

// With dresidual the backward writes dresidual + (the dx it writes without), one FP32 add of
// the rounded dx, bit for bit, and the same dweight.
TEST(ModelOps, RmsNormBackwardAddsResidual) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const auto& [N, D] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {13, 33}, {300, 64}}) {
    const auto x = randn(N * D, rng), w = randn(D, rng), dy = randn(N * D, rng),
               dres = randn(N * D, rng);
    std::vector<float> y(N * D), rstd(N), dx(N * D), dw(D), dx_res(N * D), dw_res(D);
    ASSERT_TRUE(rms_norm_cpu({N, D, 1e-6f, x.data(), w.data(), y.data(), rstd.data()}).is_ok());
    ASSERT_TRUE(rms_norm_backward_cpu(
                    {N, D, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data()})
                    .is_ok());
    RmsNormBackwardArgs b{N,         D,         x.data(),      w.data(),
                          rstd.data(), dy.data(), dx_res.data(), dw_res.data()};
    b.dresidual = dres.data();
    ASSERT_TRUE(rms_norm_backward_cpu(b).is_ok());
    std::vector<float> want(N * D);
    for (int64_t i = 0; i < N * D; ++i) want[i] = dres[i] + dx[i];
    EXPECT_TRUE(same_bits(dx_res, want)) << N << "x" << D;
    EXPECT_TRUE(same_bits(dw_res, dw)) << N << "x" << D;
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST(ModelOps, RopeTableAndRotations) {
  const int64_t D = 8, half = 4;
  const std::vector<int32_t> pos = {0, 1, 5};
  std::vector<float> cs(3 * half), sn(3 * half);
  ASSERT_TRUE(rope_table({3, D, 10000.0, pos.data(), cs.data(), sn.data()}).is_ok());
  for (int i = 0; i < half; ++i) {
    EXPECT_EQ(cs[i], 1.0f);  // position 0: angle 0
    EXPECT_EQ(sn[i], 0.0f);
  }
  // i = 0: inv_freq = 1, so the angle is the position; i = 1: 10000^(-1/4) = 0.1.
  EXPECT_EQ(cs[half], static_cast<float>(std::cos(1.0)));
  EXPECT_EQ(sn[2 * half], static_cast<float>(std::sin(5.0)));
  EXPECT_NEAR(sn[half + 1], std::sin(0.1), 1e-7);

  std::mt19937 rng(fresh_seed());
  const std::vector<float> x = randn(3 * 2 * D, rng);  // (T = 3, heads = 2, D)
  std::vector<float> y(x.size()), back(x.size());
  ASSERT_TRUE(rope_cpu({3, 2, D, cs.data(), sn.data(), x.data(), y.data()}).is_ok());
  for (int i = 0; i < 2 * D; ++i) EXPECT_EQ(y[i], x[i]) << "position 0 is the identity";
  // Backward = inverse rotation: rope then rope_backward returns x up to rounding.
  ASSERT_TRUE(rope_backward_cpu({3, 2, D, cs.data(), sn.data(), y.data(), back.data()}).is_ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-6);

  // 90 degrees (cos 0, sin 1): dimension i takes -x[i + D/2], dimension i + D/2 takes x[i].
  const std::vector<float> c90(half, 0.0f), s90(half, 1.0f);
  const std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> r(8);
  ASSERT_TRUE(rope_cpu({1, 1, D, c90.data(), s90.data(), v.data(), r.data()}).is_ok());
  EXPECT_EQ(r, (std::vector<float>{-5, -6, -7, -8, 1, 2, 3, 4}));
  // In place is allowed.
  std::vector<float> inplace = v;
  ASSERT_TRUE(rope_cpu({1, 1, D, c90.data(), s90.data(), inplace.data(), inplace.data()}).is_ok());
  EXPECT_EQ(inplace, r);
}

// ---- attention ----------------------------------------------------------------------------------

struct AttnOut {
  std::vector<float> o, lse;  // o widened from its BF16 bits
};

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = f32_to_bf16(x[i]);
  return r;
}

std::vector<float> bf16_rounded(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return r;
}

AttnOut run_attention(const std::vector<float>& q, const std::vector<float>& k,
                      const std::vector<float>& v, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                      int64_t D, const std::vector<int32_t>& doc_start = {}) {
  const auto qb = to_bf16_bits(q), kb = to_bf16_bits(k), vb = to_bf16_bits(v);
  std::vector<uint16_t> o(B * S * Hq * D);
  AttnOut r{{}, std::vector<float>(B * Hq * S)};
  AttentionArgs a{B,         S,         Hq,        Hkv,
                  D,         0.5f,      qb.data(), kb.data(),
                  vb.data(), doc_start.empty() ? nullptr : doc_start.data(), o.data(), r.lse.data()};
  EXPECT_TRUE(attention_cpu(a).is_ok());
  for (uint16_t x : o) r.o.push_back(bf16_to_f32(x));
  return r;
}

struct AttnGrads {
  std::vector<float> dq, dk, dv;
};

AttnGrads run_attention_backward(const std::vector<float>& q, const std::vector<float>& k,
                                 const std::vector<float>& v, const AttnOut& f,
                                 const std::vector<float>& dout, int64_t B, int64_t S, int64_t Hq,
                                 int64_t Hkv, int64_t D,
                                 const std::vector<int32_t>& doc_start = {}) {
  const auto qb = to_bf16_bits(q), kb = to_bf16_bits(k), vb = to_bf16_bits(v),
             ob = to_bf16_bits(f.o), db = to_bf16_bits(dout);
  AttnGrads g{std::vector<float>(q.size()), std::vector<float>(k.size()),
              std::vector<float>(v.size())};
  AttentionBackwardArgs b{B,         S,         Hq,         Hkv,         D,
                          0.5f,      qb.data(), kb.data(),  vb.data(),   ob.data(),
                          f.lse.data(), doc_start.empty() ? nullptr : doc_start.data(),
                          db.data(), g.dq.data(), g.dk.data(), g.dv.data()};
  EXPECT_TRUE(attention_backward_cpu(b).is_ok());
  return g;
}

TEST(ModelOps, AttentionSingleTokenReturnsV) {
  std::mt19937 rng(fresh_seed());
  const int64_t B = 2, S = 1, Hq = 4, Hkv = 2, D = 5;
  const auto q = bf16_rounded(randn(B * Hq * D, rng)), k = bf16_rounded(randn(B * Hkv * D, rng));
  const auto v = bf16_rounded(randn(B * Hkv * D, rng));
  const AttnOut r = run_attention(q, k, v, B, S, Hq, Hkv, D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      double s = 0;  // one key: lse = its score 0.5 * q . k
      for (int64_t d = 0; d < D; ++d) s += double(q[(b * Hq + h) * D + d]) * k[(b * Hkv + h / 2) * D + d];
      EXPECT_NEAR(r.lse[b * Hq + h], 0.5 * s, 1e-5);
      for (int64_t d = 0; d < D; ++d)  // query head h reads KV head h / 2, exactly
        EXPECT_EQ(r.o[(b * Hq + h) * D + d], v[(b * Hkv + h / 2) * D + d]);
    }
}

TEST(ModelOps, AttentionEqualKeysAverageVAndLse) {
  // All keys equal: every causal score ties, so o_i = mean of v_0..v_i and
  // lse_i = s + ln(i + 1) with s = 0.5 * q_i . k.
  const int64_t S = 4, D = 2;
  std::mt19937 rng(fresh_seed());
  const auto q = bf16_rounded(randn(S * D, rng)), v = bf16_rounded(randn(S * D, rng));
  const std::vector<float> k(S * D, bf16_to_f32(f32_to_bf16(0.3f)));
  const AttnOut r = run_attention(q, k, v, 1, S, 1, 1, D);
  for (int64_t i = 0; i < S; ++i) {
    const double s = 0.5 * (double(q[i * D]) * k[0] + double(q[i * D + 1]) * k[1]);
    EXPECT_NEAR(r.lse[i], s + std::log(i + 1.0), 1e-5);
    for (int64_t d = 0; d < D; ++d) {
      double mean = 0;
      for (int64_t j = 0; j <= i; ++j) mean += v[j * D + d] / (i + 1.0);
      EXPECT_NEAR(r.o[i * D + d], mean, std::abs(mean) * 0x1p-8 + 1e-6);  // o is BF16
    }
  }
}

TEST(ModelOps, AttentionCausalMaskAndThreadCount) {
  std::mt19937 rng(fresh_seed());
  const int64_t B = 1, S = 6, Hq = 4, Hkv = 2, D = 3;
  auto q = randn(B * S * Hq * D, rng), k = randn(B * S * Hkv * D, rng),
       v = randn(B * S * Hkv * D, rng);
  const AttnOut base = run_attention(q, k, v, B, S, Hq, Hkv, D);
  // Change q, k and v of the last position: rows 0..S-2 keep their bits, the last row moves.
  for (int64_t x = 0; x < Hq * D; ++x) q[(S - 1) * Hq * D + x] += 1.0f;
  for (int64_t x = 0; x < Hkv * D; ++x) {
    k[(S - 1) * Hkv * D + x] -= 2.0f;
    v[(S - 1) * Hkv * D + x] += 3.0f;
  }
  const AttnOut moved = run_attention(q, k, v, B, S, Hq, Hkv, D);
  EXPECT_EQ(std::memcmp(base.o.data(), moved.o.data(), (S - 1) * Hq * D * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(base.o.data() + (S - 1) * Hq * D, moved.o.data() + (S - 1) * Hq * D,
                        Hq * D * sizeof(float)),
            0);

  // Forward and backward bits do not depend on the thread count.
  const auto dout = randn(q.size(), rng);
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    const AttnOut f = run_attention(q, k, v, B, S, Hq, Hkv, D);
    const AttnGrads g = run_attention_backward(q, k, v, f, dout, B, S, Hq, Hkv, D);
    return std::vector<std::vector<float>>{f.o, f.lse, g.dq, g.dk, g.dv};
  };
  const int saved = omp_get_max_threads();
  const auto one = run(1), many = run(5);
  omp_set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(same_bits(one[i], many[i])) << i;
}

TEST(ModelOps, AttentionDocumentMaskEqualsSeparateSequences) {
  // One row holding documents [0, 3), [3, 8), [8, 10) gives, bitwise, what each document run as
  // its own sequence gives (forward and backward): no attention crosses a document start.
  std::mt19937 rng(fresh_seed());
  const int64_t S = 10, Hq = 4, Hkv = 2, D = 6;
  const std::vector<int64_t> starts = {0, 3, 8, S};
  std::vector<int32_t> doc_start(S);
  for (size_t d = 0; d + 1 < starts.size(); ++d)
    for (int64_t i = starts[d]; i < starts[d + 1]; ++i) doc_start[i] = static_cast<int32_t>(starts[d]);
  const auto q = randn(S * Hq * D, rng), k = randn(S * Hkv * D, rng), v = randn(S * Hkv * D, rng),
             dout = randn(S * Hq * D, rng);
  const AttnOut f = run_attention(q, k, v, 1, S, Hq, Hkv, D, doc_start);
  const AttnGrads g = run_attention_backward(q, k, v, f, dout, 1, S, Hq, Hkv, D, doc_start);
  auto part = [](const std::vector<float>& x, int64_t width, int64_t t0, int64_t t1) {
    return std::vector<float>(x.begin() + t0 * width, x.begin() + t1 * width);
  };
  for (size_t d = 0; d + 1 < starts.size(); ++d) {
    SCOPED_TRACE("document " + std::to_string(d));
    const int64_t t0 = starts[d], t1 = starts[d + 1], n = t1 - t0;
    const auto qd = part(q, Hq * D, t0, t1), kd = part(k, Hkv * D, t0, t1),
               vd = part(v, Hkv * D, t0, t1), dd = part(dout, Hq * D, t0, t1);
    const AttnOut fd = run_attention(qd, kd, vd, 1, n, Hq, Hkv, D);
    const AttnGrads gd = run_attention_backward(qd, kd, vd, fd, dd, 1, n, Hq, Hkv, D);
    EXPECT_TRUE(same_bits(part(f.o, Hq * D, t0, t1), fd.o));
    for (int64_t h = 0; h < Hq; ++h)
      EXPECT_TRUE(same_bits(part(f.lse, 1, h * S + t0, h * S + t1), part(fd.lse, 1, h * n, h * n + n)));
    EXPECT_TRUE(same_bits(part(g.dq, Hq * D, t0, t1), gd.dq));
    EXPECT_TRUE(same_bits(part(g.dk, Hkv * D, t0, t1), gd.dk));
    EXPECT_TRUE(same_bits(part(g.dv, Hkv * D, t0, t1), gd.dv));
  }
}

// ---- cross-entropy ------------------------------------------------------------------------------

TEST(ModelOps, CrossEntropyUniformAndIgnore) {
  const int64_t T = 3, V = 50;
  std::vector<float> z(T * V, 2.5f);  // uniform rows: loss ln V whatever the target
  std::vector<int32_t> tgt = {7, -100, 49};
  std::vector<float> token_loss(T, 7.0f);
  std::vector<uint16_t> dz(T * V, 0xFFFF);
  const float g = 2.0f / 2.0f;  // dloss / n
  CrossEntropyArgs f{T, V, -100, g, z.data(), tgt.data(), token_loss.data(), dz.data()};
  ASSERT_TRUE(cross_entropy_cpu(f).is_ok());
  float loss = 0;
  CrossEntropyMeanArgs mean{T, 2, token_loss.data(), &loss};
  ASSERT_TRUE(cross_entropy_mean_cpu(mean).is_ok());
  EXPECT_LE(ulp_distance(loss, static_cast<float>(std::log(50.0))), 2);
  EXPECT_EQ(token_loss[1], 0.0f) << "an ignored token adds +0";
  // dlogits of a uniform row: 1/V everywhere, 1/V - 1 at the target, times g, rounded to BF16.
  EXPECT_NEAR(bf16_to_f32(dz[0]), 1.0 / V, 1e-7 + 1.0 / V / 256);
  EXPECT_NEAR(bf16_to_f32(dz[7]), 1.0 / V - 1.0, 1.0 / 256);
  for (int64_t e = 0; e < V; ++e) EXPECT_EQ(dz[V + e], 0) << "ignored row: +0";
  // The ignored row's logits do not matter.
  for (int64_t e = 0; e < V; ++e) z[V + e] = static_cast<float>(e);
  ASSERT_TRUE(cross_entropy_cpu(f).is_ok());
  float loss2 = 0;
  mean.loss = &loss2;
  ASSERT_TRUE(cross_entropy_mean_cpu(mean).is_ok());
  EXPECT_EQ(loss2, loss);
  // The loss only (dlogits null) writes the same per-token losses.
  std::vector<float> only(T);
  f.loss = only.data();
  f.dlogits = nullptr;
  ASSERT_TRUE(cross_entropy_cpu(f).is_ok());
  EXPECT_EQ(only, token_loss);

  // Every target ignored: loss 0 (not NaN), no gradient.
  std::vector<int32_t> none(T, -100);
  f.targets = none.data();
  f.dlogits = dz.data();
  f.grad_scale = 0.0f;
  ASSERT_TRUE(cross_entropy_cpu(f).is_ok());
  mean.valid = 0;
  mean.token_loss = only.data();
  ASSERT_TRUE(cross_entropy_mean_cpu(mean).is_ok());
  EXPECT_EQ(loss2, 0.0f);
  for (uint16_t d : dz) EXPECT_EQ(d, 0);
}

// ---- argument errors ----------------------------------------------------------------------------

TEST(ModelOps, Errors) {
  const std::vector<float> buf(64, 1.0f);
  std::vector<float> out(64, -1.0f), out2(64);
  const float* in = buf.data();

  // Token ids and targets are data: a Status error, nothing written.
  const std::vector<int32_t> ids = {0, 4};
  expect_error(embedding_cpu({2, 4, 2, ids.data(), in, out.data()}), "token id 4 at position 1");
  EXPECT_EQ(out[0], -1.0f);
  expect_error(embedding_backward_cpu({2, 4, 2, ids.data(), in, out.data()}), "outside [0, 4)");
  expect_error(validate_embedding({0, 4, 2, ids.data(), in, out.data()}), "T (tokens)");
  expect_error(validate_embedding({2, 4, 2, ids.data(), nullptr, out.data()}), "table is null");

  expect_error(validate_rms_norm({2, 0, 1e-6f, in, in, out.data(), out2.data()}), "D (dim)");
  expect_error(validate_rms_norm({2, 4, -1.0f, in, in, out.data(), out2.data()}), "eps");
  expect_error(validate_rms_norm({2, 4, 1e-6f, in, in, out.data(), nullptr}), "rstd is null");
  uint16_t bf16_out[64] = {};
  RmsNormArgs both{2, 4, 1e-6f, in, in, out.data(), out2.data()};
  both.y_bf16 = bf16_out;
  expect_error(validate_rms_norm(both), "set exactly one of y (F32) and y_bf16 (BF16), got both");
  expect_error(validate_rms_norm({2, 4, 1e-6f, in, in, nullptr, out2.data()}),
               "set exactly one of y (F32) and y_bf16 (BF16), got neither");
  RmsNormArgs bf16_only{2, 4, 1e-6f, in, in, nullptr, out2.data()};
  bf16_only.y_bf16 = bf16_out;
  EXPECT_TRUE(validate_rms_norm(bf16_only).is_ok());
  expect_error(validate_rms_norm_backward({2, 4, in, in, in, in, out.data(), nullptr}),
               "dweight is null");

  const std::vector<int32_t> pos = {0, -3};
  expect_error(rope_table({2, 4, 1e4, pos.data(), out.data(), out2.data()}), "position -3");
  expect_error(validate_rope_table({2, 5, 1e4, pos.data(), out.data(), out2.data()}),
               "must be even");
  expect_error(validate_rope_table({2, 4, 0.5, pos.data(), out.data(), out2.data()}), "theta");
  expect_error(validate_rope({2, 1, 6, in, in, nullptr, out.data()}), "in is null");

  const uint16_t bits[8] = {};
  uint16_t obits[8] = {};
  AttentionArgs a{1, 2, 3, 2, 4, 0.5f, bits, bits, bits, nullptr, obits, out2.data()};
  expect_error(validate_attention(a), "not a multiple of Hkv");
  a.kv_heads = 1;
  EXPECT_TRUE(validate_attention(a).is_ok());
  a.scale = 0.0f;
  expect_error(validate_attention(a), "scale");
  AttentionBackwardArgs ab{1,    2,    3,    1,       4,          0.5f,       bits, bits,
                           bits, bits, in,   nullptr, bits, out.data(), out.data(), nullptr};
  expect_error(validate_attention_backward(ab), "dv is null");

  const std::vector<int32_t> tgt = {1, 9};
  uint16_t dz[16] = {};
  CrossEntropyArgs c{2, 8, -100, 1.0f, in, tgt.data(), out.data(), dz};
  expect_error(cross_entropy_cpu(c), "target 9 at position 1");
  expect_error(cross_entropy_cpu(c), "not the ignore index");
  EXPECT_EQ(out[0], -1.0f) << "nothing written";
  c.grad_scale = std::numeric_limits<float>::infinity();
  expect_error(validate_cross_entropy(c), "grad_scale");
  c.grad_scale = 1.0f;
  c.loss = nullptr;
  expect_error(validate_cross_entropy(c), "loss is null");
  float loss = 0;
  expect_error(validate_cross_entropy_mean({2, 3, in, &loss}), "valid = 3");
}

// embedding_backward adds each id's sum (from +0, ascending t) onto a non-zero table; rows of ids
// that do not occur keep their bits.
TEST(ModelOps, EmbeddingBackwardAddsEachIdsSum) {
  std::mt19937 rng(fresh_seed());
  const int64_t T = 40, V = 9, H = 5;
  const auto dout = randn(T * H, rng), table0 = randn(V * H, rng);
  std::vector<int32_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(rng() % (V - 2));  // V-2, V-1 unused
  std::vector<float> dtable = table0;
  ASSERT_TRUE(embedding_backward_cpu({T, V, H, ids.data(), dout.data(), dtable.data()}).is_ok());
  for (int64_t v = 0; v < V; ++v)
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;
      bool seen = false;
      for (int64_t t = 0; t < T; ++t)
        if (ids[t] == v) {
          sum += dout[t * H + h];
          seen = true;
        }
      const float want = seen ? table0[v * H + h] + sum : table0[v * H + h];
      EXPECT_EQ(std::memcmp(&want, &dtable[v * H + h], sizeof(float)), 0) << v << "," << h;
    }
}

// dweight's order, written out here with plain loops (backend/reduce_order.h's definition):
// blocks of 1024 rows, 32 strided lanes per block, the halving tree, then the block partials in
// order. N = 2500: two full blocks and a partial one.
TEST(ModelOps, RmsNormDweightBlockedOrder) {
  std::mt19937 rng(fresh_seed());
  const int64_t N = 2500, D = 3;
  const auto x = randn(N * D, rng), w = randn(D, rng), dy = randn(N * D, rng);
  std::vector<float> y(N * D), rstd(N), dx(N * D), dw(D);
  ASSERT_TRUE(rms_norm_cpu({N, D, 1e-6f, x.data(), w.data(), y.data(), rstd.data()}).is_ok());
  ASSERT_TRUE(rms_norm_backward_cpu(
                  {N, D, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data()})
                  .is_ok());
  for (int64_t d = 0; d < D; ++d) {
    float total = 0.0f;
    for (int64_t b0 = 0; b0 < N; b0 += 1024) {
      float lane[32] = {};
      for (int64_t r = b0; r < std::min(N, b0 + 1024); ++r)
        lane[(r - b0) % 32] += dy[r * D + d] * (x[r * D + d] * rstd[r]);
      for (int off = 16; off >= 1; off /= 2)
        for (int l = 0; l < off; ++l) lane[l] += lane[l + off];
      total += lane[0];
    }
    EXPECT_EQ(std::memcmp(&total, &dw[d], sizeof(float)), 0) << d << ": " << total << " vs " << dw[d];
  }
}

TEST(ModelOps, BackwardThreadCountIndependence) {
  std::mt19937 rng(fresh_seed());
  const int64_t N = 70, D = 40, T = 50, V = 6, H = 130;
  const auto x = randn(N * D, rng), w = randn(D, rng), dy = randn(N * D, rng),
             dout = randn(T * H, rng);
  std::vector<int32_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 7) % V);
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    std::vector<float> y(N * D), rstd(N), dx(N * D), dw(D), dtable(V * H, 0.25f);
    EXPECT_TRUE(rms_norm_cpu({N, D, 1e-6f, x.data(), w.data(), y.data(), rstd.data()}).is_ok());
    RmsNormBackwardArgs b{N, D, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data()};
    EXPECT_TRUE(rms_norm_backward_cpu(b).is_ok());
    EXPECT_TRUE(embedding_backward_cpu({T, V, H, ids.data(), dout.data(), dtable.data()}).is_ok());
    return std::vector<std::vector<float>>{y, dx, dw, dtable};
  };
  const int saved = omp_get_max_threads();
  const auto one = run(1), many = run(6);
  omp_set_num_threads(saved);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(same_bits(one[i], many[i])) << i;
}

// ---- out-of-place add (the residual stream) ----------------------------------------------------

// out = a + b bit for bit, over segment lists of lengths around the CUDA kernel's 4-wide chunks
// (and 0), written out of place and in place (out = a); mismatched segments are errors.
TEST(Elementwise, AddF32Out) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const int64_t G : {1, 3})
    for (const int64_t n : {0, 1, 3, 4, 5, 7, 8, 1023, 4097}) {
      std::vector<std::vector<float>> a(G), b(G), out(G, std::vector<float>(n, -7.0f));
      Segments<const float> sa{{}, n}, sb{{}, n};
      Segments<float> so{{}, n}, sa_inplace{{}, n};
      for (int64_t g = 0; g < G; ++g) {
        a[g] = randn(n, rng), b[g] = randn(n, rng);
        sa.ptr.push_back(a[g].data()), sb.ptr.push_back(b[g].data());
        so.ptr.push_back(out[g].data());
      }
      ASSERT_TRUE(ops::add_f32_out(cpu_backend(), sa, sb, so).is_ok());
      std::vector<std::vector<float>> in_place = a;  // out = a: each element read, then written
      Segments<const float> si{{}, n};
      for (int64_t g = 0; g < G; ++g) {
        si.ptr.push_back(in_place[g].data());
        sa_inplace.ptr.push_back(in_place[g].data());
      }
      ASSERT_TRUE(ops::add_f32_out(cpu_backend(), si, sb, sa_inplace).is_ok());
      for (int64_t g = 0; g < G; ++g) {
        std::vector<float> want(n);
        for (int64_t i = 0; i < n; ++i) want[i] = a[g][i] + b[g][i];
        EXPECT_TRUE(same_bits(out[g], want)) << "G " << G << " n " << n << " g " << g;
        EXPECT_TRUE(same_bits(in_place[g], want)) << "in place, G " << G << " n " << n;
      }
    }
  std::vector<float> buf(8);
  Segments<const float> one{{buf.data()}, 8}, two{{buf.data(), buf.data()}, 8};
  Segments<float> out{{buf.data()}, 8}, short_out{{buf.data()}, 4};
  Backend& cpu = cpu_backend();
  expect_error(ops::add_f32_out(cpu, one, two, out), "add_f32_out: 2 segments where 1");
  expect_error(ops::add_f32_out(cpu, one, one, short_out), "add_f32_out: segments of 4 and 8");
  EXPECT_TRUE(ops::add_f32_out(cpu, one, one, out).is_ok());
}

}  // namespace
}  // namespace packmoe
