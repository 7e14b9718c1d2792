// CUDA dense decoder ops (embedding, RMSNorm with F32 or BF16 output and with or without the
// residual gradient, RoPE; forward and backward) and sum_squares against
// the CPU reference, BYTE FOR BYTE; cross-entropy within stated bounds of it (its one-read online
// softmax promises no CPU bytes), attention against FP64 in test_cuda_flash_attention.cpp. Every output
// buffer has a sentinel tail and starts with the same bytes on both sides, so a stray write is a
// mismatch too; inputs stay finite (the GPU canonicalises NaN payloads, x86 does not). Fresh seed
// per test, printed on failure. Backend interface only; skips without a GPU. The harness (Twin,
// Tally): tests/common/cuda_vs_cpu.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/elementwise.h"
#include "backend/ops/model.h"
#include "common/cuda_vs_cpu.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

using test::Tally;
using test::Twin;

// The GPU (or a skip) and a fresh seed, printed on failure.
#define SKIP_WITHOUT_GPU()                                     \
  PACKMOE_SKIP_WITHOUT_GPU();                                  \
  const uint32_t seed = std::random_device{}();                \
  SCOPED_TRACE(testing::Message() << "seed " << seed);         \
  std::mt19937_64 rng(seed)

// Normal values around `scale` with signed zeros, subnormals and tiny / large magnitudes mixed in.
float rand_value(std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  const float sign = (rng() & 1) ? -1.0f : 1.0f;
  switch (rng() % 50) {
    case 0:
      return sign * 0.0f;
    case 1:
      return sign * f32_from_bits(static_cast<uint32_t>(1 + rng() % 0x7FFFFF));
    case 2:
      return sign * std::ldexp(1.0f, -static_cast<int>(rng() % 40));
    case 3:
      return sign * scale * (4.0f + static_cast<float>(rng() % 8));
    default:
      return nd(rng);
  }
}

std::vector<float> rand_floats(size_t n, std::mt19937_64& rng, float scale) {
  std::vector<float> v(n);
  for (float& x : v) x = rand_value(rng, scale);
  return v;
}

std::vector<int32_t> rand_ids(size_t n, int64_t vocab, std::mt19937_64& rng) {
  // Half the ids from a few hot values, so every vocabulary size repeats ids.
  std::vector<int32_t> hot(4);
  for (int32_t& h : hot) h = static_cast<int32_t>(rng() % vocab);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids)
    id = (rng() & 1) ? hot[rng() % hot.size()] : static_cast<int32_t>(rng() % vocab);
  return ids;
}

void expect_ok(const Status& s) { ASSERT_TRUE(s.is_ok()) << s.message(); }

// ---- embedding ---------------------------------------------------------------------------------

struct EmbCase {
  int64_t T, V, H;
};
const std::vector<EmbCase> kEmbCases = {{1, 1, 1},       {37, 50, 64},  {300, 1000, 33},
                                        {1024, 97, 256}, {2000, 3, 36}, {513, 40, 7}};

TEST(CudaModelOps, Embedding) {
  SKIP_WITHOUT_GPU();
  Tally tally("embedding");
  for (const EmbCase& c : kEmbCases) {
    const std::vector<int32_t> id_values = rand_ids(c.T, c.V, rng);
    Twin<int32_t> ids(*gpu, id_values);
    Twin<float> table(*gpu, rand_floats(c.V * c.H, rng, 1.0f));  // (V, H)
    Twin<float> out(*gpu, c.T * c.H);                            // (T, H)
    expect_ok(embedding_cpu({c.T, c.V, c.H, ids.h(), table.h(), out.h()}));
    expect_ok(ops::embedding(*gpu, {c.T, c.V, c.H, ids.d(), table.d(), out.d()}));
    out.compare(tally, "out");
    ++tally.cases;
  }
}

