// CUDA quantizers, dequantizers and the scale swizzle against the CPU reference, BYTE FOR BYTE:
// every configuration on at least ten random grouped tensors (packed, uneven with empty groups,
// discrete, misaligned) with edge values sprinkled in. Output buffers start filled with a sentinel
// on both sides and are compared whole, so a write outside a group's region is a mismatch too.
// Uses only the Backend interface (host compiler); skips when no GPU is visible. The harness
// (Mirror, Tally): tests/common/cuda_vs_cpu.h.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/kernel_policy.h"
#include "backend/cuda/selftest.h"
#include "common/cuda_vs_cpu.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"
#include "formats/swizzle.h"

namespace packmoe {
namespace {

constexpr int kTensorsPerCase = 10;

using test::const_ptrs;
using test::Mirror;
using test::Placement;
using test::placement_name;
using test::Tally;

// ---- shapes ------------------------------------------------------------------------------------

struct Layout {
  std::vector<int64_t> rows;
  int64_t k;
  Placement pl;
};

// Ten layouts per case: the grouped shapes of interest with E up to 8, group tables inline (<= 4
// groups) and uploaded (> 4), partial tiles in both directions, empty groups first, in the middle
// and last, and misaligned pointers. `row_block` is the row multiple the configuration needs (1,
// 16 or 32) and `col_block` the K multiple; `ragged` swaps in layouts only a relaxed rule allows.
std::vector<Layout> layouts(int row_block, int col_block, int ragged_rows, int ragged_k) {
  const int64_t b = row_block == 1 ? 32 : row_block;  // base unit of the regular layouts
  const int64_t c = col_block;
  std::vector<Layout> l = {
      {std::vector<int64_t>(8, 2 * b), 256, Placement::kPacked},
      {std::vector<int64_t>(4, 5 * b), 17 * (c == 32 ? 32 : 16), Placement::kPacked},
      {{3 * b, 0, b, 5 * b, 2 * b}, 320, Placement::kPacked},
      {{2 * b, b, 3 * b}, 192, Placement::kDiscrete},
      {{b, 2 * b}, 96, Placement::kMisaligned},
      {{8 * b}, 512, Placement::kPacked},
      {{0, 4 * b, 0, b, 0}, 64, Placement::kDiscrete},
      {{b, 2 * b, 0, 3 * b, b, 0, 5 * b, b}, 128, Placement::kMisaligned},
      {{b}, c, Placement::kPacked},
      {std::vector<int64_t>(2, 10 * b), 1024, Placement::kPacked},
  };
  if (ragged_rows) {  // rowwise-only: any row count
    l[8] = {{37, 0, 5, 70}, 3 * c, Placement::kPacked};
    l[9] = {{1, 33, 31}, 9 * c, Placement::kMisaligned};
  }
  if (ragged_k) {  // MXFP8 columnwise-only 1D: any K
    l[8] = {{2 * b, b}, 40, Placement::kPacked};
    l[9] = {{3 * b}, 24, Placement::kDiscrete};
  }
  return l;
}

// ---- values
// --------------------------------------------------------------------------------------

float from_bits(uint32_t b) { return f32_from_bits(b); }

// Edge values: signed zeros, infinities, NaNs with payloads and signs, FP32 and BF16 subnormals,
// the extremes of FP32, and values at the FP8 / FP4 saturation points.
float special_value(std::mt19937_64& rng) {
  const uint32_t sign = (rng() & 1) ? 0x80000000u : 0u;
  switch (rng() % 14) {
    case 0:
      return from_bits(sign);
    case 1:
      return from_bits(sign | 0x7F800000u);
    case 2:
      return from_bits(0x7FC00000u);
    case 3:
      return from_bits(sign | 0x7F800000u | (1u + static_cast<uint32_t>(rng() % 0x7FFFFF)));
    case 4:
      return from_bits(sign | static_cast<uint32_t>(1 + rng() % 0x7FFFFF));  // FP32 subnormal
    case 5:
      return from_bits(sign | (static_cast<uint32_t>(1 + rng() % 0x7F) << 16));  // BF16 sub.
    case 6:
      return from_bits(sign | 0x7F7FFFFFu);  // FLT_MAX
    case 7:
      return from_bits(sign | 0x00800000u);  // FLT_MIN
    case 8:
      return sign ? -448.0f : 448.0f;
    case 9:
      return sign ? -464.0f : 464.0f;  // E4M3 midpoint 448 | 480
    case 10:
      return sign ? -57344.0f : 61440.0f;  // E5M2 max / midpoint above it
    case 11:
      return sign ? -6.0f : 5.0f;  // E2M1 max / tie 4 | 6
    case 12:
      return std::ldexp(1.0f, static_cast<int>(rng() % 254) - 126) * (sign ? -1.0f : 1.0f);
    default:
      return std::ldexp(1.5f, -130);
  }
}

// Midpoints between consecutive positive codes of a minifloat (exact in BF16 and FP32).
std::vector<float> midpoints(DType el) {
  std::vector<float> m;
  if (el == DType::kE2M1) {
    for (uint8_t c = 0; c < 7; ++c) m.push_back((e2m1_to_f32(c) + e2m1_to_f32(c + 1)) * 0.5f);
  } else {
    const uint8_t max = el == DType::kE5M2 ? kE5M2MaxCode : kE4M3MaxCode;
    for (uint8_t c = 0; c < max; ++c) {
      const float a = el == DType::kE5M2 ? e5m2_to_f32(c) : e4m3_to_f32(c);
      const float b2 = el == DType::kE5M2 ? e5m2_to_f32(c + 1) : e4m3_to_f32(c + 1);
      m.push_back((a + b2) * 0.5f);
    }
  }
  return m;
}

struct ValueRecipe {
  DType tie_element;  // E4M3/E5M2 (MXFP8) or E2M1 (NVFP4)
  int tile_rows;      // tie tiles: (1, B) rows, (B, 1) columns, (B, B) 2D
  int tile_cols;
  int block;  // 32 (MXFP8) or 16 (NVFP4)
};

// Values of one group (rows, K). Tensor `variant` picks the flavour: 0 wide-range random with
// specials and zero blocks; 1 exact ties after scaling (no specials, so the NVFP4 per-group scale
// is an exact power of two); 2 special-heavy.
std::vector<float> make_group(int64_t rows, int64_t k, const ValueRecipe& vr, int variant,
                              std::mt19937_64& rng) {
  std::vector<float> x(rows * k);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int shift = variant == 0 ? static_cast<int>(rng() % 5) - 2 : 0;  // 2^(+-100) extremes
  const float max_norm = vr.tie_element == DType::kE2M1   ? 6.0f
                         : vr.tie_element == DType::kE5M2 ? 57344.0f
                                                          : 448.0f;
  const int m = static_cast<int>(rng() % 21) - 10;  // NVFP4 tie tensors: group amax 2688 * 2^m
  for (int64_t r = 0; r < rows; ++r) {
    const int e = static_cast<int>(rng() % 61) - 30 + 50 * shift;
    for (int64_t c = 0; c < k; ++c) {
      float v = std::ldexp(normal(rng), e);
      if (variant == 1) {
        v = std::ldexp(normal(rng), m + 6);
        const float lim = std::ldexp(2600.0f, m);
        v = std::fmax(-lim, std::fmin(lim, v));
      }
      x[r * k + c] = v;
    }
  }
  if (rows == 0) return x;
  const std::vector<float> mids = midpoints(vr.tie_element);
  auto tie_tile = [&](int64_t r0, int64_t c0, int64_t tr, int64_t tc) {
    // Block max = max_norm * 2^s pins the scale; the others are midpoints * 2^s (exact ties).
    const int s = vr.tie_element == DType::kE2M1 ? m + static_cast<int>(rng() % 14) - 6
                                                 : static_cast<int>(rng() % 41) - 20;
    for (int64_t i = 0; i < tr; ++i)
      for (int64_t j = 0; j < tc; ++j) {
        const float sign = (rng() & 1) ? -1.0f : 1.0f;
        x[(r0 + i) * k + c0 + j] = sign * std::ldexp(mids[rng() % mids.size()], s);
      }
    x[r0 * k + c0] = std::ldexp(max_norm, s);
  };
  const int64_t B = vr.block;
  const int64_t tr = vr.tile_rows, tc = vr.tile_cols;
  if (rows >= tr && k >= tc) {
    const int n_ties = variant == 1 ? static_cast<int>((rows / tr) * (k / tc) / 2 + 1) : 2;
    for (int t = 0; t < n_ties; ++t) {
      const int64_t r0 = static_cast<int64_t>(rng() % (rows / tr)) * tr;
      const int64_t c0 = static_cast<int64_t>(rng() % (k / tc)) * tc;
      tie_tile(r0, c0, tr, tc);
    }
  }
  if (variant == 1) {
    if (vr.tie_element == DType::kE2M1) x[rng() % x.size()] = std::ldexp(2688.0f, m);
    return x;
  }
  // Whole zero blocks along rows and along columns.
  for (int t = 0; t < 3; ++t) {
    if (k >= B) {
      const int64_t r = rng() % rows, c0 = (rng() % (k / B)) * B;
      for (int64_t j = 0; j < B; ++j) x[r * k + c0 + j] = 0.0f;
    }
    if (rows >= B) {
      const int64_t r0 = (rng() % (rows / B)) * B, c = rng() % k;
      for (int64_t i = 0; i < B; ++i) x[(r0 + i) * k + c] = (t == 0) ? -0.0f : 0.0f;
    }
  }
  const double rate = variant == 2 ? 0.05 : 0.004;
  std::bernoulli_distribution special(rate);
  for (float& v : x)
    if (special(rng)) v = special_value(rng);
  return x;
}

// Fills the input mirror's host side with the groups' values in `dtype` and uploads it.
void write_input(Mirror& in, DType dtype, const std::vector<int64_t>& rows, int64_t k,
                 const ValueRecipe& vr, int variant, std::mt19937_64& rng) {
  for (size_t g = 0; g < rows.size(); ++g) {
    const std::vector<float> x = make_group(rows[g], k, vr, variant, rng);
    if (dtype == DType::kF32) {
      std::memcpy(in.h(g), x.data(), x.size() * sizeof(float));
    } else {
      std::vector<uint16_t> h(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = f32_to_bf16(x[i]);
      std::memcpy(in.h(g), h.data(), h.size() * sizeof(uint16_t));
    }
  }
  in.upload();
}

std::vector<size_t> sizes(const std::vector<int64_t>& rows, double bytes_per_row) {
  std::vector<size_t> s;
  for (int64_t r : rows) s.push_back(static_cast<size_t>(r * bytes_per_row));
  return s;
}

// ---- MXFP8
// ---------------------------------------------------------------------------------------

struct Mxfp8Case {
  DType element;
  bool rowwise;
  bool columnwise;
  bool two_d;
  DType input;
  std::string name() const {
    std::string s = "mxfp8_";
    s += element == DType::kE4M3 ? "e4m3" : "e5m2";
    s += rowwise && columnwise ? "_both" : rowwise ? "_row" : "_col";
    s += two_d ? "_2d_" : "_1d_";
    s += input == DType::kBF16 ? "bf16" : "f32";
    return s;
  }
};

class Mxfp8Test : public ::testing::TestWithParam<Mxfp8Case> {};

TEST_P(Mxfp8Test, CudaEqualsCpuBytewise) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const Mxfp8Case cs = GetParam();
  Backend& cpu = cpu_backend();
  Mxfp8Config cfg;
  cfg.element = cs.element;
  cfg.rowwise = cs.rowwise;
  cfg.columnwise = cs.columnwise;
  cfg.two_d = cs.two_d;
  const int row_block = (cs.columnwise || cs.two_d) ? 32 : 1;
  const int col_block = (cs.rowwise || cs.two_d) ? 32 : 1;
  const bool ragged_k = col_block == 1;
  const std::vector<Layout> shapes =
      layouts(row_block, ragged_k ? 32 : col_block, row_block == 1, ragged_k);
  const ValueRecipe vr{cs.element, cs.two_d ? 32 : 1, cs.two_d ? 32 : 32, 32};
  const ValueRecipe vr_col{cs.element, 32, 1, 32};
  const size_t in_elt = cs.input == DType::kF32 ? 4 : 2;

  Tally q{"quantize   " + cs.name()}, dq{"dequantize " + cs.name() + " (each copy x f32,bf16)"},
      sw{"swizzle    " + cs.name() + " (row; col transposed)"};
  std::mt19937_64 rng(std::random_device{}());
  for (int t = 0; t < kTensorsPerCase; ++t) {
    const Layout& L = shapes[t % shapes.size()];
    const int variant = t % 3;
    SCOPED_TRACE(testing::Message()
                 << "tensor " << t << " " << placement_name(L.pl) << " K=" << L.k);
    const int64_t K = L.k;
    Mirror in(*gpu, sizes(L.rows, K * in_elt), L.pl, in_elt);
    write_input(in, cs.input, L.rows, K, (t % 2 && !cs.two_d) ? vr_col : vr, variant, rng);
    // Output regions; misaligned layouts shift outputs by one byte (scalar store paths).
    const size_t sh = 1;
    // Every other 1D tensor also asks for the copies' BF16 values (row_bf16 / col_bf16): the
    // kernel writes them (BF16 input, aligned), or the dequantize after it (F32, misaligned); every
    // fourth keeps its copies as their values only (no data or scale).
    const bool values = t % 2 == 1 && !cs.two_d, values_only = values && t % 4 == 3;
    std::unique_ptr<Mirror> rd, rs, cd, csc;
    if (cs.rowwise && !values_only) {
      rd = std::make_unique<Mirror>(*gpu, sizes(L.rows, K), L.pl, sh);
      rs = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 32.0), L.pl, sh);
    }
    if (cs.columnwise && !values_only) {
      cd = std::make_unique<Mirror>(*gpu, sizes(L.rows, K), L.pl, sh);
      csc = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 32.0), L.pl, sh);
    }
    std::unique_ptr<Mirror> rv, cv;
    if (values) {
      if (cs.rowwise) rv = std::make_unique<Mirror>(*gpu, sizes(L.rows, K * 2), L.pl, 2);
      if (cs.columnwise) cv = std::make_unique<Mirror>(*gpu, sizes(L.rows, K * 2), L.pl, 2);
    }
    GroupedMatrices gin_h{cs.input, K, const_ptrs(in.h_all()), L.rows};
    GroupedMatrices gin_d{cs.input, K, const_ptrs(in.d_all()), L.rows};
    Mxfp8Outputs oh, od;
    if (rd) oh.row_data = rd->h_all(), od.row_data = rd->d_all();
    if (rs) oh.row_scale = rs->h_all(), od.row_scale = rs->d_all();
    if (cd) oh.col_data = cd->h_all(), od.col_data = cd->d_all();
    if (csc) oh.col_scale = csc->h_all(), od.col_scale = csc->d_all();
    if (rv) oh.row_bf16 = rv->h_all(), od.row_bf16 = rv->d_all();
    if (cv) oh.col_bf16 = cv->h_all(), od.col_bf16 = cv->d_all();
    const Status sc = ops::quantize_mxfp8(cpu, gin_h, cfg, oh);
    ASSERT_TRUE(sc.is_ok()) << sc.message();
    const Status sg = ops::quantize_mxfp8(*gpu, gin_d, cfg, od);
    ASSERT_TRUE(sg.is_ok()) << sg.message();
    ++q.cases;
    if (rd) rd->compare(q, "row_data"), rs->compare(q, "row_scale");
    if (cd) cd->compare(q, "col_data"), csc->compare(q, "col_scale");
    if (rv) rv->compare(q, "row_bf16");
    if (cv) cv->compare(q, "col_bf16");

    // Dequantize each copy from each side's own bytes, to F32 and BF16.
    ++dq.cases;
    for (int copy = 0; copy < 2; ++copy) {
      Mirror* data = copy == 0 ? rd.get() : cd.get();
      Mirror* scale = copy == 0 ? rs.get() : csc.get();
      if (!data) continue;
      for (DType od_t : {DType::kF32, DType::kBF16}) {
        const size_t ob = od_t == DType::kF32 ? 4 : 2;
        Mirror out(*gpu, sizes(L.rows, K * ob), L.pl, ob);
        Mxfp8Copy qh{cs.element,
                     copy == 1,
                     K,
                     L.rows,
                     const_ptrs(data->h_all()),
                     const_ptrs(scale->h_all())};
        Mxfp8Copy qd{cs.element,
                     copy == 1,
                     K,
                     L.rows,
                     const_ptrs(data->d_all()),
                     const_ptrs(scale->d_all())};
        const Status a = ops::dequantize_mxfp8(cpu, qh, od_t, out.h_all());
        ASSERT_TRUE(a.is_ok()) << a.message();
        const Status b = ops::dequantize_mxfp8(*gpu, qd, od_t, out.d_all());
        ASSERT_TRUE(b.is_ok()) << b.message();
        out.compare(dq, copy == 0 ? "dequant row" : "dequant col");
      }
    }
    // Swizzle every non-empty group's scales: rowwise (rows, K/32) as is, columnwise
    // (rows/32, K) transposed (the GEMM reads it as (K, rows/32)).
    ++sw.cases;
    for (int copy = 0; copy < 2; ++copy) {
      Mirror* scale = copy == 0 ? rs.get() : csc.get();
      if (!scale) continue;
      for (size_t g = 0; g < L.rows.size(); ++g) {
        if (L.rows[g] == 0) continue;
        const int64_t sr = copy == 0 ? L.rows[g] : L.rows[g] / 32;
        const int64_t scc = copy == 0 ? K / 32 : K;
        if (sr == 0 || scc == 0) continue;
        const bool tr = copy == 1;
        Mirror out(*gpu, {static_cast<size_t>(swizzled_scale_bytes(tr ? scc : sr, tr ? sr : scc))},
                   Placement::kPacked, 0);
        const Status a = ops::swizzle_scales(cpu, scale->h(g), sr, scc, tr, out.h(0));
        ASSERT_TRUE(a.is_ok()) << a.message();
        const Status b = ops::swizzle_scales(*gpu, scale->d(g), sr, scc, tr, out.d(0));
        ASSERT_TRUE(b.is_ok()) << b.message();
        out.compare(sw, tr ? "swizzle col^T" : "swizzle row");
      }
    }
  }
}

