// Flash attention (backend/cuda/flash_attention_sm90.h) against an FP64 host reference computed
// from the same BF16 inputs, on fresh random inputs: plain causal and document masks, partial
// tiles, GQA ratios 1, 4 and 8, D 64 and 128 (tensor cores) and 16 (the simple path). Also
// bitwise determinism (two runs) and batch invariance (row b alone equals row b of a batch).
// Error bound (per element): |got - ref| <= 2^-7 R + 2^-8 |ref| + 1e-6, R being the same sum as
// the reference with every term in absolute value (e.g. sum_j P_ij |V_jd| for O). The kernels
// round P and dS to BF16 (relative 2^-9) before the products that sum them, O to BF16 (2^-9 |O|,
// and Dl = dO . O then carries O's error into dS: R for dS includes sum_d |dO_id| R^O_id); FP32
// accumulation and exp2 add ~1e-6 relative. 2^-7 = 4 BF16 units of the term sums leaves a margin
// of 2 over those roundings. lse: |got - ref| <= 1e-4 (1 + |ref|). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/flash_attention_sm90.h"
#include "core/codecs.h"

namespace packmoe::cuda {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no usable GPU"

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xFF, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);  // NaN poison
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

struct Inputs {
  FlashAttentionShape s;
  std::vector<uint16_t> q, k, v, dout;  // BF16 bits
  std::vector<int32_t> doc;             // (B * S), empty: plain causal
};

// Uniform values in [-a, a) rounded to BF16. Scores q . k * scale reach about +-10, so some rows
// have peaked softmaxes and some flat ones.
std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng, float a) {
  std::uniform_real_distribution<float> u(-a, a);
  std::vector<uint16_t> h(n);
  for (auto& x : h) x = f32_to_bf16(u(rng));
  return h;
}

// Random documents per row: boundaries at random positions, `docs` documents on average.
std::vector<int32_t> random_docs(int64_t B, int64_t S, int docs, std::mt19937_64& rng) {
  std::vector<int32_t> d(B * S);
  std::uniform_int_distribution<int64_t> pos(1, std::max<int64_t>(S - 1, 1));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> cuts;
    for (int c = 0; c + 1 < docs; ++c) cuts.push_back(pos(rng));
    std::sort(cuts.begin(), cuts.end());
    int32_t start = 0;
    size_t next = 0;
    for (int64_t i = 0; i < S; ++i) {
      while (next < cuts.size() && cuts[next] <= i) start = static_cast<int32_t>(cuts[next++]);
      d[b * S + i] = start;
    }
  }
  return d;
}

Inputs make_inputs(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int docs,
                   std::mt19937_64& rng) {
  Inputs in;
  in.s = {B, S, Hq, Hkv, D, static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)))};
  const float qa = 2.0f * std::pow(static_cast<float>(D), 0.25f) / std::sqrt(3.0f);
  in.q = random_bf16(B * S * Hq * D, rng, qa);
  in.k = random_bf16(B * S * Hkv * D, rng, qa);
  in.v = random_bf16(B * S * Hkv * D, rng, 1.0f);
  in.dout = random_bf16(B * S * Hq * D, rng, 1.0f);
  if (docs > 0) in.doc = random_docs(B, S, docs, rng);
  return in;
}

struct Outputs {
  std::vector<uint16_t> o;
  std::vector<float> lse, dq, dk, dv;
};

