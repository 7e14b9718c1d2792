// MXFP8 quantizer (formats/mxfp8.{h,cpp}, formats/mxfp8_math.h) against bytes derived by hand in
// the comments from reference A.2-A.5, plus an FP64 closed-form reference of the scale rule on
// random data, error bounds of quantize -> dequantize, packed vs discrete bitwise identity and
// the validation errors. Random inputs use a fresh seed, printed on failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/mxfp8_math.h"

namespace packmoe {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t fresh_seed() { return std::random_device{}(); }
#define RANDOM_SEED(name)             \
  const uint32_t name = fresh_seed(); \
  SCOPED_TRACE("random seed " + std::to_string(name))

// ---- harness --------------------------------------------------------------------------------

// A grouped input held as FP32 values; with BF16 dtype the values are BF16-exact and `bf16` holds
// the encoded copy the quantizer reads.
struct Input {
  DType dtype = DType::kF32;
  int64_t k = 0;
  std::vector<int64_t> rows;
  std::vector<std::vector<float>> f32;      // per group (rows_g, K)
  std::vector<std::vector<uint16_t>> bf16;  // per group (rows_g, K) when dtype is BF16

  GroupedMatrices view() const {
    GroupedMatrices g;
    g.dtype = dtype;
    g.cols = k;
    g.rows = rows;
    for (size_t i = 0; i < rows.size(); ++i)
      g.data.push_back(dtype == DType::kF32 ? static_cast<const void*>(f32[i].data())
                                            : static_cast<const void*>(bf16[i].data()));
    return g;
  }
  float at(size_t g, int64_t r, int64_t c) const { return f32[g][r * k + c]; }
};

Input make_input(DType dtype, int64_t k, std::vector<int64_t> rows,
                 const std::vector<std::vector<float>>& values) {
  Input in;
  in.dtype = dtype;
  in.k = k;
  in.rows = std::move(rows);
  in.f32 = values;
  if (dtype == DType::kBF16) {
    in.bf16.resize(values.size());
    for (size_t g = 0; g < values.size(); ++g) {
      for (float& v : in.f32[g]) v = bf16_to_f32(f32_to_bf16(v));
      for (float v : in.f32[g]) in.bf16[g].push_back(f32_to_bf16(v));
    }
  }
  return in;
}

Input single(int64_t rows, int64_t k, const std::vector<float>& x, DType dtype = DType::kF32) {
  return make_input(dtype, k, {rows}, {x});
}

// Normal values with a random power-of-two scale per 32-element row chunk, so blocks span many
// E8M0 codes.
Input random_input(std::mt19937& rng, DType dtype, int64_t k, std::vector<int64_t> rows) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-12, 12);
  std::vector<std::vector<float>> values;
  for (int64_t r : rows) {
    std::vector<float> v(r * k);
    for (int64_t i = 0; i < r * k; i += 32) {
      const float s = std::ldexp(1.0f, exp(rng));
      for (int64_t j = i; j < std::min(i + 32, r * k); ++j) v[j] = normal(rng) * s;
    }
    values.push_back(std::move(v));
  }
  return make_input(dtype, k, std::move(rows), values);
}

struct Quantized {
  std::vector<std::vector<uint8_t>> row_data, row_scale, col_data, col_scale;

  Mxfp8Outputs outputs() {
    Mxfp8Outputs o;
    for (auto& v : row_data) o.row_data.push_back(v.data());
    for (auto& v : row_scale) o.row_scale.push_back(v.data());
    for (auto& v : col_data) o.col_data.push_back(v.data());
    for (auto& v : col_scale) o.col_scale.push_back(v.data());
    return o;
  }
};

// Quantize with every output byte pre-set to `fill`; two fills agreeing proves every byte is
// written.
Quantized quantize(const Input& in, const Mxfp8Config& cfg, uint8_t fill = 0xA5) {
  Quantized q;
  for (int64_t r : in.rows) {
    if (cfg.rowwise) {
      q.row_data.emplace_back(r * in.k, fill);
      q.row_scale.emplace_back(r * in.k / 32, fill);
    }
    if (cfg.columnwise) {
      q.col_data.emplace_back(r * in.k, fill);
      q.col_scale.emplace_back(r / 32 * in.k, fill);
    }
  }
  const Status st = quantize_mxfp8_cpu(in.view(), cfg, q.outputs());
  EXPECT_TRUE(st.is_ok()) << st.message();
  return q;
}

Quantized quantize_checked(const Input& in, const Mxfp8Config& cfg) {
  Quantized a = quantize(in, cfg, 0x00);
  Quantized b = quantize(in, cfg, 0xFF);
  EXPECT_EQ(a.row_data, b.row_data) << "rowwise data bytes left unwritten";
  EXPECT_EQ(a.row_scale, b.row_scale) << "rowwise scale bytes left unwritten";
  EXPECT_EQ(a.col_data, b.col_data) << "columnwise data bytes left unwritten";
  EXPECT_EQ(a.col_scale, b.col_scale) << "columnwise scale bytes left unwritten";
  return a;
}

Mxfp8Config rowwise(DType el = DType::kE4M3) { return Mxfp8Config{el, true, false, false}; }
Mxfp8Config colwise(DType el = DType::kE4M3) { return Mxfp8Config{el, false, true, false}; }

std::vector<float> dequantize(const std::vector<uint8_t>& data, const std::vector<uint8_t>& scale,
                              int64_t rows, int64_t k, bool columnwise, DType el) {
  std::vector<float> out(rows * k);
  Mxfp8Copy c;
  c.element = el;
  c.columnwise = columnwise;
  c.cols = k;
  c.rows = {rows};
  c.data = {data.data()};
  c.scale = {scale.data()};
  const Status st = dequantize_mxfp8_cpu(c, DType::kF32, {out.data()});
  EXPECT_TRUE(st.is_ok()) << st.message();
  return out;
}

// ---- FP64 reference of A.2's closed form -----------------------------------------------------

// 127 + ceil(log2(amax / max_norm)), clamped to [0, 254]; 0 -> 0; Inf -> 254. amax / max_norm in
// FP64 differs from TE's fp32 multiply only on FP32-subnormal ties, which random data never hits
// (reference A.2 checked the two agree for every BF16 amax and 300k random FP32 ones).
int ref_code(double amax, double max_norm) {
  if (amax == 0.0) return 0;
  if (std::isinf(amax)) return 254;
  int e = 0;
  const double m = std::frexp(amax / max_norm, &e);  // v = m * 2^e, m in [0.5, 1)
  const int ceil_log2 = (m == 0.5) ? e - 1 : e;
  return std::clamp(127 + ceil_log2, 0, 254);
}

