// The single-process pieces of the distributed optimizer: the NVFP4 amax op and the given-amax
// quantize, the columnwise copy of 2D weights derived from the rowwise one, GroupedParam's
// row-range quantization (any unit-aligned split of a pack gives the whole pack's bytes, bitwise),
// its init / replica and bound-main_grad states, the grad buffer's transition table, the
// ShardPlan's invariants over random geometries, and the optimizer shard file and its assembly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "dist/grad_buffer.h"
#include "dist/optimizer_state.h"
#include "dist/shard_plan.h"
#include "nn/grouped_param.h"

namespace packmoe {
namespace {

// (G groups of rows_g, K) values N(0, scale_g) with scale_g spanning 2^-8..2^8, plus a few
// zeros, NaNs and infinities when `specials`.
std::vector<float> random_groups(std::mt19937& rng, const std::vector<int64_t>& rows, int64_t k,
                                 bool specials) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-8, 8);
  std::vector<float> out;
  for (int64_t r : rows) {
    const float scale = std::ldexp(1.0f, exp(rng));
    for (int64_t i = 0; i < r * k; ++i) {
      float v = dist(rng) * scale * (i % 7 == 0 ? 16.0f : 1.0f);
      if (specials && i % 97 == 5) v = 0.0f;
      if (specials && i % 211 == 7) v = std::numeric_limits<float>::quiet_NaN();
      if (specials && i % 499 == 11) v = -std::numeric_limits<float>::infinity();
      out.push_back(v);
    }
  }
  return out;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& f) {
  std::vector<uint16_t> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) out[i] = f32_to_bf16(f[i]);
  return out;
}

// Group pointers into one packed host buffer of `elem_bytes`-sized elements.
template <typename T>
std::vector<const void*> carve_const(const std::vector<T>& buf, const std::vector<int64_t>& rows,
                                     int64_t k) {
  std::vector<const void*> out;
  int64_t at = 0;
  for (int64_t r : rows) {
    out.push_back(buf.data() + at);
    at += r * k;
  }
  return out;
}

std::vector<void*> carve_bytes(std::vector<uint8_t>& buf, const std::vector<int64_t>& rows,
                               int64_t bytes_per_row) {
  std::vector<void*> out;
  int64_t at = 0;
  for (int64_t r : rows) {
    out.push_back(buf.data() + at);
    at += r * bytes_per_row;
  }
  return out;
}

// ---- NVFP4: the amax op and the given amax ---------------------------------------------------

TEST(Nvfp4Amax, EqualsTheQuantizersAmaxIncludingEmptyGroupsAndSpecials) {
  std::mt19937 rng(11);
  const std::vector<int64_t> rows = {32, 0, 16, 48};
  const int64_t k = 64;
  const std::vector<float> f = random_groups(rng, rows, k, true);
  const std::vector<uint16_t> h = to_bf16(f);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    GroupedMatrices in;
    in.dtype = dt;
    in.cols = k;
    in.rows = rows;
    in.data = dt == DType::kF32 ? carve_const(f, rows, k) : carve_const(h, rows, k);
    std::vector<float> amax(rows.size(), -1.0f), row_amax(rows.size(), -1.0f);
    ASSERT_TRUE(ops::nvfp4_amax(cpu_backend(), in, amax.data()).is_ok());
    std::vector<uint8_t> data(48 * 2 * k), scale(96 * k);
    Nvfp4Outputs out;
    out.row_data = carve_bytes(data, rows, k / 2);
    out.row_scale = carve_bytes(scale, rows, k / 16);
    out.row_amax = row_amax.data();
    ASSERT_TRUE(quantize_nvfp4_cpu(in, Nvfp4Config{}, out).is_ok());
    EXPECT_EQ(0, std::memcmp(amax.data(), row_amax.data(), amax.size() * sizeof(float)));
    EXPECT_EQ(amax[1], 0.0f);  // the empty group
  }
  GroupedMatrices bad;
  bad.cols = 40;
  bad.rows = {16};
  bad.data = {h.data()};
  float a = 0;
  EXPECT_EQ(ops::nvfp4_amax(cpu_backend(), bad, &a).message(),
            "nvfp4_amax: K = 40 must be a multiple of 16");
}

