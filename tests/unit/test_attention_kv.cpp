// attention_kv (backend/ops/model.h), the KV-cache attention of inference, on the CPU: against an
// FP64 softmax attention of the same BF16 inputs (within the BF16 output's rounding), and bitwise
// against the whole-sequence attention op's rows for the same queries (the cached step's promise);
// thread-count independence and argument errors. Fresh random inputs per run.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/ops/model.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

struct Case {
  int64_t queries, keys, q_heads, kv_heads, head_dim;
};
// Sq = 1 decode steps, a few new rows after a past, Sq = Skv (no past), D over and under 32.
const std::vector<Case> kCases = {{1, 1, 1, 1, 2},   {1, 7, 4, 2, 8},    {1, 45, 4, 1, 64},
                                  {3, 10, 2, 2, 16}, {5, 5, 6, 3, 34},   {1, 130, 8, 2, 128},
                                  {4, 70, 4, 4, 40}, {2, 33, 3, 1, 96}};

std::vector<uint16_t> rand_bf16(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = f32_to_bf16(d(rng));
  return v;
}

// FP64 softmax attention of query row (i, h) over keys [0, n), from the BF16 values.
std::vector<double> reference_row(const Case& c, const std::vector<uint16_t>& q,
                                  const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                                  int64_t i, int64_t h, double scale) {
  const int64_t D = c.head_dim, g = h / (c.q_heads / c.kv_heads), n = c.keys - c.queries + i + 1;
  std::vector<double> s(n), o(D, 0.0);
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0;
    for (int64_t d = 0; d < D; ++d)
      dot += static_cast<double>(bf16_to_f32(q[(i * c.q_heads + h) * D + d])) *
             bf16_to_f32(k[(j * c.kv_heads + g) * D + d]);
    s[j] = dot * scale;
    m = std::max(m, s[j]);
  }
  for (double& x : s) sum += (x = std::exp(x - m));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) o[d] += s[j] / sum * bf16_to_f32(v[(j * c.kv_heads + g) * D + d]);
  return o;
}

struct Inputs {
  std::vector<uint16_t> q, k, v;  // (Sq, Hq, D), (Skv, Hkv, D), (Skv, Hkv, D)
};

Inputs make_inputs(const Case& c, std::mt19937& rng) {
  return {rand_bf16(c.queries * c.q_heads * c.head_dim, rng, 1.5f),
          rand_bf16(c.keys * c.kv_heads * c.head_dim, rng, 1.5f),
          rand_bf16(c.keys * c.kv_heads * c.head_dim, rng, 1.0f)};
}

std::vector<uint16_t> run_kv(const Case& c, const Inputs& in, float scale) {
  std::vector<uint16_t> o(c.queries * c.q_heads * c.head_dim, 0xFFFF);
  AttentionKvArgs a;
  a.queries = c.queries;
  a.keys = c.keys;
  a.q_heads = c.q_heads;
  a.kv_heads = c.kv_heads;
  a.head_dim = c.head_dim;
  a.scale = scale;
  a.q = in.q.data();
  a.k = in.k.data();
  a.v = in.v.data();
  a.o = o.data();
  const Status s = validate_attention_kv(a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  EXPECT_TRUE(attention_kv_cpu(a).is_ok());
  return o;
}

TEST(AttentionKv, MatchesFp64WithinBf16Rounding) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "Sq " << c.queries << " Skv " << c.keys << " D " << c.head_dim);
    const Inputs in = make_inputs(c, rng);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    const std::vector<uint16_t> o = run_kv(c, in, scale);
    for (int64_t i = 0; i < c.queries; ++i)
      for (int64_t h = 0; h < c.q_heads; ++h) {
        const std::vector<double> want = reference_row(c, in.q, in.k, in.v, i, h, scale);
        for (int64_t d = 0; d < c.head_dim; ++d) {
          // BF16 rounding of the output (2^-9 relative) plus FP32 arithmetic.
          const double got = bf16_to_f32(o[(i * c.q_heads + h) * c.head_dim + d]);
          ASSERT_LE(std::fabs(got - want[d]), std::ldexp(std::fabs(want[d]), -8) + 1e-5)
              << "row " << i << " head " << h << " d " << d;
        }
      }
  }
}

TEST(AttentionKv, EqualsTheWholeSequenceAttentionRowsBitwise) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const Case& c : kCases) {
    const Inputs in = make_inputs(c, rng);
    const int64_t D = c.head_dim, S = c.keys, past = c.keys - c.queries;
    const float scale = 0.37f;
    const std::vector<uint16_t> o = run_kv(c, in, scale);
    // The whole sequence: queries before `past` are random too; only rows >= past are compared.
    std::vector<uint16_t> q_all = rand_bf16(S * c.q_heads * D, rng, 1.5f);
    std::copy(in.q.begin(), in.q.end(), q_all.begin() + past * c.q_heads * D);
    std::vector<uint16_t> o_all(S * c.q_heads * D);
    std::vector<float> lse(c.q_heads * S);
    AttentionArgs a;
    a.batch = 1;
    a.seq = S;
    a.q_heads = c.q_heads;
    a.kv_heads = c.kv_heads;
    a.head_dim = D;
    a.scale = scale;
    a.q = q_all.data();
    a.k = in.k.data();
    a.v = in.v.data();
    a.o = o_all.data();
    a.lse = lse.data();
    ASSERT_TRUE(attention_cpu(a).is_ok());
    const std::vector<uint16_t> rows(o_all.begin() + past * c.q_heads * D, o_all.end());
    EXPECT_EQ(o, rows) << "Sq " << c.queries << " Skv " << c.keys;
  }
}

TEST(AttentionKv, ThreadCountIndependent) {
  std::mt19937 rng(std::random_device{}());
  const Case c{3, 90, 4, 2, 64};
  const Inputs in = make_inputs(c, rng);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<uint16_t> one = run_kv(c, in, 0.125f);
  omp_set_num_threads(3);
  const std::vector<uint16_t> three = run_kv(c, in, 0.125f);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, three);
}

TEST(AttentionKv, ArgumentErrors) {
  std::vector<uint16_t> buf(64);
  AttentionKvArgs a;
  a.queries = 2;
  a.keys = 4;
  a.q_heads = 2;
  a.kv_heads = 1;
  a.head_dim = 4;
  a.scale = 0.5f;
  a.q = a.k = a.v = buf.data();
  a.o = buf.data();
  EXPECT_TRUE(validate_attention_kv(a).is_ok());
  auto expect_error = [](AttentionKvArgs x, const std::string& part) {
    const Status s = validate_attention_kv(x);
    ASSERT_FALSE(s.is_ok()) << part;
    EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
  };
  AttentionKvArgs b = a;
  b.queries = 5;
  expect_error(b, "at least as many keys");
  b = a;
  b.queries = 0;
  expect_error(b, "Sq (queries)");
  b = a;
  b.kv_heads = 3;
  b.q_heads = 4;
  expect_error(b, "not a multiple of Hkv");
  b = a;
  b.o = nullptr;
  expect_error(b, "o is null");
  b = a;
  b.scale = 0.0f;
  expect_error(b, "scale");
}

}  // namespace
}  // namespace packmoe