// Element byte: the FP8 codec (exhaustively tested in test_codecs) of x * 2^(127-code), scaled
// exactly in FP64 then rounded once to FP32 like TE's single FP32 multiply.
uint8_t ref_elem(float x, int code, DType el) {
  if (std::isnan(x)) return 0x7F;
  const float y = static_cast<float>(std::ldexp(static_cast<double>(x), 127 - code));
  return el == DType::kE5M2 ? f32_to_e5m2(y) : f32_to_e4m3(y);
}

double max_norm(DType el) { return el == DType::kE5M2 ? 57344.0 : 448.0; }

// ---- per-block math ---------------------------------------------------------------------------

TEST(Mxfp8Math, MaxNormReciprocalConstants) {
  // fp32(1/448): 1/448 = 2^-9 * 8/7 and 8/7 = 1.001001001...b, so the 23-bit mantissa 0x124924.92
  // rounds up to 0x124925 and the exponent field is 127 - 9 = 0x76: 0x3B124925. 1/57344 =
  // 2^-16 * 8/7: same mantissa, exponent 0x6F: 0x37924925.
  EXPECT_EQ(f32_bits(mxfp8_max_norm_rcp(DType::kE4M3)), 0x3B124925u);
  EXPECT_EQ(f32_bits(mxfp8_max_norm_rcp(DType::kE5M2)), 0x37924925u);
}

TEST(Mxfp8Math, AmaxUpdateIgnoresNanAndTakesAbs) {
  EXPECT_EQ(amax_update(0.0f, -3.0f), 3.0f);
  EXPECT_EQ(amax_update(5.0f, -3.0f), 5.0f);
  EXPECT_EQ(amax_update(2.0f, kNaN), 2.0f);
  EXPECT_EQ(amax_update(0.0f, -kNaN), 0.0f);
  EXPECT_EQ(amax_update(2.0f, -kInf), kInf);
  EXPECT_EQ(f32_bits(amax_update(0.0f, -0.0f)), 0u);  // -0 never replaces +0
}

TEST(Mxfp8Math, ScaleCodeHandDerived) {
  const DType e4 = DType::kE4M3;
  // Closed form of A.2: amax = m * 2^E, m in [1, 2): unbiased exponent E - 8 if m <= 1.75, E - 7
  // if m > 1.75; code = 127 + that, clamped to [0, 254].
  // 448 = 1.75 * 2^8: 448 * fp32(1/448) = 1 + (3/8) 2^-23 (fp32(1/448) is (3/8) 2^-23 relatively
  // above 1/448), which rounds to 1.0: mantissa 0, no round-up -> code 127.
  EXPECT_EQ(mxfp8_scale_code(448.0f, e4), 127);
  // Next FP32 above 448: m > 1.75 -> E - 7 = 1 -> 128. (In FP32: 1 + 0.946 * 2^-23 -> 1 + 2^-23.)
  EXPECT_EQ(mxfp8_scale_code(std::nextafter(448.0f, kInf), e4), 128);
  // 1 = 1 * 2^0, m = 1 <= 1.75 -> E - 8 = -8 -> 119 (v = 1/448 = 2^-9 * 1.14: exponent field
  // 118, nonzero mantissa, rounds up to 119).
  EXPECT_EQ(mxfp8_scale_code(1.0f, e4), 119);
  // Boundary family 1.75 * 2^k -> 119 + k, its FP32 successor -> 120 + k, powers of two 2^k ->
  // 119 + k (m = 1), 1.5 * 2^k -> 119 + k; all inside the unclamped range.
  for (int k = -100; k <= 100; ++k) {
    SCOPED_TRACE("k = " + std::to_string(k));
    const float b = std::ldexp(1.75f, k);
    EXPECT_EQ(mxfp8_scale_code(b, e4), 119 + k);
    EXPECT_EQ(mxfp8_scale_code(std::nextafter(b, kInf), e4), 120 + k);
    EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.0f, k), e4), 119 + k);
    EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.5f, k), e4), 119 + k);
  }
  // Specials (A.4): 0 -> 0; Inf -> v = Inf -> 254 (satfinite); FLT_MAX = 1.99.. * 2^127 ->
  // 127 + 127 - 7 = 247.
  EXPECT_EQ(mxfp8_scale_code(0.0f, e4), 0);
  EXPECT_EQ(mxfp8_scale_code(kInf, e4), 254);
  EXPECT_EQ(mxfp8_scale_code(FLT_MAX, e4), 247);
  // FP32-subnormal v: 1.75 * 2^-118 -> v = 2^-126 (normal) -> 127 - 126 = 1; 1.75 * 2^-119 ->
  // v = 2^-127 exactly (subnormal 0x00400000, mantissa not above 0x400000) -> 0; 2^-120 -> v =
  // 2^-128.8 -> 0; the smallest subnormal input -> 0.
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.75f, -118), e4), 1);
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.75f, -119), e4), 0);
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.0f, -120), e4), 0);
  EXPECT_EQ(mxfp8_scale_code(std::numeric_limits<float>::denorm_min(), e4), 0);
  // E5M2 (max 57344 = 1.75 * 2^15): same rule with 15 instead of 8. 57344 -> 127, next float ->
  // 128, 1 -> 127 - 15 = 112.
  EXPECT_EQ(mxfp8_scale_code(57344.0f, DType::kE5M2), 127);
  EXPECT_EQ(mxfp8_scale_code(std::nextafter(57344.0f, kInf), DType::kE5M2), 128);
  EXPECT_EQ(mxfp8_scale_code(1.0f, DType::kE5M2), 112);
}