// Rows of one group quantized apart with the group's amax given: each piece's bytes are the
// whole group's bytes at that piece's rows (1x16 and 2D); given its own amax, nothing changes.
TEST(Nvfp4GivenAmax, RowPiecesWithTheWholeAmaxMatchTheWholeGroup) {
  std::mt19937 rng(12);
  const int64_t n = 96, k = 48;
  const std::vector<float> f = random_groups(rng, {n}, k, true);
  const std::vector<uint16_t> h = to_bf16(f);
  for (bool two_d : {false, true}) {
    SCOPED_TRACE(two_d ? "2D" : "1x16");
    GroupedMatrices whole;
    whole.cols = k;
    whole.rows = {n};
    whole.data = {h.data()};
    Nvfp4Config cfg;
    cfg.two_d = two_d;
    std::vector<uint8_t> data(n * k / 2), scale(n * k / 16);
    float amax = 0;
    Nvfp4Outputs out;
    out.row_data = {data.data()};
    out.row_scale = {scale.data()};
    out.row_amax = &amax;
    ASSERT_TRUE(quantize_nvfp4_cpu(whole, cfg, out).is_ok());

    // Given its own amax: the same bytes.
    std::vector<uint8_t> data2(data.size()), scale2(scale.size());
    float echo = 0;
    Nvfp4Config given = cfg;
    given.amax = &amax;
    Nvfp4Outputs out2{{data2.data()}, {scale2.data()}, &echo, {}, {}, nullptr, {}};
    ASSERT_TRUE(quantize_nvfp4_cpu(whole, given, out2).is_ok());
    EXPECT_EQ(data, data2);
    EXPECT_EQ(scale, scale2);
    EXPECT_EQ(echo, amax);

    // Pieces of 16, 48 and 32 rows as three groups, all with the whole group's amax.
    const std::vector<int64_t> pieces = {16, 48, 32};
    GroupedMatrices split;
    split.cols = k;
    split.rows = pieces;
    split.data = carve_const(h, pieces, k);
    std::vector<float> amaxes(3, amax), echoes(3);
    Nvfp4Config pcfg = cfg;
    pcfg.amax = amaxes.data();
    std::vector<uint8_t> data3(data.size()), scale3(scale.size());
    Nvfp4Outputs out3;
    out3.row_data = carve_bytes(data3, pieces, k / 2);
    out3.row_scale = carve_bytes(scale3, pieces, k / 16);
    out3.row_amax = echoes.data();
    ASSERT_TRUE(quantize_nvfp4_cpu(split, pcfg, out3).is_ok());
    EXPECT_EQ(data, data3);
    EXPECT_EQ(scale, scale3);
  }
  Nvfp4Config rht;
  rht.columnwise = true;
  rht.rht = true;
  float a = 1;
  rht.amax = &a;
  GroupedMatrices in;
  in.cols = k;
  in.rows = {16};
  in.data = {h.data()};
  EXPECT_FALSE(validate_nvfp4(in, rht, Nvfp4Outputs{}).is_ok());
}

// ---- 2D weights: the columnwise copy from the rowwise one ------------------------------------

