// Forward of the MoE non-GEMM CPU ops (backend/ops/moe.h) against hand-derived values and FP64
// computed in this file: moe_exp_f32, softmax / top-k (ties to the lower expert), renormalisation,
// aux loss, routing plan (counts, padding, destination rows), permute / unpermute round trips,
// SwiGLU, the R32 reduction order, thread-count independence, and argument errors.
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
#include "backend/ops/moe.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }
#define RANDOM_SEED(name)             \
  const uint32_t name = fresh_seed(); \
  SCOPED_TRACE("random seed " + std::to_string(name))

// Distance in units in the last place between two finite FP32 values of the same sign.
int64_t ulp_distance(float a, float b) {
  return std::llabs(static_cast<int64_t>(f32_bits(a)) - static_cast<int64_t>(f32_bits(b)));
}

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

struct RouterOut {
  std::vector<float> probs;  // (T, E)
  std::vector<int32_t> idx;  // (T, k)
  std::vector<float> w;      // (T, k)
};

RouterOut run_router(const std::vector<float>& logits, int64_t T, int64_t E, int64_t k, bool norm) {
  RouterOut o{std::vector<float>(T * E), std::vector<int32_t>(T * k), std::vector<float>(T * k)};
  RouterTopkArgs a;
  a.tokens = T;
  a.experts = E;
  a.top_k = k;
  a.norm_topk_prob = norm;
  a.logits = logits.data();
  a.probs = o.probs.data();
  a.idx = o.idx.data();
  a.w = o.w.data();
  const Status s = router_topk_cpu(a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return o;
}

float run_aux(const std::vector<float>& probs, const std::vector<int32_t>& idx, int64_t T,
              int64_t E, int64_t k) {
  float aux = -1.0f;
  AuxLossArgs a;
  a.tokens = T;
  a.experts = E;
  a.top_k = k;
  a.probs = probs.data();
  a.idx = idx.data();
  a.aux = &aux;
  const Status s = aux_loss_cpu(a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return aux;
}

// ---- exp ----------------------------------------------------------------------------------------

TEST(MoeExp, WithinOneUlpOfFp64OverTheWholeRange) {
  EXPECT_EQ(moe_exp_f32(0.0f), 1.0f);
  EXPECT_EQ(moe_exp_f32(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(moe_exp_f32(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(moe_exp_f32(89.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(moe_exp_f32(-104.0f), 0.0f);
  EXPECT_TRUE(std::isnan(moe_exp_f32(std::numeric_limits<float>::quiet_NaN())));
  // Every 97th FP32 magnitude up to ln(FLT_MAX), both signs while the result stays normal.
  int64_t worst = 0;
  for (uint32_t b = 0; b < f32_bits(88.72f); b += 97)
    for (const float x : {f32_from_bits(b), -f32_from_bits(b)}) {
      if (x < -87.0f) continue;
      const float ref = static_cast<float>(std::exp(static_cast<double>(x)));
      worst = std::max(worst, ulp_distance(moe_exp_f32(x), ref));
    }
  EXPECT_LE(worst, 1);  // an exhaustive run over all 2^32 inputs also gives 1
  // Subnormal results round once: within one subnormal quantum (2^-149) of exp.
  for (float x = -103.9f; x < -87.4f; x += 0.0137f) {
    const double ref = std::exp(static_cast<double>(x));
    EXPECT_LE(std::fabs(moe_exp_f32(x) - ref), std::ldexp(1.0, -149)) << x;
  }
}

// ---- router -------------------------------------------------------------------------------------

TEST(MoeRouter, SoftmaxMatchesFp64AndTiesGoToTheLowerExpert) {
  // Token 0: experts 1 and 2 tie (identical logits give identical bits); token 1: 0, 2, 3 tie.
  const int64_t T = 2, E = 4, k = 3;
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 0.0f,  //
                                     2.0f, 0.0f, 2.0f, 2.0f};
  const RouterOut o = run_router(logits, T, E, k, false);
  for (int64_t t = 0; t < T; ++t) {
    double m = -1e300, s = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(logits[t * E + e]));
    for (int64_t e = 0; e < E; ++e) s += std::exp(logits[t * E + e] - m);
    for (int64_t e = 0; e < E; ++e)
      EXPECT_NEAR(o.probs[t * E + e], std::exp(logits[t * E + e] - m) / s, 3e-7) << t << "," << e;
  }
  EXPECT_EQ(o.probs[1], o.probs[2]);
  EXPECT_EQ(o.idx, (std::vector<int32_t>{1, 2, 0, /**/ 0, 2, 3}));
  for (int64_t i = 0; i < T * k; ++i) EXPECT_EQ(o.w[i], o.probs[(i / k) * E + o.idx[i]]);
}

TEST(MoeRouter, RenormalisedWeights) {
  // logits ln(1..4): probs (0.1, 0.2, 0.3, 0.4); top-2 = experts 3, 2 with w (0.4, 0.3), or
  // renormalised (4/7, 3/7).
  const std::vector<float> logits = {std::log(1.0f), std::log(2.0f), std::log(3.0f),
                                     std::log(4.0f)};
  const RouterOut raw = run_router(logits, 1, 4, 2, false);
  const RouterOut norm = run_router(logits, 1, 4, 2, true);
  EXPECT_EQ(raw.idx, (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(norm.idx, raw.idx);
  EXPECT_NEAR(raw.w[0], 0.4, 3e-7);
  EXPECT_NEAR(raw.w[1], 0.3, 3e-7);
  EXPECT_NEAR(norm.w[0], 4.0 / 7.0, 3e-7);
  EXPECT_NEAR(norm.w[1], 3.0 / 7.0, 3e-7);
  // Two tied picks renormalise to exactly 1/2 each: p / (p + p) is exact.
  const RouterOut tie = run_router({1.0f, 3.0f, 3.0f, 0.0f}, 1, 4, 2, true);
  EXPECT_EQ(tie.w, (std::vector<float>{0.5f, 0.5f}));
}

TEST(MoeRouter, TopKIsSortedAndRandomInputsMatchFp64) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  const int64_t T = 37, E = 40, k = 6;  // E > 32: the R32 sum has strided lanes
  std::vector<float> logits(T * E);
  for (auto& x : logits) x = d(rng);
  const RouterOut o = run_router(logits, T, E, k, true);
  for (int64_t t = 0; t < T; ++t) {
    const float* z = &logits[t * E];
    double m = -1e300, s = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<double>(z[e]));
    for (int64_t e = 0; e < E; ++e) s += std::exp(z[e] - m);
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    double S = 0;
    for (int64_t j = 0; j < k; ++j) S += std::exp(z[order[j]] - m) / s;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(o.idx[t * k + j], order[j]) << t << "," << j;
      EXPECT_NEAR(o.w[t * k + j], std::exp(z[order[j]] - m) / s / S, 1e-6);
    }
  }
}

// ---- aux loss -----------------------------------------------------------------------------------

TEST(MoeAuxLoss, HandCases) {
  // T = 2, E = 3, k = 2: probs t0 (1/2, 1/4, 1/4), t1 (1/8, 5/8, 1/4); idx t0 (0, 1), t1 (1, 2).
  //   f[0] = (1/2, 1/2, 0)   (choice 0 went to experts 0 and 1)
  //   f[1] = (0, 1/2, 1/2)   (choice 1 went to experts 1 and 2)
  //   pbar = (5/16, 7/16, 1/4)
  //   aux = 3 * (1/2 * 5/16 + 1/2 * 7/16 + 1/2 * 7/16 + 1/2 * 1/4) = 3 * 23/32 = 69/32 = 2.15625
  // Every value is dyadic, so the FP32 result is exact.
  EXPECT_EQ(run_aux({0.5f, 0.25f, 0.25f, 0.125f, 0.625f, 0.25f}, {0, 1, 1, 2}, 2, 3, 2), 2.15625f);
  // Perfect balance (uniform probs, every expert chosen equally often at every j) gives aux = k:
  // E * sum_{j,e} (1/E)(1/E) = k. T = 4, E = 4, k = 2, idx rows rotate.
  EXPECT_EQ(run_aux(std::vector<float>(16, 0.25f), {0, 1, 1, 2, 2, 3, 3, 0}, 4, 4, 2), 2.0f);
  // Collapse onto expert 0 with probs concentrated on it: aux = E * 1 * pbar[0] = 2 * 3/4.
  EXPECT_EQ(run_aux({0.75f, 0.25f, 0.75f, 0.25f}, {0, 0}, 2, 2, 1), 1.5f);
}

// ---- routing plan -------------------------------------------------------------------------------

TEST(MoeRoutingPlan, HandCasePaddedTo32) {
  // T = 3, E = 4, k = 2, idx = ((2, 0), (0, 1), (2, 0)); expert 3 gets nothing.
  //   expert 0: (0,1) (1,0) (2,1) -> rows 0, 1, 2; rows 3..31 padding
  //   expert 1: (1,1)             -> row 32; rows 33..63 padding
  //   expert 2: (0,0) (2,0)       -> rows 64, 65; rows 66..95 padding
  //   expert 3: no rows
  const std::vector<int32_t> idx = {2, 0, 0, 1, 2, 0};
  Result<RoutingPlan> r = build_routing_plan(idx.data(), 3, 4, 2, 32);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const RoutingPlan& p = r.value();
  EXPECT_EQ(p.counts, (std::vector<int64_t>{3, 1, 2, 0}));
  EXPECT_EQ(p.padded_counts, (std::vector<int64_t>{32, 32, 32, 0}));
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 32, 64, 96, 96}));
  EXPECT_EQ(p.rows, 96);
  EXPECT_EQ(p.dest, (std::vector<int32_t>{64, 0, 1, 32, 65, 2}));
  ASSERT_EQ(p.row_slot.size(), 96u);
  std::vector<int32_t> want(96, -1);
  want[0] = 1;   // (0, 1)
  want[1] = 2;   // (1, 0)
  want[2] = 5;   // (2, 1)
  want[32] = 3;  // (1, 1)
  want[64] = 0;  // (0, 0)
  want[65] = 4;  // (2, 0)
  EXPECT_EQ(p.row_slot, want);

  Result<RoutingPlan> r1 = build_routing_plan(idx.data(), 3, 4, 2, 1);
  ASSERT_TRUE(r1.is_ok());
  EXPECT_EQ(r1.value().offsets, (std::vector<int64_t>{0, 3, 4, 6, 6}));
  EXPECT_EQ(r1.value().dest, (std::vector<int32_t>{4, 0, 1, 3, 5, 2}));
  EXPECT_EQ(r1.value().row_slot, (std::vector<int32_t>{1, 2, 5, 3, 0, 4}));

  Result<RoutingPlan> r16 = build_routing_plan(idx.data(), 3, 4, 2, 16);
  ASSERT_TRUE(r16.is_ok());
  EXPECT_EQ(r16.value().padded_counts, (std::vector<int64_t>{16, 16, 16, 0}));
  EXPECT_EQ(r16.value().dest, (std::vector<int32_t>{32, 0, 1, 16, 33, 2}));
}

// The backend op (CPU) + routing_plan_from_counts against build_routing_plan: the hand case above
// and random routings (independent of the op's chunking: the host plan walks pairs in order).
void expect_op_matches_host_plan(const std::vector<int32_t>& idx, int64_t T, int64_t E, int64_t k,
                                 int64_t align) {
  SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E) + " k " + std::to_string(k) +
               " align " + std::to_string(align));
  Result<RoutingPlan> want = build_routing_plan(idx.data(), T, E, k, align);
  ASSERT_TRUE(want.is_ok()) << want.status().message();
  const RoutingPlan& w = want.value();
  RoutingPlanArgs a;
  a.tokens = T, a.experts = E, a.top_k = k, a.align = align;
  a.max_rows = routing_plan_max_rows(T, E, k, align) + 3;  // spare rows must read -1 too
  std::vector<int32_t> dest(T * k, 12345), row_slot(a.max_rows, 12345);
  std::vector<int64_t> counts(E + 1, 777), padded(E, 777), rows(1, 777);
  a.idx = idx.data(), a.dest = dest.data(), a.row_slot = row_slot.data(), a.counts = counts.data();
  a.padded_counts = padded.data(), a.rows = rows.data();
  ASSERT_TRUE(routing_plan_cpu(a).is_ok());
  EXPECT_EQ(dest, w.dest);
  EXPECT_EQ(padded, w.padded_counts) << "the GEMMs' device counts";
  EXPECT_EQ(rows[0], w.rows) << "M on the device";
  std::vector<int32_t> want_slots = w.row_slot;
  want_slots.resize(a.max_rows, -1);
  EXPECT_EQ(row_slot, want_slots);
  EXPECT_EQ(counts[E], 0);
  Result<RoutingPlan> got = routing_plan_from_counts(counts.data(), T, E, k, align);
  ASSERT_TRUE(got.is_ok()) << got.status().message();
  EXPECT_EQ(got.value().counts, w.counts);
  EXPECT_EQ(got.value().padded_counts, w.padded_counts);
  EXPECT_EQ(got.value().offsets, w.offsets);
  EXPECT_EQ(got.value().rows, w.rows);
  EXPECT_TRUE(got.value().dest.empty() && got.value().row_slot.empty());
}