TEST(Mxfp8Math, EncodeDecodeHandDerived) {
  // q = e8m0_reciprocal(code) = 2^(127-code). Code 119: q = 256, 1 -> 256 = 2^8 = E4M3 exponent
  // field 15, mantissa 0 = 0x78; decode 0x78 at code 119 = 256 * 2^-8 = 1.
  EXPECT_EQ(mxfp8_encode(1.0f, e8m0_reciprocal(119), DType::kE4M3), 0x78);
  EXPECT_EQ(mxfp8_decode(0x78, 119, DType::kE4M3), 1.0f);
  // NaN of either sign -> 0x7F (canonical, as the GPU's x * q gives a positive NaN).
  EXPECT_EQ(mxfp8_encode(kNaN, 1.0f, DType::kE4M3), 0x7F);
  EXPECT_EQ(mxfp8_encode(-kNaN, 1.0f, DType::kE4M3), 0x7F);
  EXPECT_EQ(mxfp8_encode(-kNaN, 1.0f, DType::kE5M2), 0x7F);
  // Decode extremes (A.4): code 0 = 2^-127, so 448 (0x7E) -> 448 * 2^-127 = 1.75 * 2^-119;
  // code 255 -> NaN; 448 at code 254 -> 448 * 2^127 overflows to Inf.
  EXPECT_EQ(mxfp8_decode(0x7E, 0, DType::kE4M3), std::ldexp(1.75f, -119));
  EXPECT_TRUE(std::isnan(mxfp8_decode(0x38, 255, DType::kE4M3)));
  // Every decoded NaN has the one bit pattern 0x7FFFFFFF, whatever the sign of the element NaN,
  // so CPU (x86 keeps payloads) and CUDA (canonical NaN) write the same bytes.
  EXPECT_EQ(f32_bits(mxfp8_decode(0x38, 255, DType::kE4M3)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(mxfp8_decode(0xFF, 127, DType::kE4M3)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(mxfp8_decode(0x7F, 127, DType::kE4M3)), 0x7FFFFFFFu);
  EXPECT_EQ(f32_bits(mxfp8_decode(0xFE, 127, DType::kE5M2)), 0x7FFFFFFFu);
  EXPECT_EQ(mxfp8_decode(0x7E, 254, DType::kE4M3), kInf);
  EXPECT_EQ(mxfp8_decode(0x7B, 127, DType::kE5M2), 57344.0f);
}

// ---- quantizer: hand-derived blocks -------------------------------------------------------------

// A 32-element block with amax 448 has code 127 (scale 1), so each byte is the E4M3 encoding of
// the element itself. Hand-encoded E4M3 (s.eeee.mmm, bias 7): entries below; the other slots get
// random values in (-1, 1) whose bytes are the plain E4M3 codec of x. The block is then shifted
// by a random power of two 2^p: code 127 + p, same bytes (the scaling is exact).
TEST(Mxfp8Quantize, ScaleOneBlockAndPowerOfTwoShift) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  struct Hand {
    float x;
    uint8_t byte;
  };
  const Hand hand[] = {
      {448.0f, 0x7E},                  // 1.75 * 2^8: e=15, m=6
      {-448.0f, 0xFE},                 // sign bit
      {1.0f, 0x38},                    // e=7
      {-2.0f, 0xC0},                   // e=8, sign
      {0.5f, 0x30},                    // e=6
      {240.0f, 0x77},                  // 1.875 * 2^7: e=14, m=7
      {std::ldexp(1.0f, -6), 0x08},    // smallest normal
      {std::ldexp(1.0f, -9), 0x01},    // smallest subnormal
      {std::ldexp(7.0f, -9), 0x07},    // largest subnormal
      {std::ldexp(1.0f, -10), 0x00},   // half of 2^-9: tie -> even 0
      {std::ldexp(3.0f, -10), 0x02},   // 1.5 * 2^-9: tie between 1 and 2 -> 2
      {std::ldexp(15.0f, -10), 0x08},  // 7.5 * 2^-9: tie between 0x07 and 0x08 -> even 0x08
      {1.0625f, 0x38},                 // tie between 1 (m=0) and 1.125 (m=1) -> m=0
      {1.1875f, 0x3A},                 // tie between 1.125 (m=1) and 1.25 (m=2) -> m=2
      {232.0f, 0x76},                  // 1.8125 * 2^7: tie between m=6 and m=7 -> 224
      {0.0f, 0x00},
  };
  constexpr int kHand = sizeof(hand) / sizeof(hand[0]);
  std::vector<float> x(32);
  std::vector<uint8_t> want(32);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 32; ++i) {
    x[i] = i < kHand ? hand[i].x : u(rng);
    want[i] = i < kHand ? hand[i].byte : f32_to_e4m3(x[i]);
  }
  // Random positions inside the block.
  std::vector<int> perm(32);
  for (int i = 0; i < 32; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<float> xp(32);
  std::vector<uint8_t> wp(32);
  for (int i = 0; i < 32; ++i) {
    xp[perm[i]] = x[i];
    wp[perm[i]] = want[i];
  }
  Quantized q = quantize_checked(single(1, 32, xp), rowwise());
  EXPECT_EQ(q.row_scale[0], std::vector<uint8_t>{127});
  EXPECT_EQ(q.row_data[0], wp);

  const int p = std::uniform_int_distribution<int>(-20, 20)(rng);
  SCOPED_TRACE("power of two shift " + std::to_string(p));
  std::vector<float> xs(32);
  for (int i = 0; i < 32; ++i) xs[i] = std::ldexp(xp[i], p);
  Quantized qs = quantize_checked(single(1, 32, xs), rowwise());
  EXPECT_EQ(qs.row_scale[0], std::vector<uint8_t>{static_cast<uint8_t>(127 + p)});
  EXPECT_EQ(qs.row_data[0], wp);
}

// amax = 1 -> code 119 (scale 2^-8, q = 256): 1 -> 256 = 0x78, -1 -> 0xF8, 0.5 -> 128 = 0x70
// (e=14), 0.75 -> 192 = 1.5 * 2^7 = e=14, m=4 = 0x74. Second block 1.75 * 2^-3 = 56 (boundary,
// code 124, q = 8): 56 -> 448 = 0x7E, 1 -> 8 = 0x50 (e=10). Third block amax = next float above
// 56 (code 125, q = 4): that element -> 224.00002 -> 0x76 (224 = 1.75 * 2^7, e=14, m=6), 1 -> 4 =
// 0x48 (e=9).
TEST(Mxfp8Quantize, AmaxOneAndBoundaryBlocks) {
  const float above56 = std::nextafter(56.0f, kInf);
  std::vector<float> x(96, 0.0f);
  const float b0[] = {1.0f, -1.0f, 0.5f, 0.75f};
  for (int i = 0; i < 32; ++i) x[i] = b0[i % 4];
  for (int i = 32; i < 64; ++i) x[i] = (i == 40) ? 56.0f : 1.0f;
  for (int i = 64; i < 96; ++i) x[i] = (i == 70) ? above56 : 1.0f;
  Quantized q = quantize_checked(single(1, 96, x), rowwise());
  EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{119, 124, 125}));
  const uint8_t w0[] = {0x78, 0xF8, 0x70, 0x74};
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q.row_data[0][i], w0[i % 4]) << i;
  for (int i = 32; i < 64; ++i) EXPECT_EQ(q.row_data[0][i], i == 40 ? 0x7E : 0x50) << i;
  for (int i = 64; i < 96; ++i) EXPECT_EQ(q.row_data[0][i], i == 70 ? 0x76 : 0x48) << i;
}