TEST(Weight2dColumnwise, EqualsTheQuantizersColumnwiseCopy) {
  std::mt19937 rng(13);
  const std::vector<int64_t> rows = {64, 64, 64};
  const int64_t n = 64, k = 96;
  const std::vector<uint16_t> h = to_bf16(random_groups(rng, rows, k, true));
  GroupedMatrices in;
  in.cols = k;
  in.rows = rows;
  in.data = carve_const(h, rows, k);
  for (Tiled2dFormat fmt : {Tiled2dFormat::kMxfp8, Tiled2dFormat::kNvfp4}) {
    const bool mx = fmt == Tiled2dFormat::kMxfp8;
    SCOPED_TRACE(mx ? "mxfp8" : "nvfp4");
    // Per group both copies take n * data_row and n * scale_row bytes (NVFP4's transposed).
    const int64_t data_row = mx ? k : k / 2, scale_row = mx ? k / 32 : k / 16;
    std::vector<uint8_t> rd(3 * n * data_row), rs(3 * n * scale_row), cd(rd.size()), cs(rs.size()),
        dcd(rd.size(), 0xAB), dcs(rs.size(), 0xAB);
    auto groups = [&](std::vector<uint8_t>& b, int64_t per_group) {
      return std::vector<void*>{b.data(), b.data() + per_group, b.data() + 2 * per_group};
    };
    if (mx) {
      Mxfp8Config cfg;
      cfg.columnwise = true;
      cfg.two_d = true;
      ASSERT_TRUE(quantize_mxfp8_cpu(in, cfg,
                                     {groups(rd, n * k), groups(rs, n * k / 32), groups(cd, n * k),
                                      groups(cs, n * k / 32), {}, {}})
                      .is_ok());
    } else {
      Nvfp4Config cfg;
      cfg.columnwise = true;
      cfg.two_d = true;
      std::vector<float> ra(3), ca(3);
      Nvfp4Outputs out{groups(rd, n * k / 2), groups(rs, n * k / 16), ra.data(),
                       groups(cd, n * k / 2), groups(cs, n * k / 16), ca.data(), {}};
      ASSERT_TRUE(quantize_nvfp4_cpu(in, cfg, out).is_ok());
    }
    Weight2dCopies w;
    w.format = fmt;
    w.rows = n;
    w.cols = k;
    for (int g = 0; g < 3; ++g) {
      w.row_data.push_back(rd.data() + g * n * data_row);
      w.row_scale.push_back(rs.data() + g * n * scale_row);
      w.col_data.push_back(dcd.data() + g * n * data_row);
      w.col_scale.push_back(dcs.data() + g * n * scale_row);
    }
    ASSERT_TRUE(ops::weight_2d_columnwise(cpu_backend(), w).is_ok());
    EXPECT_EQ(cd, dcd) << "columnwise data";
    EXPECT_EQ(cs, dcs) << "columnwise scales";
    w.rows = 40;
    EXPECT_FALSE(ops::weight_2d_columnwise(cpu_backend(), w).is_ok());
  }
}

// ---- GroupedParam: row ranges, the optimizer's side (init, replica), bound gradients ---------

struct ParamCase {
  const char* name;
  QuantRecipe recipe;
  PrimaryWeight primary;
};
const ParamCase kParamCases[] = {
    {"bf16", {Recipe::kBF16, false, 3}, PrimaryWeight::kHighPrecision},
    {"mxfp8 low", {Recipe::kMxfp8, false, 3}, PrimaryWeight::kLowPrecision},
    {"mxfp8_2d low", {Recipe::kMxfp8, true, 3}, PrimaryWeight::kLowPrecision},
    {"mxfp8 high", {Recipe::kMxfp8, false, 3}, PrimaryWeight::kHighPrecision},
    {"nvfp4 low", {Recipe::kNvfp4, false, 3}, PrimaryWeight::kLowPrecision},
    {"nvfp4 high", {Recipe::kNvfp4, false, 3}, PrimaryWeight::kHighPrecision}};

constexpr int64_t kE = 3, kN = 64, kK = 64;

Tensor host_f32(const std::vector<float>& v, Shape shape) {
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  return t;
}

std::vector<std::vector<uint8_t>> components(const GroupedParam& p) {
  std::vector<std::vector<uint8_t>> out;
  for (const NamedStorage& s : p.weight_components()) out.push_back(s.storage->download());
  return out;
}

