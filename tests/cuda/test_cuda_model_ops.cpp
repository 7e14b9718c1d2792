// CUDA dense decoder ops (embedding, RMSNorm, RoPE, attention, cross-entropy; forward and
// backward) and sum_squares against the CPU reference, BYTE FOR BYTE. Every output buffer has a
// sentinel tail and starts with the same bytes on both sides, so a stray write is a mismatch too;
// inputs stay finite (the GPU canonicalises NaN payloads, x86 does not). Fresh seed per test,
// printed on failure. Backend interface only; skips without a GPU.
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
#include "core/codecs.h"

namespace packmoe {
namespace {

constexpr size_t kTail = 16;  // sentinel elements after every buffer
constexpr uint8_t kSentinel = 0xA5;

Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}

#define SKIP_WITHOUT_GPU()                                                              \
  Backend* gpu = gpu_or_null();                                                         \
  if (gpu == nullptr)                                                                   \
    GTEST_SKIP() << "no usable GPU: " << get_backend(Device::kCUDA).status().message(); \
  const uint32_t seed = std::random_device{}();                                         \
  SCOPED_TRACE(testing::Message() << "seed " << seed);                                  \
  std::mt19937_64 rng(seed)

// One line per op: cases run and mismatching bytes over all of them.
struct Tally {
  std::string op;
  int cases = 0;
  size_t mismatches = 0;
  explicit Tally(std::string name) : op(std::move(name)) {}
  ~Tally() {
    std::printf("[model_ops cuda==cpu] op=%s cases=%d mismatches=%zu\n", op.c_str(), cases,
                mismatches);
    std::fflush(stdout);
    EXPECT_EQ(mismatches, 0u) << op;
  }
};

// A host buffer (the CPU reference's) and its device twin: n elements plus a sentinel tail,
// identical bytes at construction.
template <typename T>
class Twin {
 public:
  Twin(Backend& gpu, const std::vector<T>& values) : gpu_(&gpu), n_(values.size()) {
    bytes_ = (n_ + kTail) * sizeof(T);
    host_.assign(bytes_, kSentinel);
    if (n_) std::memcpy(host_.data(), values.data(), n_ * sizeof(T));
    dev_ = gpu.allocate(bytes_);
    gpu.copy(dev_, host_.data(), bytes_, Backend::CopyKind::kHostToDevice);
  }
  // n elements of sentinel bytes (an output).
  Twin(Backend& gpu, size_t n) : Twin(gpu, sentinels(n)) {}
  ~Twin() { gpu_->deallocate(dev_); }
  Twin(const Twin&) = delete;
  Twin& operator=(const Twin&) = delete;

  T* h() { return reinterpret_cast<T*>(host_.data()); }
  T* d() { return static_cast<T*>(dev_); }

  // Differing bytes between the device image and the host image, tail included; prints the first.
  size_t mismatches(const char* what) {
    std::vector<uint8_t> dv(bytes_);
    gpu_->copy(dv.data(), dev_, bytes_, Backend::CopyKind::kDeviceToHost);
    size_t bad = 0;
    for (size_t i = 0; i < bytes_; ++i)
      if (dv[i] != host_[i]) {
        if (bad == 0)
          std::printf("  %s: first mismatch at byte %zu of %zu: cpu 0x%02x cuda 0x%02x\n", what, i,
                      bytes_, host_[i], dv[i]);
        ++bad;
      }
    return bad;
  }

 private:
  static std::vector<T> sentinels(size_t n) {
    std::vector<T> v(n);
    if (n) std::memset(v.data(), kSentinel, n * sizeof(T));
    return v;
  }
  Backend* gpu_;
  size_t n_;
  size_t bytes_ = 0;
  std::vector<uint8_t> host_;
  void* dev_ = nullptr;
};

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
    tally.mismatches += out.mismatches("out");
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
    tally.mismatches += dtable.mismatches("dtable");
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
    tally.mismatches += y.mismatches("y") + rstd.mismatches("rstd");
    ++tally.cases;
  }
}

