// Backward of every MoE non-GEMM CPU op (backend/ops/moe.h) against FP64 central finite
// differences of an FP64 forward written in THIS file (softmax, top-k, renorm, aux loss, routing,
// SwiGLU, combine), for a scalar loss L = <r, output> with random r. Top-k choices are kept away
// from ties by construction (logit gaps >= 0.1 >> the FD step), and asserted unchanged under every
// perturbation. Tolerance: max |analytic - FD| <= tol * max |FD| per gradient tensor, see kTol.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/ops/moe.h"
#include "common/finite_difference.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }

// FD step: central differences err by h^2/6 |L'''| ~ 2e-9 (every third derivative here is O(1)
// for O(1) inputs) plus eps64 |L| / h ~ 1e-11.
constexpr double kStep = 1e-4;
// F32 gradients: each element is a handful of FP32 roundings over sums of at most max(E, H) = 40
// terms, so its error is below ~40 * 2^-24 ~ 2.4e-6 of the largest term, itself <= max |grad|
// times O(1) (measured worst: 6e-6, the chain's dlogits, where g_j - d cancels); 1e-4 leaves a 15x
// margin over that and 5e4x over the FD error, yet catches any wrong term (a dropped or misplaced
// term is O(1) of max |grad|).
constexpr double kTol = 1e-4;
// BF16 gradient outputs: inputs are BF16-representable, so the one error is the final rounding to
// BF16, at most 2^-8 relative (unit roundoff of an 8-bit significand; measured 3.3e-3): 2^-7.
constexpr double kTolBf16 = 1.0 / 128;

// FD step and comparison: tests/common/finite_difference.h.
std::vector<double> finite_diff(std::vector<double>& x, const std::function<double()>& loss) {
  return grad_check::finite_diff(x, loss, kStep);
}
using grad_check::expect_grad_near;

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// BF16-representable values, as F32 and as BF16 bits.
void random_bf16(size_t n, float stddev, std::mt19937& rng, std::vector<float>& f32,
                 std::vector<uint16_t>& bf16) {
  std::normal_distribution<float> d(0.0f, stddev);
  f32.resize(n);
  bf16.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bf16[i] = f32_to_bf16(d(rng));
    f32[i] = bf16_to_f32(bf16[i]);
  }
}

// Logits whose per-token values are >= 0.1 apart: a shuffled ladder 0.3 * i plus jitter in
// [-0.1, 0.1], shifted by a random per-token offset (softmax ignores it; the code must too).
std::vector<float> gapped_logits(int64_t T, int64_t E, std::mt19937& rng) {
  std::uniform_real_distribution<float> jitter(-0.1f, 0.1f), offset(-3.0f, 3.0f);
  std::vector<float> z(T * E);
  std::vector<int> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const float base = offset(rng) - 0.15f * static_cast<float>(E);
    for (int64_t e = 0; e < E; ++e) z[t * E + e] = base + 0.3f * perm[e] + jitter(rng);
  }
  return z;
}

// ---- FP64 forwards, independent of the code under test -----------------------------------------

struct Router64 {
  std::vector<double> probs;  // (T, E)
  std::vector<int32_t> idx;   // (T, k)
  std::vector<double> w;      // (T, k)
};

Router64 router64(const std::vector<double>& z, int64_t T, int64_t E, int64_t k, bool norm) {
  Router64 o{std::vector<double>(T * E), std::vector<int32_t>(T * k), std::vector<double>(T * k)};
  for (int64_t t = 0; t < T; ++t) {
    double m = z[t * E];
    for (int64_t e = 0; e < E; ++e) m = std::max(m, z[t * E + e]);
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(z[t * E + e] - m);
    for (int64_t e = 0; e < E; ++e) o.probs[t * E + e] = std::exp(z[t * E + e] - m) / s;
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return o.probs[t * E + a] > o.probs[t * E + b]; });
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      o.idx[t * k + j] = order[j];
      o.w[t * k + j] = o.probs[t * E + order[j]];
      sum += o.w[t * k + j];
    }
    if (norm)
      for (int64_t j = 0; j < k; ++j) o.w[t * k + j] /= sum;
  }
  return o;
}