TEST(CudaModelOps, EmbeddingBackward) {
  SKIP_WITHOUT_GPU();
  Tally tally("embedding_backward");
  for (const EmbCase& c : kEmbCases) {
    Twin<int32_t> ids(*gpu, rand_ids(c.T, c.V, rng));
    Twin<float> dout(*gpu, rand_floats(c.T * c.H, rng, 1.0f));    // (T, H)
    Twin<float> dtable(*gpu, rand_floats(c.V * c.H, rng, 1.0f));  // (V, H) accumulated into
    expect_ok(embedding_backward_cpu({c.T, c.V, c.H, ids.h(), dout.h(), dtable.h()}));
    expect_ok(ops::embedding_backward(*gpu, {c.T, c.V, c.H, ids.d(), dout.d(), dtable.d()}));
    dtable.compare(tally, "dtable");
    ++tally.cases;
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------------

struct NormCase {
  int64_t N, D;
  float eps;
};
const std::vector<NormCase> kNormCases = {{1, 1, 1e-6f},     {7, 16, 1e-6f},    {33, 64, 1e-5f},
                                          {129, 128, 1e-6f}, {64, 2048, 1e-6f}, {1000, 100, 1e-6f},
                                          {3, 33, 0.25f},    {4100, 16, 1e-6f}};

// Rows of random values; every 7th row is all zeros (rstd = 1 / sqrt(eps)).
std::vector<float> norm_input(const NormCase& c, std::mt19937_64& rng) {
  std::vector<float> x = rand_floats(c.N * c.D, rng, 1.5f);
  for (int64_t r = 6; r < c.N; r += 7)
    for (int64_t d = 0; d < c.D; ++d) x[r * c.D + d] = 0.0f;
  return x;
}

TEST(CudaModelOps, RmsNorm) {
  SKIP_WITHOUT_GPU();
  Tally tally("rms_norm");
  for (const NormCase& c : kNormCases) {
    Twin<float> x(*gpu, norm_input(c, rng));           // (N, D)
    Twin<float> w(*gpu, rand_floats(c.D, rng, 1.0f));  // (D)
    Twin<float> y(*gpu, c.N * c.D), rstd(*gpu, c.N);   // (N, D), (N)
    expect_ok(rms_norm_cpu({c.N, c.D, c.eps, x.h(), w.h(), y.h(), rstd.h()}));
    expect_ok(ops::rms_norm(*gpu, {c.N, c.D, c.eps, x.d(), w.d(), y.d(), rstd.d()}));
    y.compare(tally, "y");
    rstd.compare(tally, "rstd");
    ++tally.cases;
  }
}

// Without and with dresidual (dx = dresidual + t: one rounding of t, then one add): the CPU's
// bytes.
TEST(CudaModelOps, RmsNormBackward) {
  SKIP_WITHOUT_GPU();
  for (bool residual : {false, true}) {
    Tally tally(residual ? "rms_norm_backward dresidual" : "rms_norm_backward");
    for (const NormCase& c : kNormCases) {
      const std::vector<float> xv = norm_input(c, rng), wv = rand_floats(c.D, rng, 1.0f);
      std::vector<float> yv(c.N * c.D), rv(c.N);  // the forward's rstd feeds both backends
      expect_ok(rms_norm_cpu({c.N, c.D, c.eps, xv.data(), wv.data(), yv.data(), rv.data()}));
      Twin<float> x(*gpu, xv), w(*gpu, wv), rstd(*gpu, rv);
      Twin<float> dy(*gpu, rand_floats(c.N * c.D, rng, 1.0f));    // (N, D)
      Twin<float> dres(*gpu, rand_floats(c.N * c.D, rng, 1.0f));  // (N, D)
      Twin<float> dx(*gpu, c.N * c.D), dw(*gpu, c.D);             // (N, D), (D)
      RmsNormBackwardArgs h{c.N, c.D, x.h(), w.h(), rstd.h(), dy.h(), dx.h(), dw.h()};
      RmsNormBackwardArgs d{c.N, c.D, x.d(), w.d(), rstd.d(), dy.d(), dx.d(), dw.d()};
      if (residual) {
        h.dresidual = dres.h();
        d.dresidual = dres.d();
      }
      expect_ok(rms_norm_backward_cpu(h));
      expect_ok(ops::rms_norm_backward(*gpu, d));
      dx.compare(tally, "dx");
      dw.compare(tally, "dweight");
      ++tally.cases;
    }
  }
}

// The BF16 output (y_bf16, no FP32 y): the CPU's bytes, and the RNE of the CPU's FP32 y.
TEST(CudaModelOps, RmsNormBf16Output) {
  SKIP_WITHOUT_GPU();
  Tally tally("rms_norm y_bf16");
  for (const NormCase& c : kNormCases) {
    Twin<float> x(*gpu, norm_input(c, rng));           // (N, D)
    Twin<float> w(*gpu, rand_floats(c.D, rng, 1.0f));  // (D)
    Twin<uint16_t> y(*gpu, c.N * c.D);                 // (N, D)
    Twin<float> rstd(*gpu, c.N);                       // (N)
    RmsNormArgs h{c.N, c.D, c.eps, x.h(), w.h(), nullptr, rstd.h()}, d = h;
    h.y_bf16 = y.h();
    d.x = x.d(), d.weight = w.d(), d.rstd = rstd.d(), d.y_bf16 = y.d();
    expect_ok(rms_norm_cpu(h));
    expect_ok(ops::rms_norm(*gpu, d));
    y.compare(tally, "y_bf16");
    rstd.compare(tally, "rstd");
    std::vector<float> yf(c.N * c.D), rf(c.N);
    expect_ok(rms_norm_cpu({c.N, c.D, c.eps, x.h(), w.h(), yf.data(), rf.data()}));
    int64_t not_rne = 0;
    for (int64_t i = 0; i < c.N * c.D; ++i) not_rne += y.h()[i] != f32_to_bf16(yf[i]);
    EXPECT_EQ(not_rne, 0) << c.N << "x" << c.D;
    ++tally.cases;
  }
}

// ---- RoPE --------------------------------------------------------------------------------------

TEST(CudaModelOps, RopeForwardAndBackward) {
  SKIP_WITHOUT_GPU();
  Tally fwd("rope"), bwd("rope_backward");
  struct Case {
    int64_t T, heads, D;
  };
  for (const Case& c : std::vector<Case>{
           {1, 1, 2}, {37, 4, 16}, {65, 8, 64}, {100, 2, 128}, {9, 3, 6}, {31, 1, 256}}) {
    std::vector<int32_t> pos(c.T);
    for (int32_t& p : pos) p = static_cast<int32_t>(rng() % 40000);
    std::vector<float> cs(c.T * c.D / 2), sn(c.T * c.D / 2);
    expect_ok(rope_table({c.T, c.D, 1e6, pos.data(), cs.data(), sn.data()}));
    Twin<float> cos_t(*gpu, cs), sin_t(*gpu, sn);  // (T, D/2)
    const std::vector<float> xv = rand_floats(c.T * c.heads * c.D, rng, 1.0f);
    for (bool inverse : {false, true}) {
      Tally& tally = inverse ? bwd : fwd;
      auto run = [&](Backend& be, RopeArgs a) {
        return inverse ? ops::rope_backward(be, a) : ops::rope(be, a);
      };
      Twin<float> in(*gpu, xv), out(*gpu, xv.size());  // (T, heads, D)
      const auto cpu_fn = inverse ? rope_backward_cpu : rope_cpu;
      expect_ok(cpu_fn({c.T, c.heads, c.D, cos_t.h(), sin_t.h(), in.h(), out.h()}));
      expect_ok(run(*gpu, {c.T, c.heads, c.D, cos_t.d(), sin_t.d(), in.d(), out.d()}));
      out.compare(tally, "out");
      // In place: in == out.
      Twin<float> io(*gpu, xv);
      expect_ok(cpu_fn({c.T, c.heads, c.D, cos_t.h(), sin_t.h(), io.h(), io.h()}));
      expect_ok(run(*gpu, {c.T, c.heads, c.D, cos_t.d(), sin_t.d(), io.d(), io.d()}));
      io.compare(tally, "in place");
      tally.cases += 2;
    }
  }
}

// ---- cross-entropy -----------------------------------------------------------------------------

struct CeCase {
  int64_t T, V;
  int ignore_percent;  // chance of a target being ignore_index
  int32_t ignore_index;
};
const std::vector<CeCase> kCeCases = {
    {1, 1, 0, -100},     {1, 7, 100, -100}, {37, 50, 20, -100}, {300, 1000, 10, -100},
    {64, 151, 0, -100},  {20, 33000, 30, -100}, {41, 3, 25, 0}, {5, 40, 100, -1},
    {1500, 33, 5, -100}, {8, 151936, 10, -100},
};

// Logits: normal rows, rows of small integers (ties, repeated maxima) and rows holding +-0 maxima
// next to large negatives.
std::vector<float> ce_logits(const CeCase& c, std::mt19937_64& rng) {
  std::vector<float> z = rand_floats(c.T * c.V, rng, 3.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    float* row = z.data() + t * c.V;
    if (t % 4 == 1)
      for (int64_t e = 0; e < c.V; ++e)
        row[e] = static_cast<float>(static_cast<int>(rng() % 5) - 2);
    if (t % 4 == 2)
      for (int64_t e = 0; e < c.V; ++e)
        row[e] = (rng() % 3 == 0) ? ((rng() & 1) ? -0.0f : 0.0f) : -50.0f - row[e] * row[e];
  }
  return z;
}

std::vector<int32_t> ce_targets(const CeCase& c, std::mt19937_64& rng) {
  std::vector<int32_t> tg(c.T);
  for (int32_t& t : tg)
    t = static_cast<int>(rng() % 100) < c.ignore_percent ? c.ignore_index
                                                         : static_cast<int32_t>(rng() % c.V);
  return tg;
}

template <typename T>
std::vector<T> device_values(Backend& gpu, Twin<T>& x, size_t n) {
  std::vector<T> v(n);
  gpu.copy(v.data(), x.d(), n * sizeof(T), Backend::CopyKind::kDeviceToHost);
  return v;
}

// cross_entropy promises no CPU bytes on CUDA (an online max / sum in one read of the row, the
// hardware exp, backend/ops/model.h): against the CPU reference, the per-token loss within 1e-5
// (relative, at least 1e-5 absolute), each dlogit within one BF16 ulp plus 1e-6 |g| (p - 1 at the
// target cancels), ignored rows exactly +0; the loss-only call the same loss bytes; the rows of
// a part of the batch the same bytes as in the whole (row-local); misaligned logits (scalar loads)
// the same bytes; the mean op the CPU's bytes.
TEST(CudaModelOps, CrossEntropyWithinBoundsOfTheCpu) {
  SKIP_WITHOUT_GPU();
  Tally tally("cross_entropy");
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (const CeCase& c : kCeCases) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " V " + std::to_string(c.V));
    Twin<float> z(*gpu, ce_logits(c, rng));      // (T, V)
    Twin<int32_t> tg(*gpu, ce_targets(c, rng));  // (T)
    Twin<float> loss(*gpu, c.T);                 // (T)
    Twin<uint16_t> dz(*gpu, c.T * c.V);          // (T, V) BF16
    const float g = nd(rng);
    expect_ok(cross_entropy_cpu({c.T, c.V, c.ignore_index, g, z.h(), tg.h(), loss.h(), dz.h()}));
    expect_ok(
        ops::cross_entropy(*gpu, {c.T, c.V, c.ignore_index, g, z.d(), tg.d(), loss.d(), dz.d()}));
    const std::vector<float> lc = device_values(*gpu, loss, c.T);
    const std::vector<uint16_t> dc = device_values(*gpu, dz, c.T * c.V);
    int64_t bad = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      const float want = loss.h()[t];
      if (!(std::fabs(lc[t] - want) <= 1e-5f * std::max(1.0f, std::fabs(want))) && bad++ < 4)
        ADD_FAILURE() << "loss[" << t << "] cuda " << lc[t] << " cpu " << want;
      const bool ignored = tg.h()[t] == c.ignore_index;
      for (int64_t e = 0; e < c.V; ++e) {
        const float a = bf16_to_f32(dc[t * c.V + e]), b = bf16_to_f32(dz.h()[t * c.V + e]);
        // One BF16 ulp is at most 2^-7 of the value.
        const bool ok = ignored ? dc[t * c.V + e] == 0
                                : std::fabs(a - b) <= std::fabs(b) / 128 + 1e-6f * std::fabs(g);
        if (!ok && bad++ < 4)
          ADD_FAILURE() << "dlogits[" << t << ", " << e << "] cuda " << a << " cpu " << b;
      }
    }
    EXPECT_EQ(bad, 0);

    // The loss only: the same bytes.
    Twin<float> loss_only(*gpu, c.T);
    expect_ok(ops::cross_entropy(
        *gpu, {c.T, c.V, c.ignore_index, g, z.d(), tg.d(), loss_only.d(), nullptr}));
    EXPECT_EQ(device_values(*gpu, loss_only, c.T), lc);
    // Rows [t0, T) alone: the same bytes as in the whole batch.
    const int64_t t0 = c.T / 3;
    Twin<float> part_loss(*gpu, c.T - t0);
    Twin<uint16_t> part_dz(*gpu, (c.T - t0) * c.V);
    expect_ok(ops::cross_entropy(*gpu, {c.T - t0, c.V, c.ignore_index, g, z.d() + t0 * c.V,
                                        tg.d() + t0, part_loss.d(), part_dz.d()}));
    EXPECT_EQ(device_values(*gpu, part_loss, c.T - t0), std::vector<float>(lc.begin() + t0, lc.end()));
    EXPECT_EQ(device_values(*gpu, part_dz, (c.T - t0) * c.V),
              std::vector<uint16_t>(dc.begin() + t0 * c.V, dc.end()));

    // Logits 4 bytes off 16-byte alignment (the scalar loads): the same bytes.
    test::Mirror shifted(*gpu, c.T * c.V * sizeof(float), /*shift=*/4);
    shifted.set(z.h(), c.T * c.V * sizeof(float));
    shifted.upload();
    Twin<float> shifted_loss(*gpu, c.T);
    Twin<uint16_t> shifted_dz(*gpu, c.T * c.V);
    expect_ok(ops::cross_entropy(*gpu, {c.T, c.V, c.ignore_index, g, shifted.d<float>(), tg.d(),
                                        shifted_loss.d(), shifted_dz.d()}));
    EXPECT_EQ(device_values(*gpu, shifted_loss, c.T), lc);
    EXPECT_EQ(device_values(*gpu, shifted_dz, c.T * c.V), dc);

    // The mean over the same per-token losses (the CPU's): byte for byte.
    int64_t n = 0;
    for (int64_t t = 0; t < c.T; ++t) n += tg.h()[t] != c.ignore_index;
    Twin<float> mean(*gpu, 1);
    expect_ok(cross_entropy_mean_cpu({c.T, n, loss.h(), mean.h()}));
    loss.upload();  // the CPU's per-token losses on both sides
    expect_ok(ops::cross_entropy_mean(*gpu, {c.T, n, loss.d(), mean.d()}));
    mean.compare(tally, "mean");
    ++tally.cases;
  }
}

