// CUDA MoE non-GEMM ops (router top-k, aux loss, permute, SwiGLU, unpermute; forward and
// backward) and the segment-list elementwise ops against the CPU backend, BYTE FOR BYTE. Every
// buffer is mirrored host/device, starts with the same sentinel bytes, and is compared whole
// (gaps and a tail included), so a stray write is a mismatch too. Inputs to arithmetic stay finite
// (the GPU canonicalises NaN payloads, x86 does not). Backend interface only; skips without a GPU.
// The harness (Mirror, Tally): tests/common/cuda_vs_cpu.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/elementwise.h"
#include "backend/ops/moe.h"
#include "common/cuda_vs_cpu.h"
#include "core/codecs.h"
#include "optim/adamw.h"

namespace packmoe {
namespace {

using test::Mirror;
using test::Placement;
using test::Tally;
using test::Twin;

// printf into a std::string (operator+ chains of literals and to_string trip GCC 12's -Wrestrict).
template <typename... A>
std::string fmt(const char* f, A... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// ---- values ----------------------------------------------------------------------------------------

size_t elt(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* dn(DType t) { return t == DType::kF32 ? "f32" : "bf16"; }

// Finite values around `scale`, with signed zeros, FP32 subnormals, tiny and large magnitudes
// sprinkled in (never Inf / NaN: their payloads are not portable through arithmetic).
float rand_value(std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  const uint32_t sign = (rng() & 1) ? 0x80000000u : 0u;
  switch (rng() % 40) {
    case 0: return f32_from_bits(sign);
    case 1: return f32_from_bits(sign | static_cast<uint32_t>(1 + rng() % 0x7FFFFF));
    case 2: return std::ldexp(1.0f, -static_cast<int>(rng() % 60)) * (sign ? -1.0f : 1.0f);
    case 3: return (sign ? -1.0f : 1.0f) * (40.0f + static_cast<float>(rng() % 60));
    default: return nd(rng);
  }
}

// n elements of dtype t as bytes.
std::vector<uint8_t> rand_bytes(DType t, size_t n, std::mt19937_64& rng, float scale) {
  std::vector<uint8_t> b(n * elt(t));
  for (size_t i = 0; i < n; ++i) {
    const float v = rand_value(rng, scale);
    if (t == DType::kF32) {
      std::memcpy(b.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// A mirror filled with random values of dtype t, uploaded.
std::unique_ptr<Mirror> rand_input(Backend& gpu, DType t, size_t n, std::mt19937_64& rng,
                                   float scale, size_t shift_elems = 0) {
  auto m = std::make_unique<Mirror>(gpu, n * elt(t), shift_elems * elt(t));
  const std::vector<uint8_t> b = rand_bytes(t, n, rng, scale);
  m->set(b.data(), b.size());
  m->upload();
  return m;
}

template <typename T>
std::unique_ptr<Mirror> input_of(Backend& gpu, const std::vector<T>& v) {
  auto m = std::make_unique<Mirror>(gpu, v.size() * sizeof(T));
  m->set(v.data(), v.size() * sizeof(T));
  m->upload();
  return m;
}

void expect_ok(const Status& s) { EXPECT_TRUE(s.is_ok()) << s.message(); }

// ---- router cases --------------------------------------------------------------------------------

enum class Logits { kNormal, kTies, kWide };

struct RouterCase {
  int64_t T, E, k;
  bool norm;
  Logits mode;
  int64_t empty;  // the last `empty` experts get logit -1000: they are never picked
};

// E covers every register path (<= 32, 64, 128, 256) and the generic one (> 256); ties come from
// integer logits and whole rows of one value (every 5th row); Wide reaches the ends of
// moe_exp_f32 (+-80, -inf, +-0).
std::vector<RouterCase> router_cases() {
  return {
      {1, 1, 1, true, Logits::kNormal, 0},     {37, 8, 2, false, Logits::kTies, 0},
      {300, 64, 8, true, Logits::kNormal, 16}, {129, 128, 8, false, Logits::kTies, 32},
      {70, 256, 16, true, Logits::kWide, 0},   {33, 300, 7, false, Logits::kNormal, 100},
      {5, 1000, 40, true, Logits::kTies, 0},   {40, 33, 33, true, Logits::kWide, 0},
      {513, 96, 6, false, Logits::kWide, 40},  {2000, 16, 4, true, Logits::kNormal, 4},
  };
}

std::vector<float> make_logits(const RouterCase& c, std::mt19937_64& rng) {
  std::vector<float> z(c.T * c.E);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    const bool flat = t % 5 == 4;
    const float row_value = static_cast<float>(static_cast<int>(rng() % 7) - 3);
    for (int64_t e = 0; e < c.E; ++e) {
      float v;
      if (flat) {
        v = row_value;
      } else if (c.mode == Logits::kTies) {
        v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
      } else if (c.mode == Logits::kWide) {
        switch (rng() % 12) {
          case 0: v = -std::numeric_limits<float>::infinity(); break;
          case 1: v = (rng() & 1) ? -0.0f : 0.0f; break;
          case 2: v = (rng() & 1) ? -80.0f : 80.0f; break;
          default: v = nd(rng) * 10.0f;
        }
      } else {
        v = nd(rng);
      }
      if (e >= c.E - c.empty) v = -1000.0f;
      z[t * c.E + e] = v;
    }
    if (c.mode == Logits::kWide && !flat) z[t * c.E + rng() % c.E] = 1.0f;  // one finite max
  }
  return z;
}

struct RouterOut {
  std::vector<float> probs;  // (T, E)
  std::vector<int32_t> idx;  // (T, k)
  std::vector<float> w;      // (T, k)
};

RouterOut cpu_router(const RouterCase& c, const std::vector<float>& logits) {
  RouterOut o{std::vector<float>(c.T * c.E), std::vector<int32_t>(c.T * c.k),
              std::vector<float>(c.T * c.k)};
  RouterTopkArgs a;
  a.tokens = c.T, a.experts = c.E, a.top_k = c.k, a.norm_topk_prob = c.norm;
  a.logits = logits.data(), a.probs = o.probs.data(), a.idx = o.idx.data(), a.w = o.w.data();
  const Status s = ops::router_topk(cpu_backend(), a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return o;
}

TEST(CudaMoeOps, RouterTopkForward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("router_topk");
  std::mt19937_64 rng(101);
  for (const RouterCase& c : router_cases()) {
    const std::vector<float> logits = make_logits(c, rng);
    auto z = input_of(*gpu, logits);
    Mirror probs(*gpu, c.T * c.E * 4), idx(*gpu, c.T * c.k * 4), w(*gpu, c.T * c.k * 4);
    RouterTopkArgs a;
    a.tokens = c.T, a.experts = c.E, a.top_k = c.k, a.norm_topk_prob = c.norm;
    a.logits = z->h<float>(), a.probs = probs.h<float>(), a.idx = idx.h<int32_t>();
    a.w = w.h<float>();
    expect_ok(ops::router_topk(cpu_backend(), a));
    a.logits = z->d<float>(), a.probs = probs.d<float>(), a.idx = idx.d<int32_t>();
    a.w = w.d<float>();
    expect_ok(ops::router_topk(*gpu, a));
    const long T = c.T, E = c.E;
    probs.compare(tally, fmt("T%ld E%ld probs", T, E));
    idx.compare(tally, fmt("T%ld E%ld idx", T, E));
    w.compare(tally, fmt("T%ld E%ld w", T, E));
    ++tally.cases;
  }
}

TEST(CudaMoeOps, RouterTopkBackward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("router_topk_backward");
  std::mt19937_64 rng(102);
  for (RouterCase c : router_cases()) {
    for (bool norm : {false, true}) {
      c.norm = norm;
      const RouterOut fwd = cpu_router(c, make_logits(c, rng));
      auto probs = input_of(*gpu, fwd.probs);
      auto idx = input_of(*gpu, fwd.idx);
      auto dw = rand_input(*gpu, DType::kF32, c.T * c.k, rng, 1.0f);
      Mirror dz(*gpu, c.T * c.E * 4);
      RouterTopkBackwardArgs a;
      a.tokens = c.T, a.experts = c.E, a.top_k = c.k, a.norm_topk_prob = norm;
      a.probs = probs->h<float>(), a.idx = idx->h<int32_t>(), a.dw = dw->h<float>();
      a.dlogits = dz.h<float>();
      expect_ok(ops::router_topk_backward(cpu_backend(), a));
      a.probs = probs->d<float>(), a.idx = idx->d<int32_t>(), a.dw = dw->d<float>();
      a.dlogits = dz.d<float>();
      expect_ok(ops::router_topk_backward(*gpu, a));
      dz.compare(tally, fmt("T%ld E%ld norm%d dlogits", long(c.T), long(c.E), int(norm)));
      ++tally.cases;
    }
  }
}

// Aux loss: long R32 column sums (T up to 20000), empty experts, shared-memory bins (E <= 8192)
// and global bins (E > 8192).
std::vector<RouterCase> aux_cases() {
  return {
      {1, 1, 1, false, Logits::kNormal, 0},     {20000, 64, 8, true, Logits::kNormal, 16},
      {3000, 128, 8, false, Logits::kTies, 40}, {777, 8, 2, true, Logits::kWide, 3},
      {50, 1000, 10, false, Logits::kNormal, 300}, {4099, 33, 5, true, Logits::kTies, 0},
      {64, 9000, 2, false, Logits::kNormal, 4000},
  };
}

// Accumulators of earlier layers: counts up to 1000 per expert, probability sums up to 100.
std::unique_ptr<Mirror> earlier_counts(Backend& gpu, int64_t E, std::mt19937_64& rng) {
  std::vector<int64_t> c(E);
  for (auto& v : c) v = static_cast<int64_t>(rng() % 1000);
  return input_of(gpu, c);
}

TEST(CudaMoeOps, AuxLossStatsAndLoss) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("aux_loss_stats");
  std::mt19937_64 rng(103);
  for (const RouterCase& c : aux_cases()) {
    const RouterOut fwd = cpu_router(c, make_logits(c, rng));
    auto probs = input_of(*gpu, fwd.probs);
    auto idx = input_of(*gpu, fwd.idx);
    auto counts = earlier_counts(*gpu, c.E, rng);  // accumulated into
    std::vector<float> sums(c.E);
    for (auto& v : sums) v = 100.0f * static_cast<float>(rng() % 1000) / 1000.0f;
    auto prob_sums = input_of(*gpu, sums);  // accumulated into
    AuxLossStatsArgs a;
    a.tokens = c.T, a.experts = c.E, a.top_k = c.k;
    a.probs = probs->h<float>(), a.idx = idx->h<int32_t>();
    a.counts = counts->h<int64_t>(), a.prob_sums = prob_sums->h<float>();
    expect_ok(ops::aux_loss_stats(cpu_backend(), a));
    a.probs = probs->d<float>(), a.idx = idx->d<int32_t>();
    a.counts = counts->d<int64_t>(), a.prob_sums = prob_sums->d<float>();
    expect_ok(ops::aux_loss_stats(*gpu, a));
    counts->compare(tally, fmt("T%ld E%ld counts", long(c.T), long(c.E)));
    prob_sums->compare(tally, fmt("T%ld E%ld prob_sums", long(c.T), long(c.E)));

    Mirror aux(*gpu, 4);
    AuxLossArgs l;
    l.tokens = 3 * c.T, l.experts = c.E;
    l.counts = counts->h<int64_t>(), l.prob_sums = prob_sums->h<float>(), l.aux = aux.h<float>();
    expect_ok(ops::aux_loss(cpu_backend(), l));
    l.counts = counts->d<int64_t>(), l.prob_sums = prob_sums->d<float>(), l.aux = aux.d<float>();
    expect_ok(ops::aux_loss(*gpu, l));
    aux.compare(tally, fmt("T%ld E%ld aux", long(c.T), long(c.E)));
    ++tally.cases;
  }
}

TEST(CudaMoeOps, AuxLossBackward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("aux_loss_backward");
  std::mt19937_64 rng(104);
  for (const RouterCase& c : aux_cases()) {
    const RouterOut fwd = cpu_router(c, make_logits(c, rng));
    auto probs = input_of(*gpu, fwd.probs);
    auto counts = earlier_counts(*gpu, c.E, rng);
    auto dz = rand_input(*gpu, DType::kF32, c.T * c.E, rng, 1e-3f);  // accumulated into
    AuxLossBackwardArgs a;
    a.tokens = c.T, a.experts = c.E, a.total_tokens = 3 * c.T;
    a.daux = rand_value(rng, 0.01f);
    a.probs = probs->h<float>(), a.counts = counts->h<int64_t>(), a.dlogits = dz->h<float>();
    expect_ok(ops::aux_loss_backward(cpu_backend(), a));
    a.probs = probs->d<float>(), a.counts = counts->d<int64_t>(), a.dlogits = dz->d<float>();
    expect_ok(ops::aux_loss_backward(*gpu, a));
    dz->compare(tally, fmt("T%ld E%ld dlogits", long(c.T), long(c.E)));
    ++tally.cases;
  }
}

// ---- row cases (permute / unpermute) --------------------------------------------------------------

struct RowCase {
  int64_t T, E, k, H, align;
  int64_t empty;  // experts [E - empty, E) receive no token
  int64_t shift;  // elements every buffer is shifted off 16-byte alignment (0: aligned)
};

// H: 1 and odd (2-byte units / scalar chunks), 6 (12-byte rows), multiples of 8 (16-byte
// path), 520 and 4096 (unpermute_backward's wide dw path, with and without a tail); align
// 1 / 16 / 32; empty experts; misaligned pointers.
std::vector<RowCase> row_cases() {
  return {
      {1, 1, 1, 1, 1, 0, 0},       {64, 8, 2, 64, 16, 2, 0},   {100, 16, 4, 4096, 32, 5, 0},
      {37, 6, 3, 3, 1, 1, 0},      {50, 10, 2, 129, 16, 0, 0}, {77, 5, 5, 6, 32, 0, 0},
      {20, 4, 2, 256, 1, 1, 1},    {300, 64, 8, 24, 16, 24, 0}, {9, 3, 3, 40, 32, 0, 3},
      {40, 12, 3, 520, 16, 2, 0},  // 520 = two 256-element wide slices + an 8-element tail
  };
}

struct Routing {
  std::vector<int32_t> idx;  // (T, k)
  std::vector<float> w;      // (T, k)
  RoutingPlan plan;
};

// k distinct experts per token among the first E - empty, random weights.
Routing make_routing(const RowCase& c, std::mt19937_64& rng) {
  Routing r;
  const int64_t live = std::max(c.E - c.empty, c.k);
  std::vector<int32_t> pool(live);
  for (int64_t t = 0; t < c.T; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int64_t j = 0; j < c.k; ++j) {
      r.idx.push_back(pool[j]);
      r.w.push_back(rand_value(rng, 0.5f));
    }
  }
  Result<RoutingPlan> p = build_routing_plan(r.idx.data(), c.T, c.E, c.k, c.align);
  EXPECT_TRUE(p.is_ok()) << p.status().message();
  r.plan = std::move(p.value());
  return r;
}

std::string row_name(const RowCase& c) {
  return fmt("T%ld H%ld k%ld align%ld%s", long(c.T), long(c.H), long(c.k), long(c.align),
             c.shift ? " misaligned" : "");
}

constexpr DType kDtypes[] = {DType::kF32, DType::kBF16};

// The routing plan: several chunks of 4096 pairs (T k up to 131072, the qwen3_30b_a3b layer),
// E up to the CUDA limit 1024, every alignment, skewed routings (one expert takes most pairs, many
// experts empty). dest, row_slot (with spare rows) and counts compared whole with the CPU op.
TEST(CudaMoeOps, RoutingPlan) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("routing_plan");
  std::mt19937_64 rng(111);
  struct PlanCase {
    int64_t T, E, k, align;
    bool skewed;
  };
  const PlanCase cases[] = {{1, 1, 1, 1, false},     {3, 4, 2, 32, false},
                            {513, 7, 3, 16, true},   {4096, 128, 8, 32, false},
                            {16384, 128, 8, 1, true}, {3001, 1024, 2, 16, false},
                            {2000, 60, 5, 32, true}};
  for (const PlanCase& c : cases) {
    std::vector<int32_t> idx(c.T * c.k);
    for (int32_t& e : idx)
      e = static_cast<int32_t>(c.skewed && rng() % 4 != 0 ? (rng() % 3) : rng() % c.E);
    auto in = input_of(*gpu, idx);
    const int64_t max_rows = routing_plan_max_rows(c.T, c.E, c.k, c.align) + 5;
    Mirror dest(*gpu, idx.size() * 4), row_slot(*gpu, max_rows * 4), counts(*gpu, (c.E + 1) * 8);
    Mirror padded(*gpu, c.E * 8), rows(*gpu, 8);
    RoutingPlanArgs a;
    a.tokens = c.T, a.experts = c.E, a.top_k = c.k, a.align = c.align, a.max_rows = max_rows;
    a.idx = in->h<int32_t>(), a.dest = dest.h<int32_t>(), a.row_slot = row_slot.h<int32_t>();
    a.counts = counts.h<int64_t>(), a.padded_counts = padded.h<int64_t>(), a.rows = rows.h<int64_t>();
    expect_ok(ops::routing_plan(cpu_backend(), a));
    a.idx = in->d<int32_t>(), a.dest = dest.d<int32_t>(), a.row_slot = row_slot.d<int32_t>();
    a.counts = counts.d<int64_t>(), a.padded_counts = padded.d<int64_t>(), a.rows = rows.d<int64_t>();
    expect_ok(ops::routing_plan(*gpu, a));
    const std::string name = fmt("T%ld E%ld k%ld align%ld%s", long(c.T), long(c.E), long(c.k),
                                 long(c.align), c.skewed ? " skewed" : "");
    dest.compare(tally, name + " dest");
    row_slot.compare(tally, name + " row_slot");
    counts.compare(tally, name + " counts");
    padded.compare(tally, name + " padded counts");
    rows.compare(tally, name + " rows");
    ++tally.cases;
  }
  // Indices outside [0, E): counted in counts[E] the same way (dest, row_slot unspecified).
  std::vector<int32_t> bad = {0, 5, -1, 2, 9, 1};
  auto in = input_of(*gpu, bad);
  Mirror dest(*gpu, 24), row_slot(*gpu, 6 * 4), counts(*gpu, 5 * 8), padded(*gpu, 4 * 8),
      rows(*gpu, 8);
  RoutingPlanArgs a;
  a.tokens = 3, a.experts = 4, a.top_k = 2, a.align = 1, a.max_rows = 6;
  a.idx = in->h<int32_t>(), a.dest = dest.h<int32_t>(), a.row_slot = row_slot.h<int32_t>();
  a.counts = counts.h<int64_t>(), a.padded_counts = padded.h<int64_t>(), a.rows = rows.h<int64_t>();
  expect_ok(ops::routing_plan(cpu_backend(), a));
  a.idx = in->d<int32_t>(), a.dest = dest.d<int32_t>(), a.row_slot = row_slot.d<int32_t>();
  a.counts = counts.d<int64_t>(), a.padded_counts = padded.d<int64_t>(), a.rows = rows.d<int64_t>();
  expect_ok(ops::routing_plan(*gpu, a));
  counts.compare(tally, "bad indices counts");
  EXPECT_EQ(counts.h<int64_t>()[4], 3);
  a.experts = 1025, a.top_k = 1, a.max_rows = 3;
  const Status too_many = ops::routing_plan(*gpu, a);
  ASSERT_FALSE(too_many.is_ok());
  EXPECT_NE(too_many.message().find("at most 1024"), std::string::npos) << too_many.message();
}

TEST(CudaMoeOps, PermuteForward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("permute");
  std::mt19937_64 rng(105);
  for (const RowCase& c : row_cases())
    for (DType t : kDtypes) {
      const Routing r = make_routing(c, rng);
      const int64_t M = r.plan.rows;
      auto slot = input_of(*gpu, r.plan.row_slot);
      auto dest = input_of(*gpu, r.plan.dest);
      auto x = rand_input(*gpu, t, c.T * c.H, rng, 1.0f, c.shift);
      Mirror xp(*gpu, M * c.H * elt(t), c.shift * elt(t));
      PermuteArgs a;
      a.tokens = c.T, a.hidden = c.H, a.top_k = c.k, a.rows = M, a.dtype = t;
      a.row_slot = slot->h<int32_t>(), a.dest = dest->h<int32_t>(), a.x = x->h(), a.xp = xp.h();
      expect_ok(ops::permute(cpu_backend(), a));
      a.row_slot = slot->d<int32_t>(), a.dest = dest->d<int32_t>(), a.x = x->d(), a.xp = xp.d();
      expect_ok(ops::permute(*gpu, a));
      xp.compare(tally, fmt("%s %s", row_name(c).c_str(), dn(t)));
      ++tally.cases;
    }
}

TEST(CudaMoeOps, PermuteBackward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("permute_backward");
  std::mt19937_64 rng(106);
  for (const RowCase& c : row_cases())
    for (DType t : kDtypes) {
      const Routing r = make_routing(c, rng);
      const int64_t M = r.plan.rows;
      auto dest = input_of(*gpu, r.plan.dest);
      auto dxp = rand_input(*gpu, t, M * c.H, rng, 1.0f, c.shift);
      Mirror dx(*gpu, c.T * c.H * 4, c.shift * 4);
      PermuteBackwardArgs a;
      a.tokens = c.T, a.hidden = c.H, a.top_k = c.k, a.rows = M, a.dxp_dtype = t;
      a.dest = dest->h<int32_t>(), a.dxp = dxp->h(), a.dx = dx.h<float>();
      expect_ok(ops::permute_backward(cpu_backend(), a));
      a.dest = dest->d<int32_t>(), a.dxp = dxp->d(), a.dx = dx.d<float>();
      expect_ok(ops::permute_backward(*gpu, a));
      dx.compare(tally, fmt("%s dxp %s", row_name(c).c_str(), dn(t)));
      ++tally.cases;
    }
}

TEST(CudaMoeOps, UnpermuteForward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("unpermute");
  std::mt19937_64 rng(107);
  for (const RowCase& c : row_cases())
    for (DType tyy : kDtypes)
      for (DType ty : kDtypes) {
        const Routing r = make_routing(c, rng);
        const int64_t M = r.plan.rows;
        auto dest = input_of(*gpu, r.plan.dest);
        auto w = input_of(*gpu, r.w);
        auto yp = rand_input(*gpu, tyy, M * c.H, rng, 1.0f, c.shift);
        Mirror y(*gpu, c.T * c.H * elt(ty), c.shift * elt(ty));
        UnpermuteArgs a;
        a.tokens = c.T, a.hidden = c.H, a.top_k = c.k, a.rows = M;
        a.yp_dtype = tyy, a.y_dtype = ty;
        a.dest = dest->h<int32_t>(), a.w = w->h<float>(), a.yp = yp->h(), a.y = y.h();
        expect_ok(ops::unpermute(cpu_backend(), a));
        a.dest = dest->d<int32_t>(), a.w = w->d<float>(), a.yp = yp->d(), a.y = y.d();
        expect_ok(ops::unpermute(*gpu, a));
        y.compare(tally, fmt("%s yp %s y %s", row_name(c).c_str(), dn(tyy), dn(ty)));
        ++tally.cases;
      }
}

TEST(CudaMoeOps, UnpermuteBackward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("unpermute_backward");
  std::mt19937_64 rng(108);
  for (const RowCase& c : row_cases())
    for (DType tyy : kDtypes)
      for (DType tdy : kDtypes)
        for (DType tdyp : kDtypes) {
          const Routing r = make_routing(c, rng);
          const int64_t M = r.plan.rows;
          auto dest = input_of(*gpu, r.plan.dest);
          auto slot = input_of(*gpu, r.plan.row_slot);
          auto w = input_of(*gpu, r.w);
          auto yp = rand_input(*gpu, tyy, M * c.H, rng, 1.0f, c.shift);
          auto dy = rand_input(*gpu, tdy, c.T * c.H, rng, 1.0f, c.shift);
          Mirror dyp(*gpu, M * c.H * elt(tdyp), c.shift * elt(tdyp));
          Mirror dw(*gpu, c.T * c.k * 4);
          UnpermuteBackwardArgs a;
          a.tokens = c.T, a.hidden = c.H, a.top_k = c.k, a.rows = M;
          a.yp_dtype = tyy, a.dy_dtype = tdy, a.dyp_dtype = tdyp;
          a.dest = dest->h<int32_t>(), a.row_slot = slot->h<int32_t>(), a.w = w->h<float>();
          a.yp = yp->h(), a.dy = dy->h(), a.dyp = dyp.h(), a.dw = dw.h<float>();
          expect_ok(ops::unpermute_backward(cpu_backend(), a));
          a.dest = dest->d<int32_t>(), a.row_slot = slot->d<int32_t>(), a.w = w->d<float>();
          a.yp = yp->d(), a.dy = dy->d(), a.dyp = dyp.d(), a.dw = dw.d<float>();
          expect_ok(ops::unpermute_backward(*gpu, a));
          const std::string what = fmt("%s yp %s dy %s dyp %s", row_name(c).c_str(), dn(tyy),
                                       dn(tdy), dn(tdyp));
          dyp.compare(tally, std::string(what).append(": dyp"));
          dw.compare(tally, std::string(what).append(": dw"));
          ++tally.cases;
        }
}

// ---- SwiGLU ----------------------------------------------------------------------------------------

struct SwigluCase {
  int64_t M, F, shift;
};

// F odd / not a multiple of 8 (scalar chunks), multiples of 8 (16-byte path), misaligned.
std::vector<SwigluCase> swiglu_cases() {
  return {{1, 1, 0},     {7, 8, 0},   {33, 100, 0}, {64, 512, 0},
          {129, 1536, 0}, {16, 13, 0}, {40, 64, 1},  {1000, 24, 0}};
}

TEST(CudaMoeOps, SwigluForward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("swiglu");
  std::mt19937_64 rng(109);
  for (const SwigluCase& c : swiglu_cases())
    for (DType ti : kDtypes)
      for (DType to : kDtypes) {
        auto in = rand_input(*gpu, ti, c.M * 2 * c.F, rng, 3.0f, c.shift);
        Mirror out(*gpu, c.M * c.F * elt(to), c.shift * elt(to));
        // rows_device = M / 2 first: rows past it must keep the sentinel on both backends.
        const std::vector<int64_t> used_rows = {c.M / 2};
        auto used = input_of(*gpu, used_rows);
        for (bool device_rows : {true, false}) {
          SwigluArgs a;
          a.rows = c.M, a.ffn = c.F, a.in_dtype = ti, a.out_dtype = to;
          a.in = in->h(), a.out = out.h();
          a.rows_device = device_rows ? used->h<int64_t>() : nullptr;
          expect_ok(ops::swiglu(cpu_backend(), a));
          a.in = in->d(), a.out = out.d();
          a.rows_device = device_rows ? used->d<int64_t>() : nullptr;
          expect_ok(ops::swiglu(*gpu, a));
          out.compare(tally, fmt("M%ld F%ld %s->%s%s", long(c.M), long(c.F), dn(ti), dn(to),
                                 device_rows ? " rows_device" : ""));
          ++tally.cases;
        }
      }
}

TEST(CudaMoeOps, SwigluBackward) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("swiglu_backward");
  std::mt19937_64 rng(110);
  for (const SwigluCase& c : swiglu_cases())
    for (DType ti : kDtypes)
      for (DType tdo : kDtypes)
        for (DType tdi : kDtypes) {
          auto in = rand_input(*gpu, ti, c.M * 2 * c.F, rng, 3.0f, c.shift);
          auto dout = rand_input(*gpu, tdo, c.M * c.F, rng, 1.0f, c.shift);
          Mirror din(*gpu, c.M * 2 * c.F * elt(tdi), c.shift * elt(tdi));
          const std::vector<int64_t> used_rows = {c.M / 2};
          auto used = input_of(*gpu, used_rows);
          for (bool device_rows : {true, false}) {
            SwigluBackwardArgs a;
            a.rows = c.M, a.ffn = c.F, a.in_dtype = ti, a.dout_dtype = tdo, a.din_dtype = tdi;
            a.in = in->h(), a.dout = dout->h(), a.din = din.h();
            a.rows_device = device_rows ? used->h<int64_t>() : nullptr;
            expect_ok(ops::swiglu_backward(cpu_backend(), a));
            a.in = in->d(), a.dout = dout->d(), a.din = din.d();
            a.rows_device = device_rows ? used->d<int64_t>() : nullptr;
            expect_ok(ops::swiglu_backward(*gpu, a));
            din.compare(tally, fmt("M%ld F%ld in %s dout %s din %s%s", long(c.M), long(c.F),
                                   dn(ti), dn(tdo), dn(tdi), device_rows ? " rows_device" : ""));
            ++tally.cases;
          }
        }
}

// ---- elementwise over segment lists ----------------------------------------------------------------

struct SegCase {
  int64_t G, n;
  Placement pl;
};

// Packed with odd n leaves later segments unaligned; > 8 segments uploads the pointer table.
std::vector<SegCase> seg_cases() {
  return {{1, 1, Placement::kPacked},       {8, 1000, Placement::kPacked},
          {3, 7, Placement::kPacked},       {5, 1023, Placement::kDiscrete},
          {12, 4096, Placement::kDiscrete}, {10, 333, Placement::kMisaligned},
          {9, 8, Placement::kPacked},       {1, 100000, Placement::kDiscrete},
          {20, 37, Placement::kMisaligned}};
}

std::string seg_name(const SegCase& c) {
  const char* pl = c.pl == Placement::kPacked     ? "packed"
                   : c.pl == Placement::kDiscrete ? "discrete"
                                                  : "misaligned";
  return fmt("G%ld n%ld %s", long(c.G), long(c.n), pl);
}

// G segments of n elements of `bytes_per` bytes; misaligned shifts by one element.
std::unique_ptr<Mirror> segments(Backend& gpu, const SegCase& c, size_t bytes_per) {
  return std::make_unique<Mirror>(gpu, std::vector<size_t>(c.G, c.n * bytes_per), c.pl, bytes_per);
}

void fill_f32(Mirror& m, const SegCase& c, std::mt19937_64& rng, float scale, bool non_negative) {
  for (int64_t g = 0; g < c.G; ++g) {
    float* p = m.h<float>(g);
    for (int64_t i = 0; i < c.n; ++i) {
      const float v = rand_value(rng, scale);
      p[i] = non_negative ? std::fabs(v) : v;
    }
  }
  m.upload();
}

template <typename T>
std::vector<const T*> const_ptrs(const std::vector<T*>& v) {
  return std::vector<const T*>(v.begin(), v.end());
}

TEST(CudaElementwise, CastF32ToBf16) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("cast_f32_to_bf16");
  std::mt19937_64 rng(111);
  for (const SegCase& c : seg_cases()) {
    auto src = segments(*gpu, c, 4);
    auto dst = segments(*gpu, c, 2);
    // Pure bit manipulation, so every input is fair: RNE ties, overflow to Inf, Inf, NaN payloads.
    for (int64_t g = 0; g < c.G; ++g) {
      float* p = src->h<float>(g);
      for (int64_t i = 0; i < c.n; ++i) {
        uint32_t b = static_cast<uint32_t>(rng());
        switch (rng() % 6) {
          case 0: b = (b & 0xFFFF0000u) | 0x8000u; break;  // exact tie
          case 1: b = (b & 0x80000000u) | 0x7F7FFFFFu; break;  // FLT_MAX -> Inf
          case 2: b = f32_bits(rand_value(rng, 1.0f)); break;
          default: break;  // any bits, NaNs included
        }
        p[i] = f32_from_bits(b);
      }
    }
    src->upload();
    Segments<const float> s_h{const_ptrs(src->h_all<float>()), c.n};
    Segments<uint16_t> d_h{dst->h_all<uint16_t>(), c.n};
    expect_ok(ops::cast_f32_to_bf16(cpu_backend(), s_h, d_h));
    Segments<const float> s_d{const_ptrs(src->d_all<float>()), c.n};
    Segments<uint16_t> d_d{dst->d_all<uint16_t>(), c.n};
    expect_ok(ops::cast_f32_to_bf16(*gpu, s_d, d_d));
    dst->compare(tally, seg_name(c));
    ++tally.cases;
  }
}

TEST(CudaElementwise, AddF32) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("add_f32");
  std::mt19937_64 rng(112);
  for (const SegCase& c : seg_cases()) {
    auto dst = segments(*gpu, c, 4);
    auto src = segments(*gpu, c, 4);
    fill_f32(*dst, c, rng, 1.0f, false);
    fill_f32(*src, c, rng, 1.0f, false);
    Segments<float> d_h{dst->h_all<float>(), c.n};
    Segments<const float> s_h{const_ptrs(src->h_all<float>()), c.n};
    expect_ok(ops::add_f32(cpu_backend(), d_h, s_h));
    Segments<float> d_d{dst->d_all<float>(), c.n};
    Segments<const float> s_d{const_ptrs(src->d_all<float>()), c.n};
    expect_ok(ops::add_f32(*gpu, d_d, s_d));
    dst->compare(tally, seg_name(c));
    ++tally.cases;
  }
}

// out = a + b (the residual stream's add), out of place and in place (out = a); fresh seed.
TEST(CudaElementwise, AddF32Out) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("add_f32_out");
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (const SegCase& c : seg_cases()) {
    auto a = segments(*gpu, c, 4), b = segments(*gpu, c, 4), out = segments(*gpu, c, 4);
    fill_f32(*a, c, rng, 1.0f, false);
    fill_f32(*b, c, rng, 1.0f, false);
    Segments<const float> a_h{const_ptrs(a->h_all<float>()), c.n};
    Segments<const float> b_h{const_ptrs(b->h_all<float>()), c.n};
    Segments<const float> a_d{const_ptrs(a->d_all<float>()), c.n};
    Segments<const float> b_d{const_ptrs(b->d_all<float>()), c.n};
    expect_ok(ops::add_f32_out(cpu_backend(), a_h, b_h, {out->h_all<float>(), c.n}));
    expect_ok(ops::add_f32_out(*gpu, a_d, b_d, {out->d_all<float>(), c.n}));
    out->compare(tally, seg_name(c));
    expect_ok(ops::add_f32_out(cpu_backend(), a_h, b_h, {a->h_all<float>(), c.n}));
    expect_ok(ops::add_f32_out(*gpu, a_d, b_d, {a->d_all<float>(), c.n}));
    a->compare(tally, seg_name(c) + " in place");
    tally.cases += 2;
  }
}

TEST(CudaElementwise, AdamW) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("adamw");
  std::mt19937_64 rng(113);
  int step = 0;
  for (const SegCase& c : seg_cases()) {
    AdamWConfig cfg;
    cfg.lr = 1e-3f * static_cast<float>(1 + step % 3);
    cfg.weight_decay = step % 2 ? 0.1f : 0.0f;
    const int64_t t = 1 + 7 * step++;
    auto p = segments(*gpu, c, 4), m = segments(*gpu, c, 4), v = segments(*gpu, c, 4);
    auto g = segments(*gpu, c, 4);
    fill_f32(*p, c, rng, 1.0f, false);
    fill_f32(*m, c, rng, 1e-2f, false);
    fill_f32(*v, c, rng, 1e-4f, true);
    fill_f32(*g, c, rng, 1e-2f, false);
    // Every other case also writes the BF16 image of the updated param in the same pass.
    const bool image = step % 2 == 0;
    auto b = segments(*gpu, c, 2);
    AdamWArgs a;
    a.scalars = adamw_step_scalars(cfg, t);
    a.param = {p->h_all<float>(), c.n}, a.exp_avg = {m->h_all<float>(), c.n};
    a.exp_avg_sq = {v->h_all<float>(), c.n}, a.grad = {const_ptrs(g->h_all<float>()), c.n};
    if (image) a.bf16 = {b->h_all<uint16_t>(), c.n};
    expect_ok(ops::adamw(cpu_backend(), a));
    a.param = {p->d_all<float>(), c.n}, a.exp_avg = {m->d_all<float>(), c.n};
    a.exp_avg_sq = {v->d_all<float>(), c.n}, a.grad = {const_ptrs(g->d_all<float>()), c.n};
    if (image) a.bf16 = {b->d_all<uint16_t>(), c.n};
    expect_ok(ops::adamw(*gpu, a));
    p->compare(tally, seg_name(c).append(": param"));
    m->compare(tally, seg_name(c).append(": exp_avg"));
    v->compare(tally, seg_name(c).append(": exp_avg_sq"));
    if (image) {
      b->compare(tally, seg_name(c).append(": bf16 image"));
      // The image is the cast of the updated param (CPU side, element by element).
      const std::vector<float*> ph = p->h_all<float>();
      const std::vector<uint16_t*> bh = b->h_all<uint16_t>();
      for (size_t s = 0; s < ph.size(); ++s)
        for (int64_t i = 0; i < c.n; ++i)
          ASSERT_EQ(bh[s][i], f32_to_bf16(ph[s][i])) << seg_name(c) << " segment " << s << " " << i;
    }
    ++tally.cases;
  }
}