// E * sum_{j,e} f[j, e] * pbar[e], f from idx (piecewise constant), pbar from probs.
double aux64(const std::vector<double>& probs, const std::vector<int32_t>& idx, int64_t T,
             int64_t E, int64_t k) {
  std::vector<double> f(k * E, 0.0), pbar(E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) f[j * E + idx[t * k + j]] += 1.0 / T;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) pbar[e] += probs[t * E + e] / T;
  double s = 0;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t e = 0; e < E; ++e) s += f[j * E + e] * pbar[e];
  return E * s;
}

// The permuted row of every (t, j), rebuilt here: per expert in (t, j) order, padded to align.
std::vector<int32_t> dest64(const std::vector<int32_t>& idx, int64_t E, int64_t align,
                            int64_t* rows) {
  std::vector<int64_t> count(E, 0), start(E, 0);
  for (int32_t e : idx) ++count[e];
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    start[e] = off;
    off += (count[e] + align - 1) / align * align;
  }
  *rows = off;
  std::vector<int32_t> dest(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) dest[i] = static_cast<int32_t>(start[idx[i]]++);
  return dest;
}

double silu64(double g) { return g / (1.0 + std::exp(-g)); }

// ---- code under test, thin wrappers -------------------------------------------------------------

struct Router32 {
  std::vector<float> probs;
  std::vector<int32_t> idx;
  std::vector<float> w;
};

Router32 router32(const std::vector<float>& z, int64_t T, int64_t E, int64_t k, bool norm) {
  Router32 o{std::vector<float>(T * E), std::vector<int32_t>(T * k), std::vector<float>(T * k)};
  RouterTopkArgs a;
  a.tokens = T;
  a.experts = E;
  a.top_k = k;
  a.norm_topk_prob = norm;
  a.logits = z.data();
  a.probs = o.probs.data();
  a.idx = o.idx.data();
  a.w = o.w.data();
  EXPECT_TRUE(router_topk_cpu(a).is_ok());
  return o;
}

// dlogits = router backward of dw (skipped when dw is empty) + aux backward of daux (when != 0).
std::vector<float> router_backward32(const Router32& fwd, const std::vector<float>& dw, float daux,
                                     int64_t T, int64_t E, int64_t k, bool norm) {
  std::vector<float> dz(T * E, 0.0f);
  if (!dw.empty()) {
    RouterTopkBackwardArgs b;
    b.tokens = T;
    b.experts = E;
    b.top_k = k;
    b.norm_topk_prob = norm;
    b.probs = fwd.probs.data();
    b.idx = fwd.idx.data();
    b.dw = dw.data();
    b.dlogits = dz.data();
    EXPECT_TRUE(router_topk_backward_cpu(b).is_ok());
  }
  if (daux != 0.0f) {  // one layer: its own statistics are the totals
    std::vector<int64_t> counts(E, 0);
    std::vector<float> prob_sums(E, 0.0f);
    AuxLossStatsArgs s;
    s.tokens = T;
    s.experts = E;
    s.top_k = k;
    s.probs = fwd.probs.data();
    s.idx = fwd.idx.data();
    s.counts = counts.data();
    s.prob_sums = prob_sums.data();
    EXPECT_TRUE(aux_loss_stats_cpu(s).is_ok());
    AuxLossBackwardArgs b;
    b.tokens = T;
    b.experts = E;
    b.total_tokens = T;
    b.daux = daux;
    b.probs = fwd.probs.data();
    b.counts = counts.data();
    b.dlogits = dz.data();
    EXPECT_TRUE(aux_loss_backward_cpu(b).is_ok());
  }
  return dz;
}

// ---- router + aux loss --------------------------------------------------------------------------

struct RouterCase {
  int64_t T, E, k;
  bool norm;
};