// All-zero block: amax 0 -> code 0, +0 -> 0x00, -0 -> 0x80 (sign kept by x * q). A second block
// of random values makes sure the zero block is not special-cased by the whole tensor.
TEST(Mxfp8Quantize, ZeroBlock) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> x(64, 0.0f);
  x[7] = -0.0f;
  for (int i = 32; i < 64; ++i) x[i] = n(rng);
  Quantized q = quantize_checked(single(1, 64, x), rowwise());
  EXPECT_EQ(q.row_scale[0][0], 0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q.row_data[0][i], i == 7 ? 0x80 : 0x00) << i;
  std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 64, false, DType::kE4M3);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(dq[i], 0.0f);
}

// NaN inside a finite block (A.4): amax from the finite elements (448 -> code 127), NaN stays NaN
// (0x7F, also for a negative NaN), the others are encoded normally. Dequantized: NaN only there.
// All-NaN block: amax stays 0 -> code 0, every byte 0x7F.
TEST(Mxfp8Quantize, NanBlocks) {
  std::vector<float> x(64, 1.0f);
  x[3] = kNaN;
  x[9] = 448.0f;
  x[10] = -kNaN;
  for (int i = 32; i < 64; ++i) x[i] = (i % 2) ? kNaN : -kNaN;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Quantized q = quantize_checked(single(1, 64, x, dt), rowwise());
    EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{127, 0}));
    for (int i = 0; i < 32; ++i) {
      const uint8_t want = (i == 3 || i == 10) ? 0x7F : (i == 9 ? 0x7E : 0x38);
      EXPECT_EQ(q.row_data[0][i], want) << i;
    }
    for (int i = 32; i < 64; ++i) EXPECT_EQ(q.row_data[0][i], 0x7F) << i;
    std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 64, false, DType::kE4M3);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(std::isnan(dq[i]), i == 3 || i == 10) << i;
    EXPECT_EQ(dq[9], 448.0f);
  }
}

// +Inf in a block (A.4): amax Inf -> v Inf -> code 254 (q = 2^-127); Inf * q = Inf -> 448 = 0x7E,
// -Inf -> 0xFE; finite elements x * 2^-127 round to +-0 (0x00 / 0x80). Dequantized: 448 * 2^127
// overflows to +-Inf, the rest is 0.
TEST(Mxfp8Quantize, InfBlock) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 448.0f);
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = (i % 2 ? -1.0f : 1.0f) * u(rng);
  x[5] = kInf;
  x[6] = -kInf;
  Quantized q = quantize_checked(single(1, 32, x), rowwise());
  EXPECT_EQ(q.row_scale[0][0], 254);
  for (int i = 0; i < 32; ++i) {
    const uint8_t want = i == 5 ? 0x7E : i == 6 ? 0xFE : (i % 2 ? 0x80 : 0x00);
    EXPECT_EQ(q.row_data[0][i], want) << i;
  }
  std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 32, false, DType::kE4M3);
  EXPECT_EQ(dq[5], kInf);
  EXPECT_EQ(dq[6], -kInf);
  EXPECT_EQ(dq[0], 0.0f);
}

// FP32-subnormal v = amax/448 <= 2^-127 -> code 0 (q = 2^127): amax 2^-120 -> 2^-120 * 2^127 =
// 128 = 0x70, 2^-121 -> 64 = 0x68. A block of amax 1.75 * 2^-118 has code 1 (q = 2^126): that
// element -> 448 = 0x7E. The smallest FP32 subnormal 2^-149 (amax of its own block) -> code 0,
// 2^-22 -> 0x00.
TEST(Mxfp8Quantize, SubnormalAmax) {
  std::vector<float> x(96, 0.0f);
  for (int i = 0; i < 32; ++i)
    x[i] = (i % 3 == 0) ? std::ldexp(1.0f, -120) : std::ldexp(1.0f, -121);
  for (int i = 32; i < 64; ++i) x[i] = (i == 33) ? std::ldexp(1.75f, -118) : 0.0f;
  for (int i = 64; i < 96; ++i) x[i] = std::numeric_limits<float>::denorm_min();
  Quantized q = quantize_checked(single(1, 96, x), rowwise());
  EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{0, 1, 0}));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q.row_data[0][i], i % 3 == 0 ? 0x70 : 0x68) << i;
  EXPECT_EQ(q.row_data[0][33], 0x7E);
  for (int i = 64; i < 96; ++i) EXPECT_EQ(q.row_data[0][i], 0x00);
  // Dequantize code 0: 128 * 2^-127 = 2^-120 exactly.
  std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 96, false, DType::kE4M3);
  EXPECT_EQ(dq[0], std::ldexp(1.0f, -120));
}

// E5M2 (s.eeeee.mm, bias 15, max 57344 = 1.75 * 2^15): a block with amax 57344 has code 127.
// 57344 -> 0x7B (e=30, m=3), 1 -> 0x3C (e=15), 1.125 -> tie between 1 (m=0) and 1.25 (m=1) -> 1,
// 1.375 -> tie between 1.25 (m=1) and 1.5 (m=2) -> 0x3E, -2 -> 0xC0 (e=16), 2^-16 -> 0x01
// (smallest subnormal), 2^-17 -> tie -> 0, 3 * 2^-17 -> 0x02. A block with amax 1 has code 112
// (q = 2^15): 1 -> 2^15 = 0x78 (e=30). Inf block: code 254, Inf -> satfinite 57344 = 0x7B.
TEST(Mxfp8Quantize, E5M2Blocks) {
  const DType e5 = DType::kE5M2;
  std::vector<float> x(96, 0.0f);
  const float hand[] = {57344.0f,
                        1.0f,
                        1.125f,
                        1.375f,
                        -2.0f,
                        std::ldexp(1.0f, -16),
                        std::ldexp(1.0f, -17),
                        std::ldexp(3.0f, -17)};
  const uint8_t want[] = {0x7B, 0x3C, 0x3C, 0x3E, 0xC0, 0x01, 0x00, 0x02};
  for (int i = 0; i < 8; ++i) x[i] = hand[i];
  for (int i = 32; i < 64; ++i) x[i] = 1.0f;
  for (int i = 64; i < 96; ++i) x[i] = (i == 64) ? kInf : 3.0f;
  Quantized q = quantize_checked(single(1, 96, x), rowwise(e5));
  EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{127, 112, 254}));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q.row_data[0][i], want[i]) << i;
  for (int i = 32; i < 64; ++i) EXPECT_EQ(q.row_data[0][i], 0x78) << i;
  EXPECT_EQ(q.row_data[0][64], 0x7B);
  EXPECT_EQ(q.row_data[0][65], 0x00);
  std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 96, false, e5);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dq[i], i == 2 ? 1.0f : (i == 3 ? 1.5f : hand[i])) << i;
}