TEST(MoeRoutingPlan, BackendOpEqualsHostPlan) {
  expect_op_matches_host_plan({2, 0, 0, 1, 2, 0}, 3, 4, 2, 32);  // the hand case above
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (int rep = 0; rep < 20; ++rep) {
    const int64_t E = 1 + rng() % 70, k = 1 + rng() % std::min<int64_t>(E, 8);
    const int64_t T = 1 + rng() % 600;
    const int64_t align = std::vector<int64_t>{1, 16, 32}[rng() % 3];
    std::vector<int32_t> idx(T * k);
    for (int32_t& e : idx) e = static_cast<int32_t>(rng() % E);  // repeats allowed: counts only
    expect_op_matches_host_plan(idx, T, E, k, align);
  }
}

// ---- permute / unpermute ------------------------------------------------------------------------

TEST(MoePermute, RoundTripAndZeroPadding) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t T = 19, E = 5, k = 2, H = 24;
  // A random top-2 without repeats per token.
  std::vector<int32_t> idx(T * k);
  for (int64_t t = 0; t < T; ++t) {
    idx[t * k] = static_cast<int32_t>(rng() % E);
    idx[t * k + 1] = static_cast<int32_t>((idx[t * k] + 1 + rng() % (E - 1)) % E);
  }
  Result<RoutingPlan> r = build_routing_plan(idx.data(), T, E, k, 32);
  ASSERT_TRUE(r.is_ok());
  const RoutingPlan& p = r.value();
  const int64_t M = p.rows;
  const std::vector<uint16_t> x = random_bf16(T * H, rng);
  std::vector<uint16_t> xp(M * H, 0xFFFF);  // NaN sentinel: every row must be written

  PermuteArgs pa;
  pa.tokens = T;
  pa.hidden = H;
  pa.top_k = k;
  pa.rows = M;
  pa.row_slot = p.row_slot.data();
  pa.dest = p.dest.data();
  pa.x = x.data();
  pa.xp = xp.data();
  ASSERT_TRUE(permute_cpu(pa).is_ok());
  for (int64_t row = 0; row < M; ++row) {
    const int32_t slot = p.row_slot[row];
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(xp[row * H + h], slot < 0 ? 0 : x[(slot / k) * H + h]) << row << "," << h;
  }

  // Combine with w = (1, 0) and with w = (1/2, 1/2): both give x back exactly.
  for (const std::vector<float>& wj : {std::vector<float>{1.0f, 0.0f}, {0.5f, 0.5f}}) {
    std::vector<float> w(T * k);
    for (int64_t i = 0; i < T * k; ++i) w[i] = wj[i % k];
    std::vector<uint16_t> y(T * H);
    UnpermuteArgs ua;
    ua.tokens = T;
    ua.hidden = H;
    ua.top_k = k;
    ua.rows = M;
    ua.dest = p.dest.data();
    ua.w = w.data();
    ua.yp_dtype = DType::kBF16;
    ua.yp = xp.data();
    ua.y_dtype = DType::kBF16;
    ua.y = y.data();
    ASSERT_TRUE(unpermute_cpu(ua).is_ok());
    EXPECT_EQ(y, x);
  }

  // The adjoint gathers: dxp = xp sums each token's k copies, so dx = k * x exactly (k = 2).
  std::vector<float> dx(T * H);
  PermuteBackwardArgs pb;
  pb.tokens = T;
  pb.hidden = H;
  pb.top_k = k;
  pb.rows = M;
  pb.dest = p.dest.data();
  pb.dxp_dtype = DType::kBF16;
  pb.dxp = xp.data();
  pb.dx = dx.data();
  ASSERT_TRUE(permute_backward_cpu(pb).is_ok());
  for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(dx[i], 2.0f * bf16_to_f32(x[i]));
}