// L = sum r[t, j] w[t, j] + c * aux, with the three combinations of terms.
TEST(MoeGrad, RouterAndAuxLoss) {
  const RouterCase cases[] = {{5, 8, 2, false},  {5, 8, 2, true}, {4, 40, 4, true},
                              {3, 40, 3, false}, {3, 6, 6, true}, {6, 4, 1, true}};
  const uint32_t seed0 = fresh_seed();
  for (uint32_t s = 0; s < 3; ++s)
    for (const RouterCase& c : cases)
      for (const int terms : {1, 2, 3}) {  // 1: router only, 2: aux only, 3: both
        const uint32_t seed = seed0 + s;
        SCOPED_TRACE("seed " + std::to_string(seed) + " T=" + std::to_string(c.T) +
                     " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
                     " norm=" + std::to_string(c.norm) + " terms=" + std::to_string(terms));
        std::mt19937 rng(seed);
        std::normal_distribution<float> d(0.0f, 1.0f);
        const std::vector<float> z = gapped_logits(c.T, c.E, rng);
        std::vector<float> r(c.T * c.k);
        for (auto& x : r) x = d(rng);
        const bool with_router = terms & 1, with_aux = terms & 2;
        const float coef = 0.7f;

        const Router32 fwd = router32(z, c.T, c.E, c.k, c.norm);
        std::vector<double> zd = widen(z);
        const std::vector<int32_t> idx0 = router64(zd, c.T, c.E, c.k, c.norm).idx;
        ASSERT_EQ(fwd.idx, idx0);
        const std::vector<float> dz =
            router_backward32(fwd, with_router ? r : std::vector<float>{}, with_aux ? coef : 0.0f,
                              c.T, c.E, c.k, c.norm);

        auto loss = [&]() {
          const Router64 o = router64(zd, c.T, c.E, c.k, c.norm);
          EXPECT_EQ(o.idx, idx0) << "an FD step changed the top-k choice";
          double l = 0;
          if (with_router)
            for (size_t i = 0; i < r.size(); ++i) l += r[i] * o.w[i];
          if (with_aux) l += coef * aux64(o.probs, o.idx, c.T, c.E, c.k);
          return l;
        };
        const std::vector<double> fd = finite_diff(zd, loss);
        // Constant losses: k = 1 with renorm makes w = 1 (the router term), and k = E makes
        // sum_j f[j, e] = 1, so aux = E sum_e pbar[e] = E (the aux term). Their gradient is zero;
        // the backward leaves only the rounding of q - d with q ~ coef E / T, far below 1e-6.
        const bool constant = (terms == 1 && c.k == 1 && c.norm) || (terms == 2 && c.k == c.E);
        if (constant) {
          for (float g : dz) EXPECT_LE(std::fabs(g), 1e-6);
          for (double g : fd) EXPECT_LE(std::fabs(g), 1e-9);
          continue;
        }
        expect_grad_near("dlogits", dz, fd, kTol);
      }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

TEST(MoeGrad, Swiglu) {
  struct DtypeCase {
    DType in, dout, din;
    double tol;
  };
  const DtypeCase dtypes[] = {{DType::kF32, DType::kF32, DType::kF32, kTol},
                              {DType::kBF16, DType::kBF16, DType::kF32, kTol},
                              {DType::kBF16, DType::kF32, DType::kBF16, kTolBf16}};
  const int64_t M = 7, F = 9;
  const uint32_t seed0 = fresh_seed();
  for (uint32_t s = 0; s < 3; ++s)
    for (const DtypeCase& dc : dtypes) {
      const uint32_t seed = seed0 + s;
      SCOPED_TRACE("seed " + std::to_string(seed) + " in " + std::string(dtype_name(dc.in)) +
                   " dout " + std::string(dtype_name(dc.dout)) + " din " +
                   std::string(dtype_name(dc.din)));
      std::mt19937 rng(seed);
      // BF16-representable values serve both dtypes (the F32 case reads the same numbers).
      std::vector<float> in, r;
      std::vector<uint16_t> in_bf16, r_bf16;
      random_bf16(M * 2 * F, 2.0f, rng, in, in_bf16);  // gate spans silu's curved region
      random_bf16(M * F, 1.0f, rng, r, r_bf16);

      std::vector<float> din(M * 2 * F);
      std::vector<uint16_t> din_bf16(M * 2 * F);
      SwigluBackwardArgs b;
      b.rows = M;
      b.ffn = F;
      b.in_dtype = dc.in;
      b.in = dc.in == DType::kF32 ? static_cast<const void*>(in.data()) : in_bf16.data();
      b.dout_dtype = dc.dout;
      b.dout = dc.dout == DType::kF32 ? static_cast<const void*>(r.data()) : r_bf16.data();
      b.din_dtype = dc.din;
      b.din = dc.din == DType::kF32 ? static_cast<void*>(din.data()) : din_bf16.data();
      ASSERT_TRUE(swiglu_backward_cpu(b).is_ok());
      if (dc.din == DType::kBF16)
        for (size_t i = 0; i < din.size(); ++i) din[i] = bf16_to_f32(din_bf16[i]);

      std::vector<double> x = widen(in);
      auto loss = [&]() {
        double l = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t f = 0; f < F; ++f)
            l += r[m * F + f] * silu64(x[m * 2 * F + f]) * x[m * 2 * F + F + f];
        return l;
      };
      expect_grad_near("din", din, finite_diff(x, loss), dc.tol);
    }
}