// adamw with the image's per-expert amax (AdamWArgs::amax): experts of a few elements (threads
// and warps straddle them), of several warps, and of millions of elements (many blocks per
// expert and slot); segments that start mid-expert, misaligned ones (the scalar path). Every
// other case has NaN gradients: the amax must skip the NaNs they make (whose payload the CPU and
// the GPU need not agree on, so there only the amax is compared).
TEST(CudaElementwise, AdamWImageAmax) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("adamw image amax");
  std::mt19937_64 rng(115);
  struct AmaxCase {
    int64_t n, span, first;
    Placement pl;
  };
  const AmaxCase cases[] = {
      {1, 1, 0, Placement::kPacked},           {1000, 64, 0, Placement::kPacked},
      {4097, 100, 37, Placement::kDiscrete},   {5000, 7, 3, Placement::kPacked},
      {3333, 256, 0, Placement::kMisaligned},  {3333, 256, 0, Placement::kMisaligned},
      {600000, 12288, 4096, Placement::kPacked}, {600000, 12288, 4096, Placement::kPacked},
      {3000003, 1 << 20, 5, Placement::kDiscrete}, {3000003, 1 << 20, 5, Placement::kDiscrete}};
  int index = 0;
  for (const AmaxCase& ac : cases) {
    const bool nans = index++ % 2 == 1;
    const SegCase c{1, ac.n, ac.pl};
    const std::string name = seg_name(c) + fmt(" span %ld first %ld%s", long(ac.span),
                                               long(ac.first), nans ? " NaN grads" : "");
    auto p = segments(*gpu, c, 4), m = segments(*gpu, c, 4), v = segments(*gpu, c, 4);
    auto g = segments(*gpu, c, 4), b = segments(*gpu, c, 2);
    fill_f32(*p, c, rng, 1.0f, false);
    fill_f32(*m, c, rng, 1e-2f, false);
    fill_f32(*v, c, rng, 1e-4f, true);
    fill_f32(*g, c, rng, 1e-2f, false);
    if (nans) {
      for (int64_t i = 0; i < ac.n; i += 1 + static_cast<int64_t>(rng() % 5000))
        g->h<float>()[i] = std::numeric_limits<float>::quiet_NaN();
      g->upload();
    }
    const int64_t experts = (ac.first + ac.n - 1) / ac.span + 1;
    Twin<float> amax(*gpu, std::vector<float>(experts, 0.0f));
    AdamWConfig cfg;
    AdamWArgs a;
    a.scalars = adamw_step_scalars(cfg, 3);
    a.amax_span = ac.span, a.amax_first = ac.first;
    a.param = {p->h_all<float>(), c.n}, a.exp_avg = {m->h_all<float>(), c.n};
    a.exp_avg_sq = {v->h_all<float>(), c.n}, a.grad = {const_ptrs(g->h_all<float>()), c.n};
    a.bf16 = {b->h_all<uint16_t>(), c.n}, a.amax = amax.h();
    expect_ok(ops::adamw(cpu_backend(), a));
    a.param = {p->d_all<float>(), c.n}, a.exp_avg = {m->d_all<float>(), c.n};
    a.exp_avg_sq = {v->d_all<float>(), c.n}, a.grad = {const_ptrs(g->d_all<float>()), c.n};
    a.bf16 = {b->d_all<uint16_t>(), c.n}, a.amax = amax.d();
    expect_ok(ops::adamw(*gpu, a));
    if (!nans) {
      p->compare(tally, name + ": param");
      b->compare(tally, name + ": bf16 image");
      ASSERT_GT(amax.h()[experts - 1], 0.0f) << name << ": the last expert got its values";
    }
    amax.compare(tally, name + ": amax");
    ++tally.cases;
  }
}