// ---- SwiGLU -------------------------------------------------------------------------------------

TEST(MoeSwiglu, KnownValues) {
  // silu(0) = 0, silu(1) = 1 / (1 + e^-1), silu(-1) = -1 / (1 + e), silu(2) = 2 / (1 + e^-2);
  // large |g|: silu(20) ~ 20, silu(-20) ~ -4.1e-8. Row 1 is a padding row (zeros in, zeros out).
  const int64_t M = 2, F = 6;
  const float g[F] = {0.0f, 1.0f, -1.0f, 2.0f, 20.0f, -20.0f};
  const float u[F] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 2.0f};
  const double silu[F] = {0.0,
                          0.7310585786300049,
                          -0.2689414213699951,
                          1.7615941559557646,
                          19.999999958776925,
                          -4.122307236380407e-8};
  std::vector<float> in(M * 2 * F, 0.0f);
  for (int64_t f = 0; f < F; ++f) {
    in[f] = g[f];
    in[F + f] = u[f];
  }
  std::vector<float> out(M * F, -1.0f);
  std::vector<uint16_t> out_bf16(M * F);
  SwigluArgs a;
  a.rows = M;
  a.ffn = F;
  a.in_dtype = DType::kF32;
  a.in = in.data();
  a.out_dtype = DType::kF32;
  a.out = out.data();
  ASSERT_TRUE(swiglu_cpu(a).is_ok());
  a.out_dtype = DType::kBF16;
  a.out = out_bf16.data();
  ASSERT_TRUE(swiglu_cpu(a).is_ok());
  EXPECT_EQ(out[0], 0.0f);
  for (int64_t f = 0; f < F; ++f) {
    EXPECT_NEAR(out[f], silu[f] * u[f], 4e-7 * std::fabs(silu[f] * u[f])) << f;
    EXPECT_EQ(out_bf16[f], f32_to_bf16(out[f])) << f;  // BF16 out = the FP32 value rounded once
    EXPECT_EQ(out[F + f], 0.0f);
  }
}