// ---- permute / unpermute ------------------------------------------------------------------------

// A random top-k per token without repeats, and the plan of the code under test, whose dest must
// equal the one rebuilt in this file.
struct Routing {
  std::vector<int32_t> idx;
  RoutingPlan plan;
};

Routing random_routing(int64_t T, int64_t E, int64_t k, int64_t align, std::mt19937& rng) {
  Routing rt;
  std::vector<int32_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    rt.idx.insert(rt.idx.end(), experts.begin(), experts.begin() + k);
  }
  Result<RoutingPlan> p = build_routing_plan(rt.idx.data(), T, E, k, align);
  EXPECT_TRUE(p.is_ok()) << p.status().message();
  rt.plan = std::move(p).value();
  int64_t rows = 0;
  EXPECT_EQ(dest64(rt.idx, E, align, &rows), rt.plan.dest);
  EXPECT_EQ(rows, rt.plan.rows);
  return rt;
}

TEST(MoeGrad, Permute) {
  const int64_t T = 6, E = 4, k = 2, H = 5;
  const uint32_t seed0 = fresh_seed();
  for (uint32_t s = 0; s < 3; ++s)
    for (const DType dxp_dtype : {DType::kF32, DType::kBF16}) {
      const uint32_t seed = seed0 + s;
      SCOPED_TRACE("seed " + std::to_string(seed) + " dxp " + std::string(dtype_name(dxp_dtype)));
      std::mt19937 rng(seed);
      const Routing rt = random_routing(T, E, k, 4, rng);
      const int64_t M = rt.plan.rows;
      std::vector<float> x, r;
      std::vector<uint16_t> x_bf16, r_bf16;
      random_bf16(T * H, 1.0f, rng, x, x_bf16);
      random_bf16(M * H, 1.0f, rng, r, r_bf16);  // padding rows too: they must not matter

      std::vector<float> dx(T * H);
      PermuteBackwardArgs b;
      b.tokens = T;
      b.hidden = H;
      b.top_k = k;
      b.rows = M;
      b.dest = rt.plan.dest.data();
      b.dxp_dtype = dxp_dtype;
      b.dxp = dxp_dtype == DType::kF32 ? static_cast<const void*>(r.data()) : r_bf16.data();
      b.dx = dx.data();
      ASSERT_TRUE(permute_backward_cpu(b).is_ok());

      std::vector<double> xd = widen(x);
      auto loss = [&]() {  // <r, xp>, xp[dest[t, j]] = x[t], padding rows zero
        double l = 0;
        for (int64_t i = 0; i < T * k; ++i)
          for (int64_t h = 0; h < H; ++h) l += r[rt.plan.dest[i] * H + h] * xd[(i / k) * H + h];
        return l;
      };
      expect_grad_near("dx", dx, finite_diff(xd, loss), kTol);
    }
}