// Any split of the pack into unit-aligned row ranges, each quantized apart (NVFP4: with the
// max-combined per-expert amax), gives bitwise the primary one whole-pack quantize gives.
TEST(GroupedParamRows, EveryUnitAlignedSplitGivesTheWholePacksBytes) {
  std::mt19937 rng(14);
  for (const ParamCase& c : kParamCases)
    for (Layout layout : {Layout::kSingle, Layout::kDiscrete}) {
      SCOPED_TRACE(std::string(c.name) + (layout == Layout::kSingle ? " single" : " discrete"));
      const Tensor init = host_f32(random_groups(rng, {kE * kN}, kK, false), {kE, kN, kK});
      // The new value: a scale per 16 rows (so a piece's amax is rarely its expert's), NaNs, and
      // an infinity in the last expert only.
      std::vector<float> wf = random_groups(rng, std::vector<int64_t>(kE * kN / 16, 16), kK, false);
      for (size_t i = 5; i < wf.size(); i += 1001) wf[i] = std::numeric_limits<float>::quiet_NaN();
      wf[(kE - 1) * kN * kK + 77] = std::numeric_limits<float>::infinity();
      const std::vector<uint16_t> w = to_bf16(wf);
      GroupedParam whole(cpu_backend(), c.recipe, c.primary, layout, init);
      GroupedParam pieces(cpu_backend(), c.recipe, c.primary, layout, init);
      std::vector<void*> views;
      for (int64_t e = 0; e < kE; ++e)
        views.push_back(const_cast<uint16_t*>(w.data()) + e * kN * kK);
      whole.write_primary_from_bf16(
          GroupedStorage::view(cpu_backend(), Layout::kDiscrete, views, kN * kK * 2));

      const int64_t unit = pieces.shard_unit_rows();
      for (int trial = 0; trial < 4; ++trial) {
        std::vector<int64_t> cuts = {0, kE * kN};
        std::uniform_int_distribution<int64_t> pick(1, kE * kN / unit - 1);
        for (int i = 0; i < 3; ++i) cuts.push_back(pick(rng) * unit);
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
        std::vector<float> amax(kE, 0.0f);
        if (pieces.needs_global_amax())
          for (size_t i = 0; i + 1 < cuts.size(); ++i) {
            std::vector<float> local(kE, 0.0f);
            pieces.rows_amax(w.data() + cuts[i] * kK, cuts[i], cuts[i + 1], local.data());
            for (int64_t e = 0; e < kE; ++e) amax[e] = std::max(amax[e], local[e]);
          }
        std::vector<std::vector<uint8_t>> images;
        std::vector<void*> ptrs;
        for (const PackedComponent& pc : pieces.packed_components())
          images.emplace_back(kE * kN * kK * pc.bytes_num / pc.bytes_den, 0xCD);
        for (auto& img : images) ptrs.push_back(img.data());
        for (size_t i = 0; i + 1 < cuts.size(); ++i)
          pieces.quantize_rows(w.data() + cuts[i] * kK, cuts[i], cuts[i + 1], amax.data(), ptrs);
        pieces.write_primary_from_packed({ptrs.begin(), ptrs.end()}, amax.data());
        EXPECT_EQ(pieces.primary_state(), PrimaryState::kCurrent);
        pieces.prepare_compute();
        whole.prepare_compute();
        EXPECT_TRUE(components(pieces) == components(whole)) << "trial " << trial;
      }
    }
}

TEST(GroupedParamRows, PackedComponentsCarryTheDocumentedBytes) {
  const Tensor init = host_f32(std::vector<float>(kE * kN * kK, 0.5f), {kE, kN, kK});
  auto bytes = [&](const ParamCase& c) {
    GroupedParam p(cpu_backend(), c.recipe, c.primary, Layout::kSingle, init);
    double b = 0;
    for (const PackedComponent& pc : p.packed_components())
      b += static_cast<double>(pc.bytes_num) / static_cast<double>(pc.bytes_den);
    return b;
  };
  EXPECT_EQ(bytes(kParamCases[0]), 2.0);
  EXPECT_EQ(bytes(kParamCases[1]), 2.0 + 2.0 / 32);  // 1D: both copies
  EXPECT_EQ(bytes(kParamCases[2]), 1.0 + 1.0 / 32);  // 2D: one copy
  EXPECT_EQ(bytes(kParamCases[3]), 2.0);             // a high-precision primary travels as BF16
  EXPECT_EQ(bytes(kParamCases[4]), 0.5 + 1.0 / 16);
}