// ---- exact order and thread independence --------------------------------------------------------

TEST(MoeReduction, DwUsesTheR32Order) {
  // dw = R32 sum over H = 33 of dy * yp with terms (1, 2^-24 x 32): lane 0 holds 1 + 2^-24 -> 1,
  // lanes 1..31 hold 2^-24; the tree then gives 1 + 15 * 2^-23 (a sequential sum gives 1, the
  // exact sum is 1 + 16 * 2^-23). A backend that matches the CPU must reproduce this.
  const int64_t H = 33;
  std::vector<float> dy(H, 1.0f), yp(H, std::ldexp(1.0f, -24)), w = {1.0f};
  yp[0] = 1.0f;
  std::vector<float> dyp(H), dw(1);
  const int32_t dest = 0, row_slot = 0;
  UnpermuteBackwardArgs a;
  a.tokens = 1;
  a.hidden = H;
  a.top_k = 1;
  a.rows = 1;
  a.dest = &dest;
  a.row_slot = &row_slot;
  a.w = w.data();
  a.yp_dtype = DType::kF32;
  a.yp = yp.data();
  a.dy_dtype = DType::kF32;
  a.dy = dy.data();
  a.dyp_dtype = DType::kF32;
  a.dyp = dyp.data();
  a.dw = dw.data();
  ASSERT_TRUE(unpermute_backward_cpu(a).is_ok());
  EXPECT_EQ(dw[0], 1.0f + 15.0f * std::ldexp(1.0f, -23));
}