std::vector<Mxfp8Case> mxfp8_cases() {
  std::vector<Mxfp8Case> v;
  for (DType in : {DType::kBF16, DType::kF32})
    for (DType el : {DType::kE4M3, DType::kE5M2})
      for (int usage = 0; usage < 3; ++usage)
        for (bool two_d : {false, true}) v.push_back({el, usage != 1, usage != 0, two_d, in});
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllConfigs, Mxfp8Test, ::testing::ValuesIn(mxfp8_cases()),
                         [](const auto& info) { return info.param.name(); });

// ---- NVFP4
// ---------------------------------------------------------------------------------------

struct Nvfp4Case {
  bool rowwise;
  bool columnwise;
  bool two_d;
  bool rht;
  bool sr;
  DType input;
  std::string name() const {
    std::string s = "nvfp4";
    s += rowwise && columnwise ? "_both" : rowwise ? "_row" : "_col";
    s += two_d ? "_2d" : "_1x16";
    if (rht) s += "_rht";
    if (sr) s += "_sr";
    s += input == DType::kBF16 ? "_bf16" : "_f32";
    return s;
  }
};

class Nvfp4Test : public ::testing::TestWithParam<Nvfp4Case> {};

TEST_P(Nvfp4Test, CudaEqualsCpuBytewise) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const Nvfp4Case cs = GetParam();
  Backend& cpu = cpu_backend();
  const int row_block = (cs.columnwise || cs.two_d) ? 16 : 1;
  const std::vector<Layout> shapes = layouts(row_block, 16, row_block == 1, false);
  const ValueRecipe vr_row{DType::kE2M1, cs.two_d ? 16 : 1, 16, 16};
  const ValueRecipe vr_col{DType::kE2M1, 16, cs.two_d ? 16 : 1, 16};
  const size_t in_elt = cs.input == DType::kF32 ? 4 : 2;

  Tally q{"quantize   " + cs.name()}, dq{"dequantize " + cs.name() + " (each copy x f32,bf16)"},
      sw{"swizzle    " + cs.name() + " (row; col)"};
  std::mt19937_64 rng(std::random_device{}());
  for (int t = 0; t < kTensorsPerCase; ++t) {
    const Layout& L = shapes[t % shapes.size()];
    const int variant = t % 3;
    SCOPED_TRACE(testing::Message()
                 << "tensor " << t << " " << placement_name(L.pl) << " K=" << L.k);
    const int64_t K = L.k;
    const size_t G = L.rows.size();
    Nvfp4Config cfg;
    cfg.rowwise = cs.rowwise;
    cfg.columnwise = cs.columnwise;
    cfg.two_d = cs.two_d;
    cfg.rht = cs.rht;
    cfg.stochastic_rounding = cs.sr;
    cfg.seed = rng();
    cfg.offset = rng() % 100000;

    Mirror in(*gpu, sizes(L.rows, K * in_elt), L.pl, in_elt);
    write_input(in, cs.input, L.rows, K, (t % 2) ? vr_col : vr_row, variant, rng);
    const size_t sh = 1;
    std::unique_ptr<Mirror> rd, rs, ra, cd, csc, ca, rb;
    if (cs.rowwise) {
      // Every other tensor also asks for the rowwise copy's BF16 values (1x16 blocks only), every
      // fourth keeps that copy as its values only (no data or scale).
      const bool values = !cs.two_d && t % 2 == 0, values_only = values && t % 4 == 2;
      if (!values_only) {
        rd = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 2.0), L.pl, sh);
        rs = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 16.0), L.pl, sh);
      }
      ra = std::make_unique<Mirror>(*gpu, std::vector<size_t>{G * 4}, Placement::kPacked, 0);
      if (values) rb = std::make_unique<Mirror>(*gpu, sizes(L.rows, K * 2.0), L.pl, 2);
    }
    if (cs.columnwise) {
      cd = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 2.0), L.pl, sh);
      csc = std::make_unique<Mirror>(*gpu, sizes(L.rows, K / 16.0), L.pl, sh);
      ca = std::make_unique<Mirror>(*gpu, std::vector<size_t>{G * 4}, Placement::kPacked, 0);
    }
    GroupedMatrices gin_h{cs.input, K, const_ptrs(in.h_all()), L.rows};
    GroupedMatrices gin_d{cs.input, K, const_ptrs(in.d_all()), L.rows};
    Nvfp4Outputs oh, od;
    if (rd) {
      oh.row_data = rd->h_all(), od.row_data = rd->d_all();
      oh.row_scale = rs->h_all(), od.row_scale = rs->d_all();
    }
    if (ra) oh.row_amax = ra->h(0), od.row_amax = ra->d(0);
    if (cd) {
      oh.col_data = cd->h_all(), od.col_data = cd->d_all();
      oh.col_scale = csc->h_all(), od.col_scale = csc->d_all();
      oh.col_amax = ca->h(0), od.col_amax = ca->d(0);
    }
    if (rb) oh.row_bf16 = rb->h_all(), od.row_bf16 = rb->d_all();
    const Status sc = ops::quantize_nvfp4(cpu, gin_h, cfg, oh);
    ASSERT_TRUE(sc.is_ok()) << sc.message();
    // Tensors 1 and 2 (mod 3) run on a grid of 1 or 3 CTAs, so a CTA walks many tiles and crosses
    // groups, empty ones included (the whole GPU's grid holds every tile of these shapes at once).
    KernelPolicy few_ctas;
    few_ctas.quantize.nvfp4_max_ctas = t % 3 == 0 ? 0 : t % 3 == 1 ? 1 : 3;
    Status sg;
    {
      const ScopedKernelPolicy use(few_ctas);
      sg = ops::quantize_nvfp4(*gpu, gin_d, cfg, od);
    }
    ASSERT_TRUE(sg.is_ok()) << sg.message();
    ++q.cases;
    if (rd) rd->compare(q, "row_data"), rs->compare(q, "row_scale");
    if (ra) ra->compare(q, "row_amax");
    if (cd) cd->compare(q, "col_data"), csc->compare(q, "col_scale"), ca->compare(q, "col_amax");
    if (rb) rb->compare(q, "row_bf16");

    // Dequantize: the rowwise copy in one call over all groups; the transposed columnwise copy
    // per group (its stored row length rows_g differs between groups).
    ++dq.cases;
    for (int copy = 0; copy < 2; ++copy) {
      Mirror* data = copy == 0 ? rd.get() : cd.get();
      Mirror* scale = copy == 0 ? rs.get() : csc.get();
      Mirror* amax = copy == 0 ? ra.get() : ca.get();
      if (!data) continue;
      std::vector<float> s_dec(G);
      for (size_t g = 0; g < G; ++g) {
        float a;
        std::memcpy(&a, amax->host_bytes().data() + 4 * g, 4);
        s_dec[g] = nvfp4_decode_scale(a);
      }
      Mirror dec(*gpu, {G * 4}, Placement::kPacked, 0);
      std::memcpy(dec.h(0), s_dec.data(), G * 4);
      dec.upload();
      for (DType od_t : {DType::kF32, DType::kBF16}) {
        const size_t ob = od_t == DType::kF32 ? 4 : 2;
        Mirror out(*gpu, sizes(L.rows, K * ob), L.pl, ob);
        if (copy == 0) {
          Nvfp4Copy qh{K, L.rows, const_ptrs(data->h_all()), const_ptrs(scale->h_all()),
                       dec.h(0)};
          Nvfp4Copy qd{K, L.rows, const_ptrs(data->d_all()), const_ptrs(scale->d_all()),
                       dec.d(0)};
          const Status a = ops::dequantize_nvfp4(cpu, qh, od_t, out.h_all());
          ASSERT_TRUE(a.is_ok()) << a.message();
          const Status b = ops::dequantize_nvfp4(*gpu, qd, od_t, out.d_all());
          ASSERT_TRUE(b.is_ok()) << b.message();
        } else {
          for (size_t g = 0; g < G; ++g) {
            if (L.rows[g] == 0) continue;
            const float* dh = static_cast<const float*>(dec.h(0)) + g;
            const float* dd = static_cast<const float*>(dec.d(0)) + g;
            Nvfp4Copy qh{L.rows[g], {K}, {data->h(g)}, {scale->h(g)}, dh};
            Nvfp4Copy qd{L.rows[g], {K}, {data->d(g)}, {scale->d(g)}, dd};
            const Status a = ops::dequantize_nvfp4(cpu, qh, od_t, {out.h(g)});
            ASSERT_TRUE(a.is_ok()) << a.message();
            const Status b = ops::dequantize_nvfp4(*gpu, qd, od_t, {out.d(g)});
            ASSERT_TRUE(b.is_ok()) << b.message();
          }
        }
        out.compare(dq, copy == 0 ? "dequant row" : "dequant col");
      }
    }
    // Swizzle: rowwise (rows, K/16) and the transposed copy's (K, rows/16), both as stored.
    ++sw.cases;
    for (int copy = 0; copy < 2; ++copy) {
      Mirror* scale = copy == 0 ? rs.get() : csc.get();
      if (!scale) continue;
      for (size_t g = 0; g < G; ++g) {
        if (L.rows[g] == 0) continue;
        const int64_t sr = copy == 0 ? L.rows[g] : K;
        const int64_t scc = copy == 0 ? K / 16 : L.rows[g] / 16;
        Mirror out(*gpu, {static_cast<size_t>(swizzled_scale_bytes(sr, scc))}, Placement::kPacked,
                   0);
        const Status a = ops::swizzle_scales(cpu, scale->h(g), sr, scc, false, out.h(0));
        ASSERT_TRUE(a.is_ok()) << a.message();
        const Status b = ops::swizzle_scales(*gpu, scale->d(g), sr, scc, false, out.d(0));
        ASSERT_TRUE(b.is_ok()) << b.message();
        out.compare(sw, copy == 0 ? "swizzle row" : "swizzle col");
      }
    }
  }
}