// Columnwise blocks (32 rows of one column) differ from rowwise blocks (32 columns of one row).
// X (32, 64) is all 1 except X[r0][c0] = 448 and X[r1][c1] = -2 at random places (different row,
// different column block). Rowwise codes: 127 for (r0, c0/32), 2 = 2^1 -> 127 - 7 = 120 for
// (r1, c1/32), else amax 1 -> 119. Columnwise codes: 127 for column c0, 120 for column c1, else
// 119. Bytes: at 127, 1 -> 0x38 and 448 -> 0x7E; at 120 (q = 128), 1 -> 0x70 and -2 -> -256 =
// 0xF8; at 119 (q = 256), 1 -> 0x78. BF16 input (all values exact).
TEST(Mxfp8Quantize, ColumnwiseDiffersFromRowwise) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t rows = 32, k = 64;
  const int r0 = std::uniform_int_distribution<int>(0, 31)(rng);
  const int r1 = (r0 + std::uniform_int_distribution<int>(1, 31)(rng)) % 32;
  const int c0 = std::uniform_int_distribution<int>(0, 63)(rng);
  const int c1 = (c0 < 32 ? 32 : 0) + std::uniform_int_distribution<int>(0, 31)(rng);
  std::vector<float> x(rows * k, 1.0f);
  x[r0 * k + c0] = 448.0f;
  x[r1 * k + c1] = -2.0f;
  Mxfp8Config both{DType::kE4M3, true, true, false};
  Quantized q = quantize_checked(single(rows, k, x, DType::kBF16), both);
  auto byte_at = [](int code, float v) -> uint8_t {
    if (code == 127) return v == 448.0f ? 0x7E : 0x38;
    if (code == 120) return v == -2.0f ? 0xF8 : 0x70;
    return 0x78;
  };
  for (int r = 0; r < rows; ++r)
    for (int kb = 0; kb < 2; ++kb) {
      const int want = (r == r0 && kb == c0 / 32) ? 127 : (r == r1 && kb == c1 / 32) ? 120 : 119;
      EXPECT_EQ(q.row_scale[0][r * 2 + kb], want) << r << "," << kb;
      for (int j = 0; j < 32; ++j) {
        const int c = kb * 32 + j;
        EXPECT_EQ(q.row_data[0][r * k + c], byte_at(want, x[r * k + c])) << r << "," << c;
      }
    }
  for (int c = 0; c < k; ++c) {
    const int want = c == c0 ? 127 : c == c1 ? 120 : 119;
    EXPECT_EQ(q.col_scale[0][c], want) << c;
    for (int r = 0; r < rows; ++r)
      EXPECT_EQ(q.col_data[0][r * k + c], byte_at(want, x[r * k + c])) << r << "," << c;
  }
  EXPECT_NE(q.row_data[0], q.col_data[0]);
}

// 2D 32x32 tiles: one code per tile (amax over 1024 elements) written at all 32 rows of the tile
// in row_scale (rows, K/32) and all 32 columns in col_scale (rows/32, K); both data copies are
// the same bytes. Hand tile: a 448 planted in tile (0, 0) whose other values are below 1 gives
// code 127 for the whole tile although the 1x32 block of any other row would get <= 119.
// Random tiles are checked against the FP64 closed form.
TEST(Mxfp8Quantize, TwoDTiles) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t rows = 64, k = 96;
  for (DType el : {DType::kE4M3, DType::kE5M2}) {
    Input in = random_input(rng, DType::kF32, k, {rows});
    std::uniform_real_distribution<float> u(-0.99f, 0.99f);
    for (int r = 0; r < 32; ++r)
      for (int c = 0; c < 32; ++c) in.f32[0][r * k + c] = u(rng);
    const int pr = std::uniform_int_distribution<int>(0, 31)(rng);
    const int pc = std::uniform_int_distribution<int>(0, 31)(rng);
    in.f32[0][pr * k + pc] = el == DType::kE4M3 ? 448.0f : 57344.0f;
    Mxfp8Config cfg{el, true, true, true};
    Quantized q = quantize_checked(in, cfg);
    EXPECT_EQ(q.row_data[0], q.col_data[0]);
    for (int64_t tr = 0; tr < rows / 32; ++tr)
      for (int64_t tc = 0; tc < k / 32; ++tc) {
        double amax = 0.0;
        for (int i = 0; i < 32; ++i)
          for (int j = 0; j < 32; ++j)
            amax = std::max(amax, std::fabs(double(in.at(0, tr * 32 + i, tc * 32 + j))));
        const int code = ref_code(amax, max_norm(el));
        if (tr == 0 && tc == 0) {
          EXPECT_EQ(code, 127);
        }
        for (int i = 0; i < 32; ++i) {
          EXPECT_EQ(q.row_scale[0][(tr * 32 + i) * (k / 32) + tc], code);
          EXPECT_EQ(q.col_scale[0][tr * k + tc * 32 + i], code);
          for (int j = 0; j < 32; ++j) {
            const int64_t r = tr * 32 + i, c = tc * 32 + j;
            ASSERT_EQ(q.row_data[0][r * k + c], ref_elem(in.at(0, r, c), code, el))
                << r << "," << c;
          }
        }
      }
    // Rowwise-only and columnwise-only 2D requests write the same bytes as the combined one.
    Quantized qr = quantize_checked(in, Mxfp8Config{el, true, false, true});
    Quantized qc = quantize_checked(in, Mxfp8Config{el, false, true, true});
    EXPECT_EQ(qr.row_data, q.row_data);
    EXPECT_EQ(qr.row_scale, q.row_scale);
    EXPECT_EQ(qc.col_data, q.col_data);
    EXPECT_EQ(qc.col_scale, q.col_scale);
  }
}