TEST(MoeReduction, ResultsDoNotDependOnThreadCount) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t T = 301, E = 70, k = 4, H = 45;
  std::vector<float> logits(T * E);
  for (auto& x : logits) x = d(rng);
  std::vector<float> dy(T * H), yp_src(T * k * H);
  for (auto& x : dy) x = d(rng);
  for (auto& x : yp_src) x = d(rng);

  struct Outs {
    RouterOut router;
    float aux;
    std::vector<float> dlogits, dw;
  };
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    Outs o{run_router(logits, T, E, k, true), 0.0f, std::vector<float>(T * E), {}};
    o.aux = run_aux(o.router.probs, o.router.idx, T, E, k);
    AuxLossBackwardArgs b;
    b.tokens = T;
    b.experts = E;
    b.top_k = k;
    b.daux = 0.01f;
    b.probs = o.router.probs.data();
    b.idx = o.router.idx.data();
    b.dlogits = o.dlogits.data();
    EXPECT_TRUE(aux_loss_backward_cpu(b).is_ok());
    Result<RoutingPlan> plan = build_routing_plan(o.router.idx.data(), T, E, k, 32);
    EXPECT_TRUE(plan.is_ok());
    const RoutingPlan& p = plan.value();
    std::vector<float> yp(p.rows * H, 0.0f), dyp(p.rows * H);
    for (int64_t i = 0; i < T * k; ++i)
      std::memcpy(&yp[p.dest[i] * H], &yp_src[i * H], H * sizeof(float));
    o.dw.resize(T * k);
    UnpermuteBackwardArgs u;
    u.tokens = T;
    u.hidden = H;
    u.top_k = k;
    u.rows = p.rows;
    u.dest = p.dest.data();
    u.row_slot = p.row_slot.data();
    u.w = o.router.w.data();
    u.yp_dtype = DType::kF32;
    u.yp = yp.data();
    u.dy_dtype = DType::kF32;
    u.dy = dy.data();
    u.dyp_dtype = DType::kF32;
    u.dyp = dyp.data();
    u.dw = o.dw.data();
    EXPECT_TRUE(unpermute_backward_cpu(u).is_ok());
    return o;
  };
  const int saved = omp_get_max_threads();
  const Outs one = run(1);
  const Outs many = run(7);
  omp_set_num_threads(saved);
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(one.router.probs, many.router.probs));
  EXPECT_EQ(one.router.idx, many.router.idx);
  EXPECT_TRUE(same_bits(one.router.w, many.router.w));
  EXPECT_EQ(f32_bits(one.aux), f32_bits(many.aux));
  EXPECT_TRUE(same_bits(one.dlogits, many.dlogits));
  EXPECT_TRUE(same_bits(one.dw, many.dw));
}