TEST(MoeGrad, UnpermuteCombine) {
  struct DtypeCase {
    DType yp, dy, dyp;
    double tol;
  };
  const DtypeCase dtypes[] = {{DType::kF32, DType::kF32, DType::kF32, kTol},
                              {DType::kBF16, DType::kBF16, DType::kF32, kTol},
                              {DType::kBF16, DType::kF32, DType::kBF16, kTolBf16}};
  const int64_t T = 5, E = 4, k = 3, H = 40;  // H > 32: dw's R32 sum has strided lanes
  const uint32_t seed0 = fresh_seed();
  for (uint32_t s = 0; s < 3; ++s)
    for (const DtypeCase& dc : dtypes) {
      const uint32_t seed = seed0 + s;
      SCOPED_TRACE("seed " + std::to_string(seed) + " yp " + std::string(dtype_name(dc.yp)) +
                   " dy " + std::string(dtype_name(dc.dy)) + " dyp " +
                   std::string(dtype_name(dc.dyp)));
      std::mt19937 rng(seed);
      const Routing rt = random_routing(T, E, k, 2, rng);
      const int64_t M = rt.plan.rows;
      std::vector<float> yp, r;
      std::vector<uint16_t> yp_bf16, r_bf16;
      random_bf16(M * H, 1.0f, rng, yp, yp_bf16);
      random_bf16(T * H, 1.0f, rng, r, r_bf16);
      std::uniform_real_distribution<float> uw(0.05f, 1.0f);
      std::vector<float> w(T * k);
      for (auto& x : w) x = uw(rng);

      std::vector<float> dyp(M * H, -1.0f), dw(T * k);
      std::vector<uint16_t> dyp_bf16(M * H);
      UnpermuteBackwardArgs b;
      b.tokens = T;
      b.hidden = H;
      b.top_k = k;
      b.rows = M;
      b.dest = rt.plan.dest.data();
      b.row_slot = rt.plan.row_slot.data();
      b.w = w.data();
      b.yp_dtype = dc.yp;
      b.yp = dc.yp == DType::kF32 ? static_cast<const void*>(yp.data()) : yp_bf16.data();
      b.dy_dtype = dc.dy;
      b.dy = dc.dy == DType::kF32 ? static_cast<const void*>(r.data()) : r_bf16.data();
      b.dyp_dtype = dc.dyp;
      b.dyp = dc.dyp == DType::kF32 ? static_cast<void*>(dyp.data()) : dyp_bf16.data();
      b.dw = dw.data();
      ASSERT_TRUE(unpermute_backward_cpu(b).is_ok());
      if (dc.dyp == DType::kBF16)
        for (size_t i = 0; i < dyp.size(); ++i) dyp[i] = bf16_to_f32(dyp_bf16[i]);

      std::vector<double> wd = widen(w), ypd = widen(yp);
      auto loss = [&]() {  // <r, y>, y[t] = sum_j w[t, j] yp[dest[t, j]]
        double l = 0;
        for (int64_t i = 0; i < T * k; ++i)
          for (int64_t h = 0; h < H; ++h)
            l += r[(i / k) * H + h] * wd[i] * ypd[rt.plan.dest[i] * H + h];
        return l;
      };
      expect_grad_near("dw", dw, finite_diff(wd, loss), kTol);  // dw is always F32
      expect_grad_near("dyp", dyp, finite_diff(ypd, loss), dc.tol);
      for (int64_t row = 0; row < M; ++row) {
        if (rt.plan.row_slot[row] >= 0) continue;
        for (int64_t h = 0; h < H; ++h) ASSERT_EQ(dyp[row * H + h], 0.0f) << "padding row " << row;
      }
    }
}

// ---- the whole non-GEMM chain -------------------------------------------------------------------