TEST(CudaModelOps, RmsNormBackward) {
  SKIP_WITHOUT_GPU();
  Tally tally("rms_norm_backward");
  for (const NormCase& c : kNormCases) {
    const std::vector<float> xv = norm_input(c, rng), wv = rand_floats(c.D, rng, 1.0f);
    std::vector<float> yv(c.N * c.D), rv(c.N);  // the forward's rstd feeds both backends
    expect_ok(rms_norm_cpu({c.N, c.D, c.eps, xv.data(), wv.data(), yv.data(), rv.data()}));
    Twin<float> x(*gpu, xv), w(*gpu, wv), rstd(*gpu, rv);
    Twin<float> dy(*gpu, rand_floats(c.N * c.D, rng, 1.0f));  // (N, D)
    Twin<float> dx(*gpu, c.N * c.D), dw(*gpu, c.D);           // (N, D), (D)
    expect_ok(rms_norm_backward_cpu({c.N, c.D, x.h(), w.h(), rstd.h(), dy.h(), dx.h(), dw.h()}));
    expect_ok(ops::rms_norm_backward(*gpu, {c.N, c.D, x.d(), w.d(), rstd.d(), dy.d(), dx.d(), dw.d()}));
    tally.mismatches += dx.mismatches("dx") + dw.mismatches("dweight");
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
      tally.mismatches += out.mismatches("out");
      // In place: in == out.
      Twin<float> io(*gpu, xv);
      expect_ok(cpu_fn({c.T, c.heads, c.D, cos_t.h(), sin_t.h(), io.h(), io.h()}));
      expect_ok(run(*gpu, {c.T, c.heads, c.D, cos_t.d(), sin_t.d(), io.d(), io.d()}));
      tally.mismatches += io.mismatches("in place");
      tally.cases += 2;
    }
  }
}

// ---- attention ---------------------------------------------------------------------------------

struct AttnCase {
  int64_t B, S, Hq, Hkv, D;
};
// S below, at and above warp multiples; D 8..512 (every padded width of the tiled kernels, D % 32
// != 0, and the one-warp-per-row kernels above 128); GQA groups 1, 2, 3, 4, 8, 16. The longer
// cases make the tiled kernels run several chunks per lane pass (forward / dq: more than 32 keys
// of one lane class; dk / dv: more than 64 query pairs) and several key tiles per residue class.
const std::vector<AttnCase> kAttnCases = {
    {1, 1, 1, 1, 16},   {2, 33, 4, 2, 64},  {1, 70, 8, 1, 128},  {1, 45, 2, 2, 16},
    {2, 17, 8, 4, 128}, {1, 100, 4, 4, 64}, {3, 9, 1, 1, 48},    {1, 64, 8, 8, 32},
    {1, 37, 2, 1, 256}, {1, 20, 2, 1, 512}, {1, 130, 4, 1, 80},  {1, 1100, 2, 1, 128},
    {2, 300, 16, 2, 8}, {1, 150, 6, 2, 64}, {1, 530, 4, 1, 32},  {1, 260, 32, 2, 16},
};

float attn_scale(int64_t D) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))); }

TEST(CudaModelOps, Attention) {
  SKIP_WITHOUT_GPU();
  Tally tally("attention");
  for (const AttnCase& c : kAttnCases) {
    const int64_t nq = c.B * c.S * c.Hq * c.D, nkv = c.B * c.S * c.Hkv * c.D;
    Twin<float> q(*gpu, rand_floats(nq, rng, 1.5f));                         // (B, S, Hq, D)
    Twin<float> k(*gpu, rand_floats(nkv, rng, 1.5f));                        // (B, S, Hkv, D)
    Twin<float> v(*gpu, rand_floats(nkv, rng, 1.0f));                        // (B, S, Hkv, D)
    Twin<float> o(*gpu, nq);                                                 // (B, S, Hq, D)
    Twin<float> rmax(*gpu, c.B * c.Hq * c.S), rsum(*gpu, c.B * c.Hq * c.S);  // (B, Hq, S)
    const float scale = attn_scale(c.D);
    expect_ok(attention_cpu(
        {c.B, c.S, c.Hq, c.Hkv, c.D, scale, q.h(), k.h(), v.h(), o.h(), rmax.h(), rsum.h()}));
    expect_ok(ops::attention(*gpu, 
        {c.B, c.S, c.Hq, c.Hkv, c.D, scale, q.d(), k.d(), v.d(), o.d(), rmax.d(), rsum.d()}));
    tally.mismatches += o.mismatches("o") + rmax.mismatches("row_max") + rsum.mismatches("row_sum");
    ++tally.cases;
  }
}