// ---- argument errors ----------------------------------------------------------------------------

void expect_error(const Status& s, const std::string& fragment) {
  ASSERT_FALSE(s.is_ok()) << "expected an error containing '" << fragment << "'";
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
}

TEST(MoeValidation, ClearErrors) {
  std::vector<float> buf(64);
  std::vector<int32_t> ibuf(64, 0);
  RouterTopkArgs r;
  r.tokens = 4;
  r.experts = 4;
  r.top_k = 5;
  r.logits = buf.data();
  r.probs = buf.data();
  r.idx = ibuf.data();
  r.w = buf.data();
  expect_error(ops::router_topk(cpu_backend(), r), "router_topk: k = 5 exceeds E = 4 experts");
  r.top_k = 2;
  r.tokens = 0;
  expect_error(ops::router_topk(cpu_backend(), r), "router_topk: T (tokens) must be positive, got 0");
  r.tokens = 4;
  r.w = nullptr;
  expect_error(ops::router_topk(cpu_backend(), r), "router_topk: w is null");

  const std::vector<int32_t> idx = {0, 1, 2, 3};
  expect_error(build_routing_plan(idx.data(), 2, 4, 2, 0).status(), "align must be in [1, 2^31)");
  expect_error(build_routing_plan(idx.data(), 2, 4, 2, -32).status(), "got -32");
  expect_error(build_routing_plan(idx.data(), 2, 2, 2, 1).status(),
               "idx[1, 0] = 2 is not an expert in [0, 2)");
  expect_error(build_routing_plan(idx.data(), 2, 1, 2, 1).status(), "k = 2 exceeds E = 1");
  expect_error(build_routing_plan(nullptr, 2, 4, 2, 1).status(), "routing_plan: idx is null");
  expect_error(build_routing_plan(idx.data(), 0, 4, 2, 1).status(), "T (tokens) must be positive");

  AuxLossArgs al;
  al.tokens = 2;
  al.experts = 4;
  al.top_k = 2;
  al.probs = buf.data();
  al.idx = ibuf.data();
  expect_error(ops::aux_loss(cpu_backend(), al), "aux_loss: aux is null");

  PermuteArgs pa;
  pa.tokens = 4;
  pa.hidden = 8;
  pa.top_k = 2;
  pa.rows = 7;
  pa.row_slot = ibuf.data();
  pa.dest = ibuf.data();
  pa.x = buf.data();
  pa.xp = buf.data();
  expect_error(ops::permute(cpu_backend(), pa), "permute: M = 7 rows cannot hold T * k = 8 routed pairs");
  pa.rows = 8;
  pa.dtype = DType::kE4M3;
  expect_error(ops::permute(cpu_backend(), pa), "permute: x / xp must be f32 or bf16");

  SwigluArgs sa;
  sa.rows = 2;
  sa.ffn = 0;
  sa.in = buf.data();
  sa.out = buf.data();
  expect_error(ops::swiglu(cpu_backend(), sa), "swiglu: M and F must be positive, got M = 2, F = 0");
  sa.ffn = 4;
  sa.in = nullptr;
  expect_error(ops::swiglu(cpu_backend(), sa), "swiglu: in is null");

  UnpermuteBackwardArgs ub;
  ub.tokens = 2;
  ub.hidden = 4;
  ub.top_k = 2;
  ub.rows = 4;
  ub.dest = ibuf.data();
  ub.row_slot = ibuf.data();
  ub.w = buf.data();
  ub.yp = buf.data();
  ub.dy = buf.data();
  ub.dyp = buf.data();
  expect_error(ops::unpermute_backward(cpu_backend(), ub), "unpermute_backward: dw is null");
}