// Random grouped data (uneven groups, an empty one, F32 and BF16, both elements) against the
// FP64 closed form of A.2 and the FP8 codec, rowwise and columnwise.
TEST(Mxfp8Quantize, RandomMatchesClosedFormReference) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (DType dt : {DType::kF32, DType::kBF16})
    for (DType el : {DType::kE4M3, DType::kE5M2}) {
      const int64_t k = 64;
      Input in = random_input(rng, dt, k, {64, 0, 32, 96});
      Quantized q = quantize_checked(in, Mxfp8Config{el, true, true, false});
      for (size_t g = 0; g < in.rows.size(); ++g) {
        const int64_t rows = in.rows[g];
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t kb = 0; kb < k / 32; ++kb) {
            double amax = 0.0;
            for (int j = 0; j < 32; ++j)
              amax = std::max(amax, std::fabs(double(in.at(g, r, kb * 32 + j))));
            const int code = ref_code(amax, max_norm(el));
            ASSERT_EQ(q.row_scale[g][r * (k / 32) + kb], code) << g << "," << r << "," << kb;
            for (int j = 0; j < 32; ++j) {
              const int64_t c = kb * 32 + j;
              ASSERT_EQ(q.row_data[g][r * k + c], ref_elem(in.at(g, r, c), code, el));
            }
          }
        for (int64_t rb = 0; rb < rows / 32; ++rb)
          for (int64_t c = 0; c < k; ++c) {
            double amax = 0.0;
            for (int i = 0; i < 32; ++i)
              amax = std::max(amax, std::fabs(double(in.at(g, rb * 32 + i, c))));
            const int code = ref_code(amax, max_norm(el));
            ASSERT_EQ(q.col_scale[g][rb * k + c], code) << g << "," << rb << "," << c;
            for (int i = 0; i < 32; ++i) {
              const int64_t r = rb * 32 + i;
              ASSERT_EQ(q.col_data[g][r * k + c], ref_elem(in.at(g, r, c), code, el));
            }
          }
      }
    }
}

// Round trip bound. In the scaled domain y = x * 2^(127-code) satisfies |y| <= max_norm (RCEIL),
// so nothing saturates and RNE errs by at most half an ulp: E4M3 (3 mantissa bits) half ulp at
// |y| in [2^e, 2^(e+1)) is 2^(e-4) <= 2^-4 |y| for normals (|y| >= 2^-6) and 2^-10 for
// subnormals; E5M2: 2^-3 |y| and 2^-17. Unscaling by s = 2^(code-127) is exact, so
//   |x - dq| <= max(2^-m |x|, 2^-sub * s),  (m, sub) = (4, 10) for E4M3, (3, 17) for E5M2.
TEST(Mxfp8Quantize, RoundTripErrorBound) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{32, 32}, {64, 96}, {96, 160}};
  for (auto [rows, k] : shapes)
    for (float sigma : {1e-3f, 1.0f, 300.0f})
      for (DType el : {DType::kE4M3, DType::kE5M2}) {
        std::normal_distribution<float> n(0.0f, sigma);
        std::vector<float> x(rows * k);
        for (float& v : x) v = n(rng);
        Quantized q = quantize_checked(single(rows, k, x), Mxfp8Config{el, true, true, false});
        const int m = el == DType::kE4M3 ? 4 : 3;
        const int sub = el == DType::kE4M3 ? 10 : 17;
        for (bool col : {false, true}) {
          const auto& data = col ? q.col_data[0] : q.row_data[0];
          const auto& scale = col ? q.col_scale[0] : q.row_scale[0];
          std::vector<float> dq = dequantize(data, scale, rows, k, col, el);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < k; ++c) {
              const int code = col ? scale[(r / 32) * k + c] : scale[r * (k / 32) + c / 32];
              const double s = std::ldexp(1.0, code - 127);
              const double xv = x[r * k + c];
              const double bound = std::max(std::ldexp(std::fabs(xv), -m), std::ldexp(s, -sub));
              ASSERT_LE(std::fabs(xv - dq[r * k + c]), bound)
                  << "x=" << xv << " dq=" << dq[r * k + c] << " rows=" << rows << " k=" << k;
            }
        }
      }
}

// BF16 dequantization output is the BF16 rounding of the F32 output (exact for normal values).
TEST(Mxfp8Dequantize, Bf16OutputMatchesF32) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  Input in = random_input(rng, DType::kBF16, 64, {32, 64});
  Quantized q = quantize_checked(in, Mxfp8Config{DType::kE4M3, false, true, false});
  Mxfp8Copy c;
  c.columnwise = true;
  c.cols = 64;
  c.rows = in.rows;
  for (size_t g = 0; g < 2; ++g) {
    c.data.push_back(q.col_data[g].data());
    c.scale.push_back(q.col_scale[g].data());
  }
  std::vector<std::vector<float>> f(2);
  std::vector<std::vector<uint16_t>> h(2);
  for (size_t g = 0; g < 2; ++g) {
    f[g].resize(in.rows[g] * 64);
    h[g].resize(in.rows[g] * 64);
  }
  ASSERT_TRUE(dequantize_mxfp8_cpu(c, DType::kF32, {f[0].data(), f[1].data()}).is_ok());
  ASSERT_TRUE(dequantize_mxfp8_cpu(c, DType::kBF16, {h[0].data(), h[1].data()}).is_ok());
  for (size_t g = 0; g < 2; ++g)
    for (size_t i = 0; i < f[g].size(); ++i) ASSERT_EQ(h[g][i], f32_to_bf16(f[g][i]));
}

// ---- packed vs discrete -------------------------------------------------------------------------