TEST(CudaModelOps, AttentionBackward) {
  SKIP_WITHOUT_GPU();
  Tally tally("attention_backward");
  for (const AttnCase& c : kAttnCases) {
    const int64_t nq = c.B * c.S * c.Hq * c.D, nkv = c.B * c.S * c.Hkv * c.D;
    const int64_t rows = c.B * c.Hq * c.S;
    const float scale = attn_scale(c.D);
    const std::vector<float> qv = rand_floats(nq, rng, 1.5f), kv = rand_floats(nkv, rng, 1.5f),
                             vv = rand_floats(nkv, rng, 1.0f);
    // The CPU forward's o, row_max, row_sum feed both backends.
    std::vector<float> ov(nq), mv(rows), sv(rows);
    expect_ok(attention_cpu({c.B, c.S, c.Hq, c.Hkv, c.D, scale, qv.data(), kv.data(), vv.data(),
                             ov.data(), mv.data(), sv.data()}));
    Twin<float> q(*gpu, qv), k(*gpu, kv), v(*gpu, vv), o(*gpu, ov), rmax(*gpu, mv), rsum(*gpu, sv);
    Twin<float> dout(*gpu, rand_floats(nq, rng, 1.0f));  // (B, S, Hq, D)
    Twin<float> dq(*gpu, nq), dk(*gpu, nkv), dv(*gpu, nkv);
    expect_ok(attention_backward_cpu({c.B, c.S, c.Hq, c.Hkv, c.D, scale, q.h(), k.h(), v.h(), o.h(),
                                      rmax.h(), rsum.h(), dout.h(), dq.h(), dk.h(), dv.h()}));
    expect_ok(
        ops::attention_backward(*gpu, {c.B, c.S, c.Hq, c.Hkv, c.D, scale, q.d(), k.d(), v.d(), o.d(),
                                 rmax.d(), rsum.d(), dout.d(), dq.d(), dk.d(), dv.d()}));
    tally.mismatches += dq.mismatches("dq") + dk.mismatches("dk") + dv.mismatches("dv");
    ++tally.cases;
  }
}

// ---- cross-entropy -----------------------------------------------------------------------------