TEST(MoeRoutingPlan, BadIndicesAndCountsAreErrors) {
  const std::vector<int32_t> idx = {2, 0, 7, 1, -1, 0};  // two entries outside [0, 4)
  RoutingPlanArgs a;
  a.tokens = 3, a.experts = 4, a.top_k = 2, a.align = 16;
  a.max_rows = routing_plan_max_rows(3, 4, 2, 16);
  EXPECT_EQ(a.max_rows, 6 + 4 * 15);
  std::vector<int32_t> dest(6), row_slot(a.max_rows);
  std::vector<int64_t> counts(5), padded(4), rows(1);
  a.idx = idx.data(), a.dest = dest.data(), a.row_slot = row_slot.data(), a.counts = counts.data();
  a.padded_counts = padded.data(), a.rows = rows.data();
  ASSERT_TRUE(routing_plan_cpu(a).is_ok());
  EXPECT_EQ(counts, (std::vector<int64_t>{2, 1, 1, 0, 2}));
  expect_error(routing_plan_from_counts(counts.data(), 3, 4, 2, 16).status(),
               "2 router indices are not experts in [0, 4)");
  const std::vector<int64_t> short_counts = {2, 1, 1, 0, 0};  // sums to 4, not 6
  expect_error(routing_plan_from_counts(short_counts.data(), 3, 4, 2, 16).status(),
               "the counts sum to 4, not T * k = 6");
  a.max_rows -= 1;
  expect_error(ops::routing_plan(cpu_backend(), a), "row_slot holds 65 rows, the plan may need 66");
  a.max_rows += 1;
  a.counts = nullptr;
  expect_error(ops::routing_plan(cpu_backend(), a), "routing_plan: counts is null");
  a.counts = counts.data();
  a.rows = nullptr;
  expect_error(ops::routing_plan(cpu_backend(), a), "routing_plan: rows is null");
}

}  // namespace
}  // namespace packmoe