TEST(GroupedParamOptimizerSide, CopiesTheInitBytesThenRefusesFp32Use) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::mt19937 rng(15);
  const std::vector<float> v = random_groups(rng, {kE * kN}, kK, false);
  const Tensor init = host_f32(v, {kE, kN, kK});
  for (Layout layout : {Layout::kDiscrete, Layout::kSingle}) {
    GroupedParam p(cpu_backend(), {Recipe::kNvfp4, false, 1}, PrimaryWeight::kLowPrecision,
                   layout, init);
    std::vector<float> got(5000);
    p.copy_init(kN * kK - 100, 5000, got.data());  // crosses experts 0 -> 1 -> 2
    EXPECT_EQ(0, std::memcmp(got.data(), v.data() + kN * kK - 100, got.size() * sizeof(float)));
    EXPECT_DEATH(p.mark_primary_awaiting_gather(), "only a master the optimizer holds");
    p.release_init();
    EXPECT_EQ(p.fp32_state(), Fp32State::kReleased);
    EXPECT_DEATH(p.fp32_weight(), "no FP32 weight here: the param is Released");
    EXPECT_DEATH(p.copy_init(0, 1, got.data()), "copy_init: the init is gone \\(Released");
    EXPECT_DEATH(p.release_init(), "release_init: the init is gone");
    EXPECT_DEATH(p.keep_fp32_replica(), "keep_fp32_replica: the init is gone");
    p.mark_primary_awaiting_gather();
    EXPECT_DEATH(p.fprop_weight(), "fprop_weight: the primary weight is older than the master");
    EXPECT_DEATH(p.prepare_compute(), "prepare_compute: the primary weight is older");
    std::vector<float> next(v.size(), 0.5f);
    EXPECT_DEATH(p.write_fp32_replica(next.data()), "write_fp32_replica: the param is Released");
  }

  // A replica (layers that read the FP32 weight): the init stays as the FP32 weight, refreshed
  // from outside; reading it while a gather is owed is an error.
  GroupedParam r(cpu_backend(), {Recipe::kBF16, false, 1}, PrimaryWeight::kHighPrecision,
                 Layout::kDiscrete, init);
  r.keep_fp32_replica();
  EXPECT_EQ(r.fp32_state(), Fp32State::kReplicated);
  const GroupedParam& rc = r;
  EXPECT_EQ(0, std::memcmp(rc.fp32_weight().download().data(), v.data(), v.size() * sizeof(float)));
  r.mark_primary_awaiting_gather();
  EXPECT_DEATH(rc.fp32_weight(), "fp32_weight \\(a replica\\): the primary weight is older");
  std::vector<float> next(v.size(), 0.5f);
  r.write_fp32_replica(next.data());
  std::vector<uint16_t> bf16(kE * kN * kK, f32_to_bf16(0.5f));  // the gather's primary
  r.write_primary_from_bf16(GroupedStorage::view(
      cpu_backend(), Layout::kSingle,
      {bf16.data(), bf16.data() + kN * kK, bf16.data() + 2 * kN * kK}, kN * kK * 2));
  EXPECT_EQ(0, std::memcmp(rc.fp32_weight().download().data(), next.data(),
                           next.size() * sizeof(float)));
}

TEST(GroupedParamBoundGrad, MainGradViewsExternalMemoryInBothLayouts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Tensor init = host_f32(std::vector<float>(kE * kN * kK, 0.25f), {kE, kN, kK});
  for (Layout layout : {Layout::kSingle, Layout::kDiscrete}) {
    GroupedParam p(cpu_backend(), {Recipe::kBF16, false, 1}, PrimaryWeight::kHighPrecision, layout,
                   init);
    std::vector<float> buffer(kE * kN * kK + 64, 7.0f);
    std::vector<void*> views;
    for (int64_t e = 0; e < kE; ++e) views.push_back(buffer.data() + 64 + e * kN * kK);
    EXPECT_EQ(p.grad_binding(), GradBinding::kOwned);
    p.bind_main_grad(views);
    EXPECT_EQ(p.grad_binding(), GradBinding::kBound);
    EXPECT_EQ(p.main_grad().ptrs(), views);
    EXPECT_EQ(p.main_grad().layout(), layout);
    EXPECT_DEATH(p.zero_grad(), "zero_grad on a main_grad bound to an optimizer's grad buffer");
    EXPECT_DEATH(p.bind_main_grad(views), "already bound");
    const_cast<GroupedStorage&>(p.main_grad()).zero();  // writes through the views only
    EXPECT_TRUE(
        std::all_of(buffer.begin(), buffer.begin() + 64, [](float x) { return x == 7.0f; }));
    EXPECT_TRUE(std::all_of(buffer.begin() + 64, buffer.end(), [](float x) { return x == 0.0f; }));
  }
}