// ---- sum_squares -------------------------------------------------------------------------------

TEST(CudaModelOps, SumSquares) {
  SKIP_WITHOUT_GPU();
  Tally tally("sum_squares");
  struct Case {
    int64_t G, n;
  };
  // Zero segments, empty segments, n around the chunk size, more segments than travel inline,
  // more chunks than one group.
  for (const Case& c : std::vector<Case>{{0, 10},
                                         {1, 0},
                                         {3, 0},
                                         {1, 1},
                                         {2, 31},
                                         {3, 65536},
                                         {2, 65537},
                                         {9, 1000},
                                         {2, 200001},
                                         {20, 70001},
                                         {3, 2000001}}) {  // 1467 chunks: two groups
    Twin<float> x(*gpu, rand_floats(c.G * c.n, rng, 2.0f));  // (G, n) packed, odd n unaligned
    Twin<double> out(*gpu, 1);
    Segments<const float> hs, ds;
    hs.n = ds.n = c.n;
    for (int64_t g = 0; g < c.G; ++g) {
      hs.ptr.push_back(x.h() + g * c.n);
      ds.ptr.push_back(x.d() + g * c.n);
    }
    expect_ok(sum_squares_cpu(hs, out.h()));
    expect_ok(ops::sum_squares(*gpu, ds, out.d()));
    out.compare(tally, "sum");
    ++tally.cases;
  }
}