Outputs run_gpu(const Inputs& in) {
  const FlashAttentionShape& s = in.s;
  const size_t nq = s.batch * s.seq * s.q_heads * s.head_dim;
  const size_t nkv = s.batch * s.seq * s.kv_heads * s.head_dim;
  Dev<uint16_t> q(in.q), k(in.k), v(in.v), dout(in.dout), o(nq);
  Dev<int32_t> doc(in.doc);
  Dev<float> lse(s.batch * s.q_heads * s.seq), dq(nq), dk(nkv), dv(nkv);
  Dev<uint8_t> ws(flash_attention_backward_workspace_bytes(s));
  const int32_t* docp = in.doc.empty() ? nullptr : doc.p;
  Status st = flash_attention_forward_sm90(s, q.p, k.p, v.p, docp, o.p, lse.p, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = flash_attention_backward_sm90(s, q.p, k.p, v.p, o.p, dout.p, lse.p, docp, dq.p, dk.p, dv.p,
                                     ws.p, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {o.get(), lse.get(), dq.get(), dk.get(), dv.get()};
}

// FP64 reference and the absolute-term sums R of the bound (header comment).
struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
  std::vector<double> ro, rdq, rdk, rdv;
};

Reference reference(const Inputs& in) {
  const FlashAttentionShape& s = in.s;
  const int64_t B = s.batch, S = s.seq, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim;
  const int64_t G = Hq / Hkv;
  const double scale = s.scale;
  auto f = [](const std::vector<uint16_t>& x) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(x[i]);
    return r;
  };
  const std::vector<double> q = f(in.q), k = f(in.k), v = f(in.v), dout = f(in.dout);
  Reference r;
  r.o.assign(q.size(), 0.0);
  r.ro.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.rdq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.rdk.assign(k.size(), 0.0);
  r.dv.assign(k.size(), 0.0);
  r.rdv.assign(k.size(), 0.0);
  r.lse.assign(B * Hq * S, 0.0);
  std::vector<double> p(S), dp(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / G;
      for (int64_t i = 0; i < S; ++i) {
        const int64_t j0 = in.doc.empty() ? 0 : in.doc[b * S + i];
        const double* qi = &q[((b * S + i) * Hq + h) * D];
        const double* doi = &dout[((b * S + i) * Hq + h) * D];
        auto kv = [&](const std::vector<double>& t, int64_t j) {
          return &t[((b * S + j) * Hkv + g) * D];
        };
        double mx = -INFINITY;
        for (int64_t j = j0; j <= i; ++j) {
          double d = 0.0;
          for (int64_t e = 0; e < D; ++e) d += qi[e] * kv(k, j)[e];
          p[j] = d * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (int64_t j = j0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        r.lse[(b * Hq + h) * S + i] = mx + std::log(sum);
        double* oi = &r.o[((b * S + i) * Hq + h) * D];
        double* roi = &r.ro[((b * S + i) * Hq + h) * D];
        double dl = 0.0, dl_err = 0.0;
        for (int64_t j = j0; j <= i; ++j) {
          p[j] /= sum;
          double d = 0.0;
          for (int64_t e = 0; e < D; ++e) {
            oi[e] += p[j] * kv(v, j)[e];
            roi[e] += p[j] * std::fabs(kv(v, j)[e]);
            d += doi[e] * kv(v, j)[e];
          }
          dp[j] = d;
          dl += p[j] * d;
        }
        for (int64_t e = 0; e < D; ++e) dl_err += std::fabs(doi[e]) * roi[e];
        double* dqi = &r.dq[((b * S + i) * Hq + h) * D];
        double* rdqi = &r.rdq[((b * S + i) * Hq + h) * D];
        for (int64_t j = j0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dl);
          const double ds_abs = p[j] * (std::fabs(dp[j]) + std::fabs(dl) + dl_err);
          double* dkj = &r.dk[((b * S + j) * Hkv + g) * D];
          double* rdkj = &r.rdk[((b * S + j) * Hkv + g) * D];
          double* dvj = &r.dv[((b * S + j) * Hkv + g) * D];
          double* rdvj = &r.rdv[((b * S + j) * Hkv + g) * D];
          for (int64_t e = 0; e < D; ++e) {
            dqi[e] += scale * ds * kv(k, j)[e];
            rdqi[e] += scale * ds_abs * std::fabs(kv(k, j)[e]);
            dkj[e] += scale * ds * qi[e];
            rdkj[e] += scale * ds_abs * std::fabs(qi[e]);
            dvj[e] += p[j] * doi[e];
            rdvj[e] += p[j] * std::fabs(doi[e]);
          }
        }
      }
    }
  return r;
}

// Elements outside the bound (NaN counts); prints the first few.
template <typename T, typename Conv>
size_t count_bad(const char* what, const std::vector<T>& got, const std::vector<double>& ref,
                 const std::vector<double>* terms, Conv conv, double rel_terms, double rel_ref,
                 double abs_tol) {
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = conv(got[i]), err = std::fabs(g - ref[i]);
    const double bound =
        rel_terms * (terms ? (*terms)[i] : 0.0) + rel_ref * std::fabs(ref[i]) + abs_tol;
    if (std::isfinite(g)) worst = std::max(worst, err / bound);
    if (!(err <= bound)) {
      if (bad < 3)
        std::printf("  %s[%zu]: got %.7g want %.7g (bound %.3g)\n", what, i, g, ref[i], bound);
      ++bad;
    }
  }
  std::printf("  %s: %zu of %zu outside the bound, worst err/bound %.3f\n", what, bad, got.size(),
              worst);
  return bad;
}

void check_against_reference(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int docs) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed << " B" << B << " S" << S << " Hq" << Hq
                                  << " Hkv" << Hkv << " D" << D << " docs " << docs);
  std::printf("[flash cuda] B%lld S%lld Hq%lld Hkv%lld D%lld docs %d seed %u\n",
              static_cast<long long>(B), static_cast<long long>(S), static_cast<long long>(Hq),
              static_cast<long long>(Hkv), static_cast<long long>(D), docs, seed);
  std::mt19937_64 rng(seed);
  const Inputs in = make_inputs(B, S, Hq, Hkv, D, docs, rng);
  const Outputs out = run_gpu(in);
  const Reference ref = reference(in);
  const double kTerms = 1.0 / 128, kRef = 1.0 / 256, kAbs = 1e-6;
  auto bf = [](uint16_t x) { return static_cast<double>(bf16_to_f32(x)); };
  auto fl = [](float x) { return static_cast<double>(x); };
  size_t bad = count_bad("o", out.o, ref.o, &ref.ro, bf, kTerms, kRef, kAbs);
  bad += count_bad("lse", out.lse, ref.lse, nullptr, fl, 0.0, 1e-4, 1e-4);
  bad += count_bad("dq", out.dq, ref.dq, &ref.rdq, fl, kTerms, kRef, kAbs);
  bad += count_bad("dk", out.dk, ref.dk, &ref.rdk, fl, kTerms, kRef, kAbs);
  bad += count_bad("dv", out.dv, ref.dv, &ref.rdv, fl, kTerms, kRef, kAbs);
  EXPECT_EQ(bad, 0u);
}