struct CeCase {
  int64_t T, V;
  int ignore_percent;  // chance of a target being ignore_index
  int32_t ignore_index;
  bool with_valid;
};
const std::vector<CeCase> kCeCases = {
    {1, 1, 0, -100, true},        {1, 7, 100, -100, true},  {37, 50, 20, -100, true},
    {300, 1000, 10, -100, false}, {64, 151, 0, -100, true}, {20, 33000, 30, -100, true},
    {41, 3, 25, 0, true},         {5, 40, 100, -1, false},  {1500, 33, 5, -100, true},
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

TEST(CudaModelOps, CrossEntropy) {
  SKIP_WITHOUT_GPU();
  Tally tally("cross_entropy");
  for (const CeCase& c : kCeCases) {
    Twin<float> z(*gpu, ce_logits(c, rng));      // (T, V)
    Twin<int32_t> tg(*gpu, ce_targets(c, rng));  // (T)
    Twin<float> loss(*gpu, 1), rmax(*gpu, c.T), rsum(*gpu, c.T);
    Twin<int64_t> valid(*gpu, 1);
    auto args = [&](bool dev) {
      CrossEntropyArgs a{c.T, c.V, c.ignore_index};
      a.logits = dev ? z.d() : z.h();
      a.targets = dev ? tg.d() : tg.h();
      a.loss = dev ? loss.d() : loss.h();
      a.valid = !c.with_valid ? nullptr : dev ? valid.d() : valid.h();
      a.row_max = dev ? rmax.d() : rmax.h();
      a.row_sum = dev ? rsum.d() : rsum.h();
      return a;
    };
    expect_ok(cross_entropy_cpu(args(false)));
    expect_ok(ops::cross_entropy(*gpu, args(true)));
    tally.mismatches += loss.mismatches("loss") + valid.mismatches("valid") +
                        rmax.mismatches("row_max") + rsum.mismatches("row_sum");
    ++tally.cases;
  }
}

TEST(CudaModelOps, CrossEntropyBackward) {
  SKIP_WITHOUT_GPU();
  Tally tally("cross_entropy_backward");
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (const CeCase& c : kCeCases) {
    const std::vector<float> zv = ce_logits(c, rng);
    const std::vector<int32_t> tv = ce_targets(c, rng);
    std::vector<float> mv(c.T), sv(c.T);
    float loss = 0.0f;
    expect_ok(cross_entropy_cpu(
        {c.T, c.V, c.ignore_index, zv.data(), tv.data(), &loss, nullptr, mv.data(), sv.data()}));
    Twin<float> z(*gpu, zv), rmax(*gpu, mv), rsum(*gpu, sv);
    Twin<int32_t> tg(*gpu, tv);
    Twin<float> dz(*gpu, c.T * c.V);  // (T, V)
    const float dloss = nd(rng);
    expect_ok(cross_entropy_backward_cpu(
        {c.T, c.V, c.ignore_index, dloss, z.h(), tg.h(), rmax.h(), rsum.h(), dz.h()}));
    expect_ok(ops::cross_entropy_backward(*gpu, 
        {c.T, c.V, c.ignore_index, dloss, z.d(), tg.d(), rmax.d(), rsum.d(), dz.d()}));
    tally.mismatches += dz.mismatches("dlogits");
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
  // Zero segments, empty segments, n around the chunk size, more segments than travel inline.
  for (const Case& c : std::vector<Case>{{0, 10},
                                         {1, 0},
                                         {3, 0},
                                         {1, 1},
                                         {2, 31},
                                         {3, 65536},
                                         {2, 65537},
                                         {9, 1000},
                                         {2, 200001},
                                         {20, 70001}}) {
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
    tally.mismatches += out.mismatches("sum");
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
    tally.mismatches += out.mismatches("embedding out") + dtable.mismatches("dtable");

    // Targets: -100 is the default ignore index (fine); with ignore_index -7 it is an error.
    for (int32_t ignore : {-100, -7}) {
      if (bad == ignore) continue;
      Twin<float> z(*gpu, rand_floats(T * V, rng, 2.0f));
      Twin<float> loss(*gpu, 1), rmax(*gpu, T), rsum(*gpu, T), dz(*gpu, T * V);
      Twin<int64_t> valid(*gpu, 1);
      expect_same_error(cross_entropy_cpu({T, V, ignore, z.h(), ids.h(), loss.h(), valid.h(),
                                           rmax.h(), rsum.h()}),
                        ops::cross_entropy(*gpu, {T, V, ignore, z.d(), ids.d(), loss.d(), valid.d(),
                                            rmax.d(), rsum.d()}));
      expect_same_error(cross_entropy_backward_cpu(
                            {T, V, ignore, 1.0f, z.h(), ids.h(), rmax.h(), rsum.h(), dz.h()}),
                        ops::cross_entropy_backward(*gpu, 
                            {T, V, ignore, 1.0f, z.d(), ids.d(), rmax.d(), rsum.d(), dz.d()}));
      tally.mismatches += loss.mismatches("loss") + valid.mismatches("valid") +
                          rmax.mismatches("row_max") + rsum.mismatches("row_sum") +
                          dz.mismatches("dlogits");
      tally.cases += 2;
    }
    tally.cases += 2;
  }

  // Beyond the kernel's head_dim limit the CUDA backend refuses (the CPU computes it).
  const int64_t D = 514;
  Twin<float> q(*gpu, rand_floats(D, rng, 1.0f)), o(*gpu, D), m(*gpu, 1), s(*gpu, 1);
  const Status st = ops::attention(*gpu, {1, 1, 1, 1, D, 0.5f, q.d(), q.d(), q.d(), o.d(), m.d(), s.d()});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("head_dim"), std::string::npos) << st.message();
  tally.mismatches += o.mismatches("attention o");

  Segments<const float> neg;
  neg.n = -1;
  double h = 0.0;
  Twin<double> out(*gpu, 1);
  expect_same_error(sum_squares_cpu(neg, &h), ops::sum_squares(*gpu, neg, out.d()));
  tally.mismatches += out.mismatches("sum_squares out");
  tally.cases += 2;
}

}  // namespace
}  // namespace packmoe