// ---- errors: the CPU's Status, nothing written -------------------------------------------------

void expect_same_error(const Status& cpu, const Status& cuda) {
  ASSERT_FALSE(cpu.is_ok());
  ASSERT_FALSE(cuda.is_ok()) << "CUDA accepted what the CPU rejects: " << cpu.message();
  EXPECT_EQ(cuda.message(), cpu.message());
}

TEST(CudaModelOps, BadIdsAndTargetsAreStatusErrors) {
  SKIP_WITHOUT_GPU();
  Tally tally("error_paths");
  const int64_t T = 300, V = 77, H = 24;
  for (int32_t bad : {static_cast<int32_t>(V), int32_t{-1}, int32_t{1} << 30, int32_t{-100}}) {
    // Two bad entries: the error names the first.
    std::vector<int32_t> idv = rand_ids(T, V, rng);
    const int64_t first = static_cast<int64_t>(rng() % (T / 2));
    idv[first] = bad;
    idv[first + 1 + static_cast<int64_t>(rng() % (T / 2 - 1))] = static_cast<int32_t>(V + 5);
    Twin<int32_t> ids(*gpu, idv);
    Twin<float> table(*gpu, rand_floats(V * H, rng, 1.0f)), out(*gpu, T * H);
    expect_same_error(embedding_cpu({T, V, H, ids.h(), table.h(), out.h()}),
                      ops::embedding(*gpu, {T, V, H, ids.d(), table.d(), out.d()}));
    Twin<float> dout(*gpu, rand_floats(T * H, rng, 1.0f));
    Twin<float> dtable(*gpu, rand_floats(V * H, rng, 1.0f));
    expect_same_error(embedding_backward_cpu({T, V, H, ids.h(), dout.h(), dtable.h()}),
                      ops::embedding_backward(*gpu, {T, V, H, ids.d(), dout.d(), dtable.d()}));
    out.compare(tally, "embedding out");
    dtable.compare(tally, "dtable");

    // Targets: -100 is the default ignore index (fine); with ignore_index -7 it is an error.
    for (int32_t ignore : {-100, -7}) {
      if (bad == ignore) continue;
      Twin<float> z(*gpu, rand_floats(T * V, rng, 2.0f));
      Twin<float> loss(*gpu, T);
      Twin<uint16_t> dz(*gpu, T * V);
      expect_same_error(
          cross_entropy_cpu({T, V, ignore, 1.0f, z.h(), ids.h(), loss.h(), dz.h()}),
          ops::cross_entropy(*gpu, {T, V, ignore, 1.0f, z.d(), ids.d(), loss.d(), dz.d()}));
      loss.compare(tally, "loss");
      dz.compare(tally, "dlogits");
      tally.cases += 2;
    }
    tally.cases += 2;
  }

  // Beyond the attention kernels' head_dim limit the CUDA backend refuses (the CPU computes it).
  const int64_t D = 514;
  Twin<uint16_t> q(*gpu, std::vector<uint16_t>(D, 0x3F80)), o(*gpu, D);
  Twin<float> lse(*gpu, 1);
  const Status st = ops::attention(
      *gpu, {1, 1, 1, 1, D, 0.5f, q.d(), q.d(), q.d(), nullptr, o.d(), lse.d()});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("head"), std::string::npos) << st.message();
  o.compare(tally, "attention o");

  Segments<const float> neg;
  neg.n = -1;
  double h = 0.0;
  Twin<double> out(*gpu, 1);
  // Both through the op entry, which validates once (src/backend/ops/elementwise.cpp).
  expect_same_error(ops::sum_squares(cpu_backend(), neg, &h), ops::sum_squares(*gpu, neg, out.d()));
  out.compare(tally, "sum_squares out");
  tally.cases += 2;
}

}  // namespace
}  // namespace packmoe