TEST(CudaFlashAttention, CausalPartialTilesD128) {
  SKIP_WITHOUT_GPU();
  check_against_reference(2, 200, 8, 8, 128, 0);  // GQA ratio 1
  check_against_reference(2, 200, 8, 2, 128, 0);  // 4
  check_against_reference(1, 333, 8, 1, 128, 0);  // 8
}

TEST(CudaFlashAttention, CausalPartialTilesD64) {
  SKIP_WITHOUT_GPU();
  check_against_reference(2, 200, 8, 8, 64, 0);
  check_against_reference(2, 300, 8, 2, 64, 0);
  check_against_reference(1, 333, 8, 1, 64, 0);
}

TEST(CudaFlashAttention, DocumentMasks) {
  SKIP_WITHOUT_GPU();
  check_against_reference(3, 517, 8, 2, 128, 5);
  check_against_reference(3, 517, 8, 1, 64, 5);
  check_against_reference(2, 700, 4, 4, 128, 3);
}

TEST(CudaFlashAttention, SimplePathD16) {
  SKIP_WITHOUT_GPU();
  check_against_reference(2, 150, 4, 2, 16, 0);
  check_against_reference(2, 150, 4, 2, 16, 4);
}

// Two runs, same bytes; row b alone (B = 1) equals row b of a batch of 4, same bytes.
void check_bitwise(int64_t D) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed << " D" << D);
  std::mt19937_64 rng(seed);
  const int64_t B = 4, S = 397, Hq = 8, Hkv = 2;
  const Inputs all = make_inputs(B, S, Hq, Hkv, D, 4, rng);
  const Outputs a = run_gpu(all), b = run_gpu(all);
  EXPECT_TRUE(a.o == b.o && a.lse == b.lse && a.dq == b.dq && a.dk == b.dk && a.dv == b.dv)
      << "two runs differ";
  for (int64_t r = 0; r < B; ++r) {
    Inputs one;
    one.s = all.s;
    one.s.batch = 1;
    auto row = [&](const auto& x, int64_t per_row) {
      using V = std::decay_t<decltype(x)>;
      return V(x.begin() + r * per_row, x.begin() + (r + 1) * per_row);
    };
    const int64_t nq = S * Hq * D, nkv = S * Hkv * D;
    one.q = row(all.q, nq);
    one.k = row(all.k, nkv);
    one.v = row(all.v, nkv);
    one.dout = row(all.dout, nq);
    one.doc = row(all.doc, S);
    const Outputs o = run_gpu(one);
    EXPECT_TRUE(o.o == row(a.o, nq)) << "o, row " << r;
    EXPECT_TRUE(o.lse == row(a.lse, Hq * S)) << "lse, row " << r;
    EXPECT_TRUE(o.dq == row(a.dq, nq)) << "dq, row " << r;
    EXPECT_TRUE(o.dk == row(a.dk, nkv)) << "dk, row " << r;
    EXPECT_TRUE(o.dv == row(a.dv, nkv)) << "dv, row " << r;
  }
}

TEST(CudaFlashAttention, DeterministicAndBatchInvariant) {
  SKIP_WITHOUT_GPU();
  check_bitwise(128);
  check_bitwise(64);
  check_bitwise(16);
}

TEST(CudaFlashAttention, RejectsBadShapes) {
  const FlashAttentionShape not_divisible{1, 64, 6, 4, 64, 0.125f};
  EXPECT_FALSE(flash_attention_forward_sm90(not_divisible, nullptr, nullptr, nullptr, nullptr,
                                            nullptr, nullptr, nullptr)
                   .is_ok());
  const FlashAttentionShape too_wide{1, 64, 4, 4, 512, 0.125f};
  EXPECT_FALSE(flash_attention_forward_sm90(too_wide, nullptr, nullptr, nullptr, nullptr, nullptr,
                                            nullptr, nullptr)
                   .is_ok());
  const FlashAttentionShape bad_scale{1, 64, 4, 4, 64, 0.0f};
  EXPECT_FALSE(flash_attention_backward_sm90(bad_scale, nullptr, nullptr, nullptr, nullptr, nullptr,
                                             nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                             nullptr)
                   .is_ok());
}

}  // namespace
}  // namespace packmoe::cuda