// Identity "experts": logits -> router (w, idx) -> plan -> permute x (T, 2F) -> SwiGLU -> combine
// -> y (T, F); L = <r, y> + c * aux. Checks dx (through combine, SwiGLU, permute) and dlogits
// (through combine's dw, the router and the aux loss) of the composed backward, F32 throughout.
TEST(MoeGrad, ChainWithoutGemm) {
  const int64_t T = 5, E = 6, k = 2, F = 4;
  const float coef = 0.3f;
  const uint32_t seed0 = fresh_seed();
  for (uint32_t s = 0; s < 3; ++s)
    for (const bool norm : {false, true}) {
      const uint32_t seed = seed0 + s;
      SCOPED_TRACE("seed " + std::to_string(seed) + " norm=" + std::to_string(norm));
      std::mt19937 rng(seed);
      const std::vector<float> z = gapped_logits(T, E, rng);
      std::vector<float> x, r;
      std::vector<uint16_t> unused;
      random_bf16(T * 2 * F, 1.5f, rng, x, unused);
      random_bf16(T * F, 1.0f, rng, r, unused);

      // Forward of the code under test.
      const Router32 fwd = router32(z, T, E, k, norm);
      Result<RoutingPlan> plan_r = build_routing_plan(fwd.idx.data(), T, E, k, 32);
      ASSERT_TRUE(plan_r.is_ok());
      const RoutingPlan& plan = plan_r.value();
      const int64_t M = plan.rows;
      std::vector<float> xp(M * 2 * F), hp(M * F);
      PermuteArgs pa;
      pa.tokens = T;
      pa.hidden = 2 * F;
      pa.top_k = k;
      pa.rows = M;
      pa.dtype = DType::kF32;
      pa.row_slot = plan.row_slot.data();
      pa.dest = plan.dest.data();
      pa.x = x.data();
      pa.xp = xp.data();
      ASSERT_TRUE(permute_cpu(pa).is_ok());
      SwigluArgs sa;
      sa.rows = M;
      sa.ffn = F;
      sa.in_dtype = DType::kF32;
      sa.in = xp.data();
      sa.out_dtype = DType::kF32;
      sa.out = hp.data();
      ASSERT_TRUE(swiglu_cpu(sa).is_ok());

      // Backward: combine -> (dhp, dw); SwiGLU -> dxp; permute -> dx; router + aux -> dlogits.
      std::vector<float> dhp(M * F), dw(T * k), dxp(M * 2 * F), dx(T * 2 * F);
      UnpermuteBackwardArgs ub;
      ub.tokens = T;
      ub.hidden = F;
      ub.top_k = k;
      ub.rows = M;
      ub.dest = plan.dest.data();
      ub.row_slot = plan.row_slot.data();
      ub.w = fwd.w.data();
      ub.yp_dtype = DType::kF32;
      ub.yp = hp.data();
      ub.dy = r.data();
      ub.dyp = dhp.data();
      ub.dw = dw.data();
      ASSERT_TRUE(unpermute_backward_cpu(ub).is_ok());
      SwigluBackwardArgs sb;
      sb.rows = M;
      sb.ffn = F;
      sb.in_dtype = DType::kF32;
      sb.in = xp.data();
      sb.dout = dhp.data();
      sb.din = dxp.data();
      ASSERT_TRUE(swiglu_backward_cpu(sb).is_ok());
      PermuteBackwardArgs pb;
      pb.tokens = T;
      pb.hidden = 2 * F;
      pb.top_k = k;
      pb.rows = M;
      pb.dest = plan.dest.data();
      pb.dxp = dxp.data();
      pb.dx = dx.data();
      ASSERT_TRUE(permute_backward_cpu(pb).is_ok());
      const std::vector<float> dz = router_backward32(fwd, dw, coef, T, E, k, norm);

      // FP64 forward of the whole chain: y[t] = sum_j w[t, j] silu(gate(x[t])) up(x[t]).
      std::vector<double> zd = widen(z), xd = widen(x);
      const std::vector<int32_t> idx0 = router64(zd, T, E, k, norm).idx;
      ASSERT_EQ(fwd.idx, idx0);
      auto loss = [&]() {
        const Router64 o = router64(zd, T, E, k, norm);
        EXPECT_EQ(o.idx, idx0) << "an FD step changed the top-k choice";
        double l = coef * aux64(o.probs, o.idx, T, E, k);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < k; ++j)
            for (int64_t f = 0; f < F; ++f)
              l +=
                  r[t * F + f] * o.w[t * k + j] * silu64(xd[t * 2 * F + f]) * xd[t * 2 * F + F + f];
        return l;
      };
      expect_grad_near("dx", dx, finite_diff(xd, loss), kTol);
      expect_grad_near("dlogits", dz, finite_diff(zd, loss), kTol);
    }
}

}  // namespace
}  // namespace packmoe