TEST(CudaElementwise, Nvfp4DecodeScales) {
  PACKMOE_SKIP_WITHOUT_GPU();
  Tally tally("nvfp4_decode_scales");
  std::mt19937_64 rng(114);
  for (int64_t groups : {1, 7, 256, 1000, 70000}) {
    std::vector<float> amax(groups);
    for (float& x : amax) {
      switch (rng() % 8) {
        case 0: x = 0.0f; break;
        case 1: x = std::numeric_limits<float>::infinity(); break;
        case 2: x = std::numeric_limits<float>::quiet_NaN(); break;  // no arithmetic on its bits
        case 3: x = f32_from_bits(static_cast<uint32_t>(1 + rng() % 0x7FFFFF)); break;
        case 4: x = FLT_MAX; break;
        default: x = std::fabs(rand_value(rng, 10.0f));
      }
    }
    auto in = input_of(*gpu, amax);
    Mirror out(*gpu, groups * 4);
    expect_ok(ops::nvfp4_decode_scales(cpu_backend(), in->h<float>(), out.h<float>(), groups));
    expect_ok(ops::nvfp4_decode_scales(*gpu, in->d<float>(), out.d<float>(), groups));
    out.compare(tally, fmt("groups %ld", long(groups)));
    ++tally.cases;
  }
}

// Shapes the ops must reject before touching memory, on both backends alike.
TEST(CudaMoeOps, InvalidArgumentsAreStatusErrors) {
  PACKMOE_SKIP_WITHOUT_GPU();
  RouterTopkArgs a;
  a.tokens = 4, a.experts = 2, a.top_k = 3;  // k > E
  EXPECT_FALSE(ops::router_topk(*gpu, a).is_ok());
  Segments<float> d{{nullptr, nullptr}, 4};
  Segments<const float> s{{nullptr}, 4};
  EXPECT_FALSE(ops::add_f32(*gpu, d, s).is_ok());
  EXPECT_FALSE(ops::add_f32_out(*gpu, s, s, d).is_ok());
  EXPECT_FALSE(ops::nvfp4_decode_scales(*gpu, nullptr, nullptr, -1).is_ok());
}

}  // namespace
}  // namespace packmoe