// ---- the grad buffer's state machine
// -------------------------------------------------------------

TEST(GradBufferState, TransitionTableIsExactlyTheDocumentedOne) {
  using S = GradBufferState;
  const S all[] = {S::kZeroed,        S::kStale,        S::kAccumulating,
                   S::kReduced,       S::kParamsStaged, S::kParamsGathered};
  const std::vector<std::pair<S, S>> legal = {
      {S::kZeroed, S::kAccumulating},       {S::kZeroed, S::kParamsStaged},
      {S::kAccumulating, S::kAccumulating}, {S::kAccumulating, S::kReduced},
      {S::kReduced, S::kParamsStaged},      {S::kReduced, S::kZeroed},
      {S::kParamsStaged, S::kParamsStaged}, {S::kParamsStaged, S::kParamsGathered},
      {S::kParamsGathered, S::kZeroed},     {S::kParamsGathered, S::kStale},
      {S::kStale, S::kAccumulating},        {S::kStale, S::kParamsStaged}};
  for (S from : all)
    for (S to : all)
      EXPECT_EQ(grad_buffer_transition_legal(from, to),
                std::find(legal.begin(), legal.end(), std::make_pair(from, to)) != legal.end())
          << grad_buffer_state_name(from) << " -> " << grad_buffer_state_name(to);
}

// ---- ShardPlan ---------------------------------------------------------------------------------

std::vector<ParamGeometry> random_geometries(std::mt19937& rng) {
  std::uniform_int_distribution<int> count(1, 7), e(1, 6), blocks(1, 5), k(1, 9), unit(0, 2);
  std::vector<ParamGeometry> out(count(rng));
  for (ParamGeometry& g : out) {
    const int64_t units[] = {1, 16, 32};
    g.unit_rows = units[unit(rng)];
    g.experts = e(rng);
    g.rows = g.unit_rows * blocks(rng);
    g.cols = g.unit_rows == 1 ? k(rng) * 3 : k(rng) * 16;
  }
  return out;
}