std::vector<Nvfp4Case> nvfp4_cases() {
  std::vector<Nvfp4Case> v;
  for (DType in : {DType::kBF16, DType::kF32}) {
    // 1x16: rowwise (with/without SR), columnwise (RHT x SR), both (plain, and the gradient
    // recipe RHT + SR); 2D 16x16: each usage.
    v.push_back({true, false, false, false, false, in});
    v.push_back({true, false, false, false, true, in});
    for (bool rht : {false, true})
      for (bool sr : {false, true}) v.push_back({false, true, false, rht, sr, in});
    v.push_back({true, true, false, false, false, in});
    v.push_back({true, true, false, true, true, in});
    v.push_back({true, false, true, false, false, in});
    v.push_back({false, true, true, false, false, in});
    v.push_back({true, true, true, false, false, in});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllConfigs, Nvfp4Test, ::testing::ValuesIn(nvfp4_cases()),
                         [](const auto& info) { return info.param.name(); });

// ---- hardware FP8 conversion self-test
// -----------------------------------------------------------

TEST(CudaFp8Codec, HardwareCvtEqualsSoftwareCodecOnAllFp32Inputs) {
  PACKMOE_SKIP_WITHOUT_GPU();
  (void)gpu;
  for (DType el : {DType::kE4M3, DType::kE5M2}) {
    uint32_t first = 0;
    const uint64_t n = cuda_count_fp8_codec_mismatches(el, &first);
    std::printf(
        "[cuda==cpu] fp8 codec self-test %-6s inputs=2^32 (both cvt halves) mismatches=%llu"
        " first=0x%08x\n",
        el == DType::kE4M3 ? "e4m3" : "e5m2", static_cast<unsigned long long>(n), first);
    EXPECT_EQ(n, 0u) << "hardware cvt differs from the software codec; first input 0x" << std::hex
                     << first << " (the MXFP8 kernels then fall back to the software codec)";
  }
}

// The fast encoders only run where these sweeps find no mismatch (else the kernels fall back to
// the shared codecs, and every bytewise test above still passes, only slower): so a fast encoder
// that drifts from its definition must fail here.
TEST(CudaNvfp4Codec, FastEncodersEqualSoftwareCodecOnAllFp32Inputs) {
  PACKMOE_SKIP_WITHOUT_GPU();
  (void)gpu;
  uint32_t first = 0;
  const uint64_t n = cuda_count_e2m1_codec_mismatches(&first);
  std::printf("[cuda==cpu] e2m1 rn/sr encoders and values, bf16 rounding, rht scaling, e4m3 decode"
              " self-test inputs=2^32 mismatches=%llu"
              " first=0x%08x\n",
              static_cast<unsigned long long>(n), first);
  EXPECT_EQ(n, 0u) << "fast E2M1 encoder differs from the shared codec; first input 0x" << std::hex
                   << first;
}

TEST(CudaMxfp8Scale, FastScaleCodeEqualsSoftwareOnEveryAmax) {
  PACKMOE_SKIP_WITHOUT_GPU();
  (void)gpu;
  uint32_t first = 0;
  const uint64_t n = cuda_count_e8m0_scale_mismatches(&first);
  std::printf("[cuda==cpu] e8m0 scale code self-test amax=0..Inf mismatches=%llu first=0x%08x\n",
              static_cast<unsigned long long>(n), first);
  EXPECT_EQ(n, 0u) << "fast E8M0 scale code differs from the shared one; first amax 0x" << std::hex
                   << first;
}

}  // namespace
}  // namespace packmoe