// The same (E, N, K) weight as one packed buffer (inputs and outputs carved from single
// allocations) and as E separate allocations: bitwise identical for every option.
// The optional BF16 values of both 1D copies (Mxfp8Outputs::row_bf16 / col_bf16) are each
// code's value e * 2^(scale - 127), computed here in FP64 from the codes and rounded to BF16, for
// random groups (one empty), E4M3 and E5M2, BF16 and F32 input; every byte is written (two fills)
// and the FP8 copies are the same bytes as without the values.
TEST(Mxfp8Quantize, Bf16ValuesOfBothCopies) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (DType el : {DType::kE4M3, DType::kE5M2})
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(std::string(dtype_name(el)) + " from " + std::string(dtype_name(dtype)));
      const std::vector<int64_t> rows = {64, 0, 32};
      const int64_t k = 96;
      const Input in = random_input(rng, dtype, k, rows);
      const Mxfp8Config cfg{el, true, true, false};
      const Quantized plain = quantize(in, cfg);
      std::vector<std::vector<uint16_t>> values[2][2];  // [fill][row, col]
      for (int f = 0; f < 2; ++f) {
        Quantized q;
        for (int64_t r : rows) {
          q.row_data.emplace_back(r * k, 0);
          q.row_scale.emplace_back(r * k / 32, 0);
          q.col_data.emplace_back(r * k, 0);
          q.col_scale.emplace_back(r / 32 * k, 0);
          values[f][0].emplace_back(r * k, f ? 0xFFFF : 0);
          values[f][1].emplace_back(r * k, f ? 0xFFFF : 0);
        }
        Mxfp8Outputs o = q.outputs();
        for (auto& v : values[f][0]) o.row_bf16.push_back(v.data());
        for (auto& v : values[f][1]) o.col_bf16.push_back(v.data());
        const Status st = quantize_mxfp8_cpu(in.view(), cfg, o);
        ASSERT_TRUE(st.is_ok()) << st.message();
        EXPECT_EQ(q.row_data, plain.row_data);
        EXPECT_EQ(q.row_scale, plain.row_scale);
        EXPECT_EQ(q.col_data, plain.col_data);
        EXPECT_EQ(q.col_scale, plain.col_scale);
      }
      EXPECT_EQ(values[0][0], values[1][0]) << "row_bf16 bytes left unwritten";
      EXPECT_EQ(values[0][1], values[1][1]) << "col_bf16 bytes left unwritten";
      // Both copies kept as their values only (no data or scale pointers): the same values.
      std::vector<std::vector<uint16_t>> only[2];
      Mxfp8Outputs vo;
      for (int64_t r : rows) {
        only[0].emplace_back(r * k, 0xFFFF);
        only[1].emplace_back(r * k, 0xFFFF);
        vo.row_bf16.push_back(only[0].back().data());
        vo.col_bf16.push_back(only[1].back().data());
      }
      ASSERT_TRUE(vo.row_values_only() && vo.col_values_only());
      const Status st = quantize_mxfp8_cpu(in.view(), cfg, vo);
      ASSERT_TRUE(st.is_ok()) << st.message();
      EXPECT_EQ(only[0], values[0][0]) << "values-only rowwise copy";
      EXPECT_EQ(only[1], values[0][1]) << "values-only columnwise copy";
      size_t checked = 0;
      for (size_t g = 0; g < rows.size(); ++g)
        for (int64_t r = 0; r < rows[g]; ++r)
          for (int64_t c = 0; c < k; ++c) {
            for (int col = 0; col < 2; ++col) {
              const uint8_t e = (col ? plain.col_data : plain.row_data)[g][r * k + c];
              const uint8_t code =
                  col ? plain.col_scale[g][(r / 32) * k + c] : plain.row_scale[g][r * (k / 32) + c / 32];
              const double ev = el == DType::kE5M2 ? e5m2_to_f32(e) : e4m3_to_f32(e);
              const double want = std::ldexp(ev, static_cast<int>(code) - 127);
              const uint16_t got = values[0][col][g][r * k + c];
              ASSERT_EQ(static_cast<double>(bf16_to_f32(got)), want)
                  << (col ? "col" : "row") << " group " << g << " (" << r << ", " << c << ")";
              ++checked;
            }
          }
      EXPECT_EQ(checked, static_cast<size_t>(2 * 96 * 96));
    }
}

TEST(Mxfp8Quantize, PackedEqualsDiscrete) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t e = 3, n = 64, k = 96;
  for (DType dt : {DType::kF32, DType::kBF16})
    for (DType el : {DType::kE4M3, DType::kE5M2})
      for (auto [row, col, two_d] : {std::tuple{true, false, false}, std::tuple{false, true, false},
                                     std::tuple{true, true, false}, std::tuple{true, true, true},
                                     std::tuple{false, true, true}}) {
        const Mxfp8Config cfg{el, row, col, two_d};
        SCOPED_TRACE(std::string("rowwise ") + (row ? "1" : "0") + " columnwise " +
                     (col ? "1" : "0") + " 2D " + (two_d ? "1" : "0"));
        Input disc = random_input(rng, dt, k, std::vector<int64_t>(e, n));
        // Packed copy of the same values.
        const size_t esz = dtype_bits(dt) / 8;
        std::vector<uint8_t> packed_in(e * n * k * esz);
        for (int64_t g = 0; g < e; ++g)
          std::memcpy(packed_in.data() + g * n * k * esz, disc.view().data[g], n * k * esz);
        GroupedMatrices pin = packed_groups(packed_in.data(), dt, e, n, k);

        std::vector<uint8_t> rd(e * n * k), rs(e * n * k / 32), cd(e * n * k), cs(e * n * k / 32);
        Mxfp8Outputs po;
        if (cfg.rowwise) {
          for (void* p : carve(rd.data(), e, n * k)) po.row_data.push_back(p);
          for (void* p : carve(rs.data(), e, n * k / 32)) po.row_scale.push_back(p);
        }
        if (cfg.columnwise) {
          for (void* p : carve(cd.data(), e, n * k)) po.col_data.push_back(p);
          for (void* p : carve(cs.data(), e, n * k / 32)) po.col_scale.push_back(p);
        }
        ASSERT_TRUE(quantize_mxfp8_cpu(pin, cfg, po).is_ok());
        Quantized q = quantize_checked(disc, cfg);
        for (int64_t g = 0; g < e; ++g) {
          if (cfg.rowwise) {
            EXPECT_EQ(0, std::memcmp(rd.data() + g * n * k, q.row_data[g].data(), n * k));
            EXPECT_EQ(0,
                      std::memcmp(rs.data() + g * n * k / 32, q.row_scale[g].data(), n * k / 32));
          }
          if (cfg.columnwise) {
            EXPECT_EQ(0, std::memcmp(cd.data() + g * n * k, q.col_data[g].data(), n * k));
            EXPECT_EQ(0,
                      std::memcmp(cs.data() + g * n * k / 32, q.col_scale[g].data(), n * k / 32));
          }
        }
      }
}