TEST(ShardPlan, LayoutShardsAndBucketsKeepTheirInvariantsForRandomGeometries) {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<ParamGeometry> geo = random_geometries(rng);
    const int world = std::uniform_int_distribution<int>(1, 9)(rng);
    const int64_t bucket = std::uniform_int_distribution<int64_t>(1, 20000)(rng);
    const Result<ShardPlan> made = ShardPlan::make(geo, world, bucket);
    ASSERT_TRUE(made.is_ok()) << made.status().message();
    const ShardPlan& plan = made.value();
    SCOPED_TRACE("trial " + std::to_string(trial));
    // Reverse order, aligned, disjoint, in order.
    int64_t end = 0;
    for (int i = plan.params() - 1, seen = 0; i >= 0; --i, ++seen) {
      EXPECT_EQ(plan.buffer_order()[seen], i);
      const ParamSlot& s = plan.slot(i);
      EXPECT_EQ(s.offset % kParamAlign, 0);
      EXPECT_GE(s.offset, end);
      EXPECT_EQ(s.numel, geo[i].numel());
      end = s.offset + s.numel;
    }
    EXPECT_EQ(plan.total() % kParamAlign, 0);
    EXPECT_GE(plan.total(), end);
    // Shards partition the buffer; every cut is a legal one near its target.
    EXPECT_EQ(plan.shard(0).begin, 0);
    EXPECT_EQ(plan.shard(world - 1).end, plan.total());
    std::vector<std::vector<int64_t>> covered(plan.params());
    for (int p = 0; p < plan.params(); ++p) covered[p].assign(geo[p].numel(), 0);
    for (int r = 0; r < world; ++r) {
      const FlatRange sh = plan.shard(r);
      EXPECT_LE(sh.begin, sh.end);
      if (r > 0) {
        EXPECT_EQ(sh.begin, plan.shard(r - 1).end);
        const int64_t target = plan.total() * r / world;
        for (int p = 0; p < plan.params(); ++p) {
          const ParamSlot& s = plan.slot(p);
          if (sh.begin > s.offset && sh.begin < s.offset + s.numel) {
            EXPECT_EQ((sh.begin - s.offset) % geo[p].unit(), 0) << "cut inside a block";
            EXPECT_LE(std::abs(sh.begin - target), geo[p].unit() / 2);
          }
        }
      }
      for (const ShardPiece& piece : plan.pieces(r)) {
        EXPECT_EQ(piece.offset, plan.slot(piece.param).offset + piece.begin);
        EXPECT_GE(piece.offset, sh.begin);
        EXPECT_LE(piece.offset + piece.count, sh.end);
        for (int64_t i = 0; i < piece.count; ++i) ++covered[piece.param][piece.begin + i];
      }
    }
    for (int p = 0; p < plan.params(); ++p)
      EXPECT_TRUE(
          std::all_of(covered[p].begin(), covered[p].end(), [](int64_t c) { return c == 1; }))
          << "parameter " << p << " not covered exactly once";
    // Buckets: consecutive, whole parameters, each but the last at least bucket_elems.
    int64_t at = 0;
    for (size_t b = 0; b < plan.buckets().size(); ++b) {
      const FlatRange bk = plan.buckets()[b];
      EXPECT_EQ(bk.begin, at);
      at = bk.end;
      if (b + 1 < plan.buckets().size()) {
        EXPECT_GE(bk.size(), bucket);
      }
      for (int p = 0; p < plan.params(); ++p) {
        const ParamSlot& s = plan.slot(p);
        EXPECT_FALSE(s.offset < bk.begin && s.offset + s.numel > bk.begin) << "split parameter";
      }
      const std::vector<int64_t> counts = plan.bucket_counts(b);
      int64_t sum = 0;
      for (int64_t c : counts) sum += c;
      EXPECT_EQ(sum, bk.size());
    }
    EXPECT_EQ(at, plan.total());
    // A pure function of its inputs.
    const ShardPlan again = ShardPlan::make(geo, world, bucket).value();
    for (int r = 0; r <= world - 1; ++r) EXPECT_EQ(again.pieces(r), plan.pieces(r));
  }
}

TEST(ShardPlan, BadInputIsAStatus) {
  EXPECT_EQ(ShardPlan::make({}, 2, 10).status().message(), "shard plan: no parameters");
  EXPECT_EQ(ShardPlan::make({{1, 48, 32, 32}}, 2, 10).status().message(),
            "shard plan: parameter 0 (1, 48, 32): N is not a multiple of its 32-row quantization "
            "block");
  EXPECT_FALSE(ShardPlan::make({{1, 32, 32, 32}}, 0, 10).is_ok());
  EXPECT_FALSE(ShardPlan::make({{1, 32, 32, 32}}, 2, 0).is_ok());
  EXPECT_FALSE(ShardPlan::make({{0, 32, 32, 32}}, 2, 10).is_ok());
}

// ---- optimizer shards ---------------------------------------------------------------------------

// Every rank's shard of a plan, with element i of parameter p holding p * 1e6 + i (+0.25, +0.5
// for the moments).
std::vector<OptimizerShard> synthetic_shards(const ShardPlan& plan, int64_t steps) {
  std::vector<OptimizerShard> out;
  for (int r = 0; r < plan.world_size(); ++r) {
    OptimizerShard s{plan.world_size(), r, steps, plan.geometries(), plan.pieces(r), {}, {}, {}};
    for (const ShardPiece& piece : s.pieces)
      for (int64_t i = 0; i < piece.count; ++i) {
        const float v = static_cast<float>(piece.param * 1000000 + piece.begin + i);
        s.master.push_back(v);
        s.exp_avg.push_back(v + 0.25f);
        s.exp_avg_sq.push_back(v + 0.5f);
      }
    out.push_back(std::move(s));
  }
  return out;
}