// ---- validation ---------------------------------------------------------------------------------

// Every bad request returns an error naming the problem and writes nothing.
TEST(Mxfp8Validate, BadRequestsFailWithoutTouchingMemory) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  Input in = random_input(rng, DType::kF32, 64, {32, 64});
  std::vector<uint8_t> sentinel(64 * 64, 0xC3);
  std::vector<std::vector<uint8_t>> bufs(8, sentinel);
  auto outputs = [&](bool row, bool col) {
    Mxfp8Outputs o;
    if (row) {
      o.row_data = {bufs[0].data(), bufs[1].data()};
      o.row_scale = {bufs[2].data(), bufs[3].data()};
    }
    if (col) {
      o.col_data = {bufs[4].data(), bufs[5].data()};
      o.col_scale = {bufs[6].data(), bufs[7].data()};
    }
    return o;
  };
  struct Case {
    const char* name;
    GroupedMatrices in;
    Mxfp8Config cfg;
    Mxfp8Outputs out;
    const char* needle;  // expected in the message
  };
  std::vector<Case> cases;
  const GroupedMatrices good = in.view();
  {
    GroupedMatrices g = good;
    g.cols = 48;  // not a multiple of 32
    cases.push_back({"K % 32", g, rowwise(), outputs(true, false), "multiple of 32"});
    cases.push_back({"K % 32 (2D)", g, Mxfp8Config{DType::kE4M3, false, true, true},
                     outputs(false, true), "multiple of 32"});
  }
  {
    GroupedMatrices g = good;
    g.rows = {32, 48};
    cases.push_back({"rows % 32", g, colwise(), outputs(false, true), "rows"});
    cases.push_back({"rows % 32 (2D)", g, Mxfp8Config{DType::kE4M3, true, false, true},
                     outputs(true, false), "rows"});
  }
  {
    GroupedMatrices g = good;
    g.rows = {0, 0};
    cases.push_back({"empty", g, rowwise(), outputs(true, false), "empty"});
    GroupedMatrices none;
    none.dtype = DType::kF32;
    none.cols = 64;
    cases.push_back({"no groups", none, rowwise(), Mxfp8Outputs{}, "no groups"});
  }
  {
    GroupedMatrices g = good;
    g.dtype = DType::kE4M3;
    cases.push_back({"input dtype", g, rowwise(), outputs(true, false), "f32 or bf16"});
  }
  cases.push_back(
      {"element dtype", good, rowwise(DType::kBF16), outputs(true, false), "e4m3 or e5m2"});
  cases.push_back({"no copy", good, Mxfp8Config{DType::kE4M3, false, false, false}, Mxfp8Outputs{},
                   "at least one"});
  {
    Mxfp8Outputs o = outputs(true, false);
    o.row_scale.clear();
    cases.push_back({"missing scale pointers", good, rowwise(), o, "row_scale"});
    o = outputs(false, true);
    o.col_data[1] = nullptr;
    cases.push_back({"null pointer", good, colwise(), o, "null"});
    o = outputs(true, false);
    cases.push_back({"pointers of an unrequested copy", good, colwise(), o, "not requested"});
    GroupedMatrices g = good;
    g.data[0] = nullptr;
    cases.push_back({"null input", g, rowwise(), outputs(true, false), "no data"});
    o = outputs(true, false);
    o.row_bf16 = {bufs[4].data(), bufs[5].data()};
    cases.push_back({"2D with BF16 values", good, Mxfp8Config{DType::kE4M3, true, false, true}, o,
                     "1D copies"});
    o = outputs(true, false);
    o.col_bf16 = {bufs[4].data(), bufs[5].data()};
    cases.push_back({"col_bf16 without the columnwise copy", good, rowwise(), o, "col_bf16"});
    o.col_bf16.clear();
    o.row_bf16 = {bufs[4].data()};
    cases.push_back({"row_bf16 pointer count", good, rowwise(), o, "row_bf16"});
    o = outputs(true, false);
    o.row_scale.clear();
    o.row_bf16 = {bufs[4].data(), bufs[5].data()};
    cases.push_back({"values with data but no scales", good, rowwise(), o, "row_scale"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Status v = validate_mxfp8(c.in, c.cfg, c.out);
    const Status s = quantize_mxfp8_cpu(c.in, c.cfg, c.out);
    EXPECT_FALSE(v.is_ok());
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.message(), v.message());
    EXPECT_NE(s.message().find("quantize_mxfp8"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.message();
    for (const auto& b : bufs) ASSERT_EQ(b, sentinel) << "memory touched";
  }

  // Dequantization copies.
  std::vector<float> out(64 * 64, 1.5f);
  const std::vector<float> out_sentinel = out;
  Mxfp8Copy c;
  c.cols = 64;
  c.rows = {64};
  c.data = {bufs[0].data()};
  c.scale = {bufs[2].data()};
  ASSERT_TRUE(validate_mxfp8_copy(c, DType::kF32, {out.data()}).is_ok());
  struct CopyCase {
    const char* name;
    Mxfp8Copy q;
    DType out_dtype;
    std::vector<void*> outs;
  };
  std::vector<CopyCase> cc;
  Mxfp8Copy bad = c;
  bad.cols = 40;
  cc.push_back({"K % 32", bad, DType::kF32, {out.data()}});
  bad = c;
  bad.columnwise = true;
  bad.rows = {48};
  cc.push_back({"rows % 32", bad, DType::kF32, {out.data()}});
  bad = c;
  bad.element = DType::kE2M1;
  cc.push_back({"element", bad, DType::kF32, {out.data()}});
  cc.push_back({"out dtype", c, DType::kE4M3, {out.data()}});
  cc.push_back({"missing out", c, DType::kF32, {}});
  bad = c;
  bad.rows = {0};
  cc.push_back({"empty", bad, DType::kF32, {out.data()}});
  bad = c;
  bad.scale = {nullptr};
  cc.push_back({"null scale", bad, DType::kF32, {out.data()}});
  for (const CopyCase& k : cc) {
    SCOPED_TRACE(k.name);
    const Status s = dequantize_mxfp8_cpu(k.q, k.out_dtype, k.outs);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("dequantize_mxfp8"), std::string::npos) << s.message();
    EXPECT_EQ(out, out_sentinel) << "memory touched";
  }
}

}  // namespace
}  // namespace packmoe