TEST(OptimizerShard, FileRoundTripAndAssemblyFromAnyWorldSize) {
  const std::vector<ParamGeometry> geo = {{1, 4, 48, 1}, {3, 32, 64, 32}, {2, 16, 32, 16}};
  for (int world : {1, 2, 3, 5}) {
    const ShardPlan plan = ShardPlan::make(geo, world, 1000).value();
    std::vector<OptimizerShard> shards = synthetic_shards(plan, 7);
    std::vector<OptimizerShard> decoded;
    for (const OptimizerShard& s : shards) {
      const std::vector<uint8_t> bytes = encode_optimizer_shard(s);
      Result<OptimizerShard> back = decode_optimizer_shard(bytes);
      ASSERT_TRUE(back.is_ok()) << back.status().message();
      EXPECT_EQ(back.value().pieces, s.pieces);
      EXPECT_EQ(back.value().master, s.master);
      EXPECT_EQ(encode_optimizer_shard(back.value()), bytes);
      decoded.push_back(std::move(back).value());
    }
    std::reverse(decoded.begin(), decoded.end());  // any order
    Result<FullOptimizerState> full = assemble_optimizer_state(decoded);
    ASSERT_TRUE(full.is_ok()) << full.status().message();
    EXPECT_EQ(full.value().steps, 7);
    for (size_t p = 0; p < geo.size(); ++p)
      for (int64_t i = 0; i < geo[p].numel(); ++i) {
        ASSERT_EQ(full.value().master[p][i], static_cast<float>(p * 1000000 + i));
        ASSERT_EQ(full.value().exp_avg_sq[p][i], static_cast<float>(p * 1000000 + i) + 0.5f);
      }
  }
}

TEST(OptimizerShard, CorruptFilesAndInconsistentShardsAreStatusErrors) {
  const std::vector<ParamGeometry> geo = {{1, 4, 48, 1}, {3, 32, 64, 32}};
  const ShardPlan plan = ShardPlan::make(geo, 3, 1000).value();
  const std::vector<OptimizerShard> shards = synthetic_shards(plan, 2);
  const std::vector<uint8_t> good = encode_optimizer_shard(shards[1]);
  for (size_t cut = 0; cut < good.size(); cut += 7)  // every truncation fails cleanly
    EXPECT_FALSE(decode_optimizer_shard({good.data(), cut}).is_ok()) << cut;
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  EXPECT_EQ(decode_optimizer_shard(longer).status().message(),
            "optimizer shard: trailing bytes after the state arrays");
  std::vector<uint8_t> magic = good;
  magic[0] = 'X';
  EXPECT_EQ(decode_optimizer_shard(magic).status().message(),
            "optimizer shard: not a packmoe optimizer shard (bad magic)");
  std::vector<uint8_t> version = good;
  version[8] = 9;
  EXPECT_EQ(decode_optimizer_shard(version).status().message(),
            "optimizer shard: version 9, expected 1");
  OptimizerShard outside = shards[1];
  outside.pieces[0].begin = geo[outside.pieces[0].param].numel();
  EXPECT_FALSE(decode_optimizer_shard(encode_optimizer_shard(outside)).is_ok());

  std::vector<OptimizerShard> missing = {shards[0], shards[1]};
  EXPECT_EQ(assemble_optimizer_state(missing).status().message(),
            "optimizer state: 2 shards of a 3-rank save");
  std::vector<OptimizerShard> twice = {shards[0], shards[1], shards[1]};
  EXPECT_EQ(assemble_optimizer_state(twice).status().message(),
            "optimizer state: rank 1 is missing from the range or given twice");
  std::vector<OptimizerShard> other = shards;
  other[2].steps = 3;
  EXPECT_FALSE(assemble_optimizer_state(other).is_ok());
  std::vector<OptimizerShard> overlap = shards;
  overlap[0].pieces = overlap[1].pieces;
  overlap[0].master = overlap[1].master;
  overlap[0].exp_avg = overlap[1].exp_avg;
  overlap[0].exp_avg_sq = overlap[1].exp_avg_sq;
  EXPECT_FALSE(assemble_optimizer_state(overlap).is_ok());
}

}  // namespace
}  // namespace packmoe
