// NVFP4 quantizer (formats/nvfp4.{h,cpp}, formats/nvfp4_math.h) against values derived by hand in
// the comments from reference B.2-B.7: per-tensor and block scales, E2M1 codes and ties, packing,
// the transposed columnwise layout, 2D tiles, the RHT, stochastic rounding and its block
// numbering; plus error bounds, packed vs discrete bitwise identity and validation errors.
// Random inputs use a fresh seed, printed on failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/philox.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t fresh_seed() { return std::random_device{}(); }
#define RANDOM_SEED(name)             \
  const uint32_t name = fresh_seed(); \
  SCOPED_TRACE("random seed " + std::to_string(name))

// E2M1 magnitudes of codes 0..7 (B.2); codes 8..15 are the negatives.
constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
float grid_value(uint8_t code) { return (code & 8 ? -1.0f : 1.0f) * kGrid[code & 7]; }

// ---- harness --------------------------------------------------------------------------------

struct Input {
  DType dtype = DType::kF32;
  int64_t k = 0;
  std::vector<int64_t> rows;
  std::vector<std::vector<float>> f32;  // per group (rows_g, K), BF16-exact when dtype is BF16
  std::vector<std::vector<uint16_t>> bf16;

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
                 std::vector<std::vector<float>> values) {
  Input in;
  in.dtype = dtype;
  in.k = k;
  in.rows = std::move(rows);
  in.f32 = std::move(values);
  if (dtype == DType::kBF16) {
    in.bf16.resize(in.f32.size());
    for (size_t g = 0; g < in.f32.size(); ++g)
      for (float& v : in.f32[g]) {
        in.bf16[g].push_back(f32_to_bf16(v));
        v = bf16_to_f32(in.bf16[g].back());
      }
  }
  return in;
}

Input single(int64_t rows, int64_t k, std::vector<float> x, DType dtype = DType::kF32) {
  return make_input(dtype, k, {rows}, {std::move(x)});
}

// Normal values with a random per-row scale, so groups and blocks see different amaxes.
Input random_input(std::mt19937& rng, DType dtype, int64_t k, std::vector<int64_t> rows,
                   float sigma = 1.0f) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_scale(0.25f, 4.0f);
  std::vector<std::vector<float>> values;
  for (int64_t r : rows) {
    std::vector<float> v(r * k);
    for (int64_t i = 0; i < r; ++i) {
      const float s = sigma * row_scale(rng);
      for (int64_t c = 0; c < k; ++c) v[i * k + c] = normal(rng) * s;
    }
    values.push_back(std::move(v));
  }
  return make_input(dtype, k, std::move(rows), std::move(values));
}

struct Quantized {
  std::vector<std::vector<uint8_t>> row_data, row_scale, col_data, col_scale;
  std::vector<float> row_amax, col_amax;

  Nvfp4Outputs outputs() {
    Nvfp4Outputs o;
    for (auto& v : row_data) o.row_data.push_back(v.data());
    for (auto& v : row_scale) o.row_scale.push_back(v.data());
    for (auto& v : col_data) o.col_data.push_back(v.data());
    for (auto& v : col_scale) o.col_scale.push_back(v.data());
    o.row_amax = row_amax.empty() ? nullptr : row_amax.data();
    o.col_amax = col_amax.empty() ? nullptr : col_amax.data();
    return o;
  }
};

Quantized quantize(const Input& in, const Nvfp4Config& cfg, uint8_t fill = 0xA5) {
  Quantized q;
  const int64_t k = in.k;
  for (int64_t r : in.rows) {
    if (cfg.rowwise) {
      q.row_data.emplace_back(r * k / 2, fill);
      q.row_scale.emplace_back(r * k / 16, fill);
    }
    if (cfg.columnwise) {
      q.col_data.emplace_back(k * r / 2, fill);
      q.col_scale.emplace_back(k * r / 16, fill);
    }
  }
  if (cfg.rowwise) q.row_amax.assign(in.rows.size(), -1.0f);
  if (cfg.columnwise) q.col_amax.assign(in.rows.size(), -1.0f);
  const Status st = quantize_nvfp4_cpu(in.view(), cfg, q.outputs());
  EXPECT_TRUE(st.is_ok()) << st.message();
  return q;
}

// Two different pre-fills agreeing proves every output byte is written.
Quantized quantize_checked(const Input& in, const Nvfp4Config& cfg) {
  Quantized a = quantize(in, cfg, 0x00);
  Quantized b = quantize(in, cfg, 0xFF);
  EXPECT_EQ(a.row_data, b.row_data) << "rowwise data bytes left unwritten";
  EXPECT_EQ(a.row_scale, b.row_scale) << "rowwise scale bytes left unwritten";
  EXPECT_EQ(a.col_data, b.col_data) << "columnwise data bytes left unwritten";
  EXPECT_EQ(a.col_scale, b.col_scale) << "columnwise scale bytes left unwritten";
  return a;
}

Nvfp4Config cfg_of(bool row, bool col, bool two_d = false, bool rht = false, bool sr = false,
                   uint64_t seed = 0, uint64_t offset = 0) {
  Nvfp4Config c;
  c.rowwise = row;
  c.columnwise = col;
  c.two_d = two_d;
  c.rht = rht;
  c.stochastic_rounding = sr;
  c.seed = seed;
  c.offset = offset;
  return c;
}

// Code of element i of a packed row: element 2j in the low nibble of byte j.
uint8_t nibble(const std::vector<uint8_t>& data, int64_t row_bytes, int64_t r, int64_t i) {
  const uint8_t b = data[r * row_bytes + i / 2];
  return (i % 2) ? (b >> 4) : (b & 0xF);
}

std::vector<float> dequantize(const std::vector<uint8_t>& data, const std::vector<uint8_t>& scale,
                              int64_t rows, int64_t cols, float decode_scale,
                              DType out_dtype = DType::kF32) {
  std::vector<float> out(rows * cols);
  std::vector<uint16_t> out16(rows * cols);
  Nvfp4Copy c;
  c.cols = cols;
  c.rows = {rows};
  c.data = {data.data()};
  c.scale = {scale.data()};
  c.decode_scale = &decode_scale;
  void* dst = out_dtype == DType::kF32 ? static_cast<void*>(out.data()) : out16.data();
  const Status st = dequantize_nvfp4_cpu(c, out_dtype, {dst});
  EXPECT_TRUE(st.is_ok()) << st.message();
  if (out_dtype == DType::kBF16)
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(out16[i]);
  return out;
}

// Transpose-and-RHT of one (rows, K) group as the columnwise copy sees it: (K, rows).
std::vector<float> columnwise_values(const Input& in, size_t g, bool rht) {
  const int64_t rows = in.rows[g], k = in.k;
  std::vector<float> t(k * rows);
  for (int64_t c = 0; c < k; ++c)
    for (int64_t rb = 0; rb < rows / 16; ++rb) {
      float v[16], o[16];
      for (int i = 0; i < 16; ++i) v[i] = in.at(g, rb * 16 + i, c);
      if (rht)
        rht16(v, o);
      else
        std::copy(v, v + 16, o);
      for (int i = 0; i < 16; ++i) t[c * rows + rb * 16 + i] = o[i];
    }
  return t;
}

// ---- per-block math, hand-derived -----------------------------------------------------------

TEST(Nvfp4Math, EncodeAndDecodeScale) {
  // S_enc = 2688 / amax (B.3): 2688 -> 1; 1 -> 2688; 7 -> 384 (exact); 3 -> 896; 2^-100 ->
  // 2688 * 2^100 (exact power-of-two scaling).
  EXPECT_EQ(nvfp4_encode_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(1.0f), 2688.0f);
  EXPECT_EQ(nvfp4_encode_scale(7.0f), 384.0f);
  EXPECT_EQ(nvfp4_encode_scale(3.0f), 896.0f);
  EXPECT_EQ(nvfp4_encode_scale(std::ldexp(1.0f, -100)), std::ldexp(2688.0f, 100));
  // amax 0: 2688/0 = Inf -> FLT_MAX, then amax == 0 -> 1. amax Inf: S_enc = 0 -> 1. A tiny amax
  // (1e-40, FP32 subnormal): 2688/1e-40 overflows to Inf -> FLT_MAX (kept: amax != 0).
  EXPECT_EQ(nvfp4_encode_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(kInf), 1.0f);
  EXPECT_EQ(nvfp4_encode_scale(1e-40f), FLT_MAX);
  // S_dec = float(1 / double(S_enc)): 2688 -> 1; 0 and Inf -> 1; 7 -> float(1/384) (= 7/2688 up to
  // FP32 rounding); FLT_MAX S_enc -> 1/FLT_MAX = 2^-128 (1 + 2^-24 + ...), whose excess 2^-152 is
  // below half the subnormal spacing 2^-149, so exactly 2^-128.
  EXPECT_EQ(nvfp4_decode_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_decode_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_decode_scale(kInf), 1.0f);
  EXPECT_EQ(nvfp4_decode_scale(7.0f), static_cast<float>(1.0 / 384.0));
  EXPECT_EQ(nvfp4_decode_scale(1e-40f), std::ldexp(1.0f, -128));
  // It equals amax / 2688 up to one FP32 rounding for ordinary amax.
  for (float a : {1.0f, 3.0f, 0.001f, 5000.0f, 123.456f})
    EXPECT_NEAR(nvfp4_decode_scale(a), a / 2688.0, a / 2688.0 * 1.2e-7) << a;
}

TEST(Nvfp4Math, BlockScale) {
  // fp32(1/6) = 2^-3 (1 + 0x2AAAAB / 2^23) is 2^-25 / 6 above 1/6 in absolute terms, so
  // 6 * fp32(1/6) = 1 + 2^-25 exactly, which rounds to 1.0 in FP32.
  EXPECT_EQ(f32_bits(kOneSixth), 0x3E2AAAABu);
  // S_enc 1, block amax 6: 6 * (1 * fp32(1/6)) -> 1.0 -> E4M3 0x38 (e=7).
  EXPECT_EQ(nvfp4_block_scale(6.0f, 1.0f), 0x38);
  // Block amax 2688 (= the tensor amax): 448 (1 + 2^-25) -> 448 -> 0x7E.
  EXPECT_EQ(nvfp4_block_scale(2688.0f, 1.0f), 0x7E);
  // S_enc 384 (amax 7): 384 * fp32(1/6) = 64 (1 + 2^-25) -> 64. Block amax 7 -> 448 = 0x7E;
  // 3.5 -> 224 = 0x76 (e=14, m=6); 1 -> 64 = 0x68 (e=13).
  EXPECT_EQ(nvfp4_block_scale(7.0f, 384.0f), 0x7E);
  EXPECT_EQ(nvfp4_block_scale(3.5f, 384.0f), 0x76);
  EXPECT_EQ(nvfp4_block_scale(1.0f, 384.0f), 0x68);
  // E4M3 RNE on the scale: 6.375 -> 1.0625 -> tie between 1 (m=0) and 1.125 (m=1) -> 0x38;
  // 7.125 -> 1.1875 -> tie between m=1 and m=2 -> 0x3A.
  EXPECT_EQ(nvfp4_block_scale(6.375f, 1.0f), 0x38);
  EXPECT_EQ(nvfp4_block_scale(7.125f, 1.0f), 0x3A);
  // E4M3 subnormal scale: 6 * 2^-9 -> 2^-9 -> 0x01; 0 -> 0x00.
  EXPECT_EQ(nvfp4_block_scale(std::ldexp(6.0f, -9), 1.0f), 0x01);
  EXPECT_EQ(nvfp4_block_scale(0.0f, 1.0f), 0x00);
  // Order of the products (found by a search, intermediates printed in FP32 hex): amax A =
  // 0x1.92eec4p-5 gives S_enc = 2688/A = 0x1.aaf322p+15 and S_enc * fp32(1/6) = 0x1.1ca218p+13;
  // block amax a = 0x1.be1aap-14 times that is exactly 0x1.fp-1 = 0.96875, the E4M3 tie between
  // 0.9375 (0x37, odd) and 1.0 (0x38, even) -> 0x38. The other order, (a * S_enc) * fp32(1/6) =
  // 0x1.73fffep+2 * fp32(1/6) = 0x1.effffep-1, falls just below the tie and would give 0x37.
  EXPECT_EQ(nvfp4_encode_scale(0x1.92eec4p-5f), 0x1.aaf322p+15f);
  EXPECT_EQ(nvfp4_block_scale(0x1.be1aap-14f, 0x1.aaf322p+15f), 0x38);
  // Saturation at 448: 3000 * fp32(1/6) = 500 -> 0x7E; Inf -> 0x7E.
  EXPECT_EQ(nvfp4_block_scale(3000.0f, 1.0f), 0x7E);
  EXPECT_EQ(nvfp4_block_scale(kInf, 1.0f), 0x7E);
}

TEST(Nvfp4Math, BlockReciprocalEncodeDecode) {
  // r_b = min(1 / (s_b * S_dec), FLT_MAX): s_b 1.0 -> 1; 448 -> fp32(1/448) = 0x3B124925; 2^-9
  // (code 0x01) -> 512; code 0 -> 1/0 -> FLT_MAX. 448 * fp32(1/448) = 1 + (3/8) 2^-23 -> 1.0, so
  // s_b 448 with S_dec = fp32(1/448) gives r_b = 1.
  EXPECT_EQ(nvfp4_block_rcp(0x38, 1.0f), 1.0f);
  EXPECT_EQ(f32_bits(nvfp4_block_rcp(0x7E, 1.0f)), 0x3B124925u);
  EXPECT_EQ(nvfp4_block_rcp(0x01, 1.0f), 512.0f);
  EXPECT_EQ(nvfp4_block_rcp(0x00, 1.0f), FLT_MAX);
  EXPECT_EQ(nvfp4_block_rcp(0x7E, f32_from_bits(0x3B124925u)), 1.0f);
  // E2M1 RNE at r = 1 (B.3 thresholds): grid values map to codes 0..7; ties 0.25 -> 0, 0.75 -> 1
  // (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6); beyond 6
  // saturates; NaN -> 0x7 (+6); -0.25 -> -0 (code 8).
  for (uint8_t c = 0; c < 8; ++c) EXPECT_EQ(nvfp4_encode(kGrid[c], 1.0f), c);
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 7.0f, -7.0f, -0.25f};
  const uint8_t want[] = {0, 2, 2, 4, 4, 6, 6, 7, 15, 8};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(nvfp4_encode(ties[i], 1.0f), want[i]) << ties[i];
  EXPECT_EQ(nvfp4_encode(kNaN, 1.0f), 0x7);
  EXPECT_EQ(nvfp4_encode(1.5f, 2.0f), 5);  // 3
  // Decode: (e2m1 * e4m3) * S_dec. 6 * 448 * 1 = 2688; -6 * 1 * 0.5 = -3; 0.5 * 2^-9 * 1 = 2^-10.
  EXPECT_EQ(nvfp4_decode(7, 0x7E, 1.0f), 2688.0f);
  EXPECT_EQ(nvfp4_decode(15, 0x38, 0.5f), -3.0f);
  EXPECT_EQ(nvfp4_decode(1, 0x01, 1.0f), std::ldexp(1.0f, -10));
}

TEST(Nvfp4Math, SrByteOrder) {
  // Byte j is byte j % 4 (least significant first) of word j / 4.
  const Philox4 d{{0x03020100u, 0x07060504u, 0x0B0A0908u, 0x0F0E0D0Cu}};
  for (int j = 0; j < 16; ++j) EXPECT_EQ(nvfp4_sr_byte(d, j), j);
}

// ---- RHT
// ------------------------------------------------------------------------------------------

// Sylvester's construction H_1 = [1], H_2n = [[H, H], [H, -H]], built here independently of the
// popcount formula in rht16.
std::vector<std::vector<int>> sylvester16() {
  std::vector<std::vector<int>> h{{1}};
  while (h.size() < 16) {
    const size_t n = h.size();
    std::vector<std::vector<int>> n2(2 * n, std::vector<int>(2 * n));
    for (size_t i = 0; i < n; ++i)
      for (size_t j = 0; j < n; ++j) {
        n2[i][j] = n2[i][j + n] = n2[i + n][j] = h[i][j];
        n2[i + n][j + n] = -h[i][j];
      }
    h = std::move(n2);
  }
  return h;
}

constexpr int kSign[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};  // B.6

TEST(Nvfp4Rht, SignMaskMatchesTheSignVector) {
  // Bits 3, 5, 6, 7, 8, 9, 10, 12, 14, 15 -> 0x00E8 + 0x0700 + 0xD000 = 0xD7E8.
  uint16_t mask = 0;
  for (int i = 0; i < 16; ++i)
    if (kSign[i] < 0) mask |= static_cast<uint16_t>(1u << i);
  EXPECT_EQ(mask, 0xD7E8);
  EXPECT_EQ(kRhtSignMask, 0xD7E8);
}

TEST(Nvfp4Rht, UnitVectors) {
  // e_i @ R = row i of R: out_j = s_i * H[i][j] / 4 = +-0.25. e_0: s_0 = 1 and H[0][j] = 1, so
  // 0.25 everywhere.
  const auto h = sylvester16();
  for (int i = 0; i < 16; ++i) {
    float in[16] = {}, out[16];
    in[i] = 1.0f;
    rht16(in, out);
    for (int j = 0; j < 16; ++j) EXPECT_EQ(out[j], 0.25f * kSign[i] * h[i][j]) << i << "," << j;
  }
  float e0[16] = {1.0f}, out[16];
  rht16(e0, out);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(out[j], 0.25f);
}

TEST(Nvfp4Rht, ConstantVector) {
  // x = c * ones: out_j = c/4 * sum_i s_i H[i][j] = c/4 * (H s)_j. (H s)_0 = sum s_i = 6 - 10 = -4.
  // The whole Walsh spectrum of s, (H s)_j = #{i: s_i H[i][j] = +1} - #{i: ... = -1}:
  //   j:      0  1  2  3  4  5   6  7  8  9  10 11 12 13 14  15
  //   (Hs)_j: -4 0  4  0  4  0  -4  0  4  8  4  0  4  0  4  -8
  // so for c = 2: out_j = (Hs)_j / 2.
  const int hs[16] = {-4, 0, 4, 0, 4, 0, -4, 0, 4, 8, 4, 0, 4, 0, 4, -8};
  const auto h = sylvester16();
  for (int j = 0; j < 16; ++j) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += kSign[i] * h[i][j];
    EXPECT_EQ(sum, hs[j]) << j;
  }
  float in[16], out[16];
  std::fill(in, in + 16, 2.0f);
  rht16(in, out);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(out[j], hs[j] / 2.0f) << j;
}

TEST(Nvfp4Rht, Bf16RoundingOfInputAndOutput) {
  // Input rounding: 1 + 2^-8 + 2^-20 is above the BF16 midpoint 1 + 2^-8 -> 1 + 2^-7, so e_0
  // scaled by it gives (1 + 2^-7) / 4 = 0.25 + 2^-9 everywhere (a BF16 value).
  float in[16] = {1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)}, out[16];
  rht16(in, out);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(out[j], 0.25f + std::ldexp(1.0f, -9)) << j;
  // Output rounding: v = (1, 2^-8, 0, ...). s_1 = +1, H[1][j] = (-1)^(j&1), so the FP32 sum is
  // 1 + 2^-8 (even j) or 1 - 2^-8 (odd j); times 1/4: 0.25 + 2^-10 is a BF16 tie (spacing 2^-9
  // above 0.25) -> even -> 0.25; 0.25 - 2^-10 is a BF16 value (spacing 2^-10 below 0.25).
  float in2[16] = {1.0f, std::ldexp(1.0f, -8)};
  rht16(in2, out);
  for (int j = 0; j < 16; ++j)
    EXPECT_EQ(out[j], (j % 2) ? 0.25f - std::ldexp(1.0f, -10) : 0.25f) << j;
}

TEST(Nvfp4Rht, ButterfliesInFp32InTheirOrder) {
  // packmoe's definition: the signs, then butterfly stages h = 1, 2, 4, 8 in FP32. v = (2^24, 1, 1,
  // -1, -2^24, 0, ...), so after the signs (s_3 = -1) w = (2^24, 1, 1, 1, -2^24, 0, ...). Output 0
  // (all H[i][0] = 1): stage 1 gives w_0 = 2^24 + 1 -> 2^24 (FP32 spacing 2 above 2^24, tie to
  // even) and w_2 = 1 + 1 = 2; stage 2 w_0 = 2^24 + 2 (exact); stage 4 w_0 = 2^24 + 2 - 2^24 = 2;
  // times 1/4 -> 0.5. The exact sum 3 would give 0.75, the sum in index order 0 (2^24 + 1 + 1 + 1
  // stays 2^24).
  float in[16] = {std::ldexp(1.0f, 24), 1.0f, 1.0f, -1.0f, -std::ldexp(1.0f, 24)}, out[16];
  rht16(in, out);
  EXPECT_EQ(out[0], 0.5f);
}

TEST(Nvfp4Rht, ExactZeroIsPositive) {
  // From sixteen -0 inputs the butterflies leave -0 in output 14 (w_i = -0 where s_i = +1, and
  // e.g. -0 + -0 = -0); the definition turns every exact zero into +0.
  for (float z : {0.0f, -0.0f}) {
    float in[16], out[16];
    std::fill(in, in + 16, z);
    rht16(in, out);
    for (int j = 0; j < 16; ++j) EXPECT_EQ(std::bit_cast<uint32_t>(out[j]), 0u) << z << " " << j;
  }
}

TEST(Nvfp4Rht, ExactWhereFp32HoldsEverySum) {
  // BF16 inputs of magnitude 2^-4 .. 2^4 (8 significant bits): every partial sum of up to 16 of
  // them is a multiple of 2^-11 below 2^9, which FP32 holds exactly, so each output must be the
  // exact FP64 product with the matrix built by sylvester16, times 1/4, rounded to BF16.
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expo(-4, 3), mant(0, 127), sign(0, 1);
  const auto h = sylvester16();
  for (int t = 0; t < 1000; ++t) {
    float in[16], out[16];
    for (float& v : in)
      v = (sign(rng) ? -1.0f : 1.0f) * std::ldexp(1.0f + mant(rng) / 128.0f, expo(rng));
    rht16(in, out);
    for (int j = 0; j < 16; ++j) {
      double y = 0.0;
      for (int i = 0; i < 16; ++i) y += static_cast<double>(kSign[i] * h[i][j]) * in[i];
      const float want = bf16_to_f32(f32_to_bf16(static_cast<float>(y / 4.0)));
      ASSERT_EQ(std::bit_cast<uint32_t>(out[j]), std::bit_cast<uint32_t>(want)) << t << " " << j;
    }
  }
}

TEST(Nvfp4Rht, OrthogonalOnRandomVectors) {
  // R R^T = diag(s) H H^T diag(s) / 16 = I, so ||x R|| = ||x|| up to the BF16 roundings (relative
  // 2^-9 per value).
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int t = 0; t < 100; ++t) {
    float in[16], out[16];
    double n_in = 0.0, n_out = 0.0;
    for (float& v : in) v = bf16_to_f32(f32_to_bf16(n(rng)));
    rht16(in, out);
    for (int i = 0; i < 16; ++i) {
      n_in += double(in[i]) * in[i];
      n_out += double(out[i]) * out[i];
      EXPECT_EQ(out[i], bf16_to_f32(f32_to_bf16(out[i])));  // outputs are BF16 values
    }
    EXPECT_NEAR(std::sqrt(n_out), std::sqrt(n_in), std::sqrt(n_in) * 0.01);
  }
}

// ---- quantizer: hand-derived bytes
// ----------------------------------------------------------------

// One row, K = 64, four 16-blocks (positions shuffled randomly inside each block). The tensor
// amax is 2688 (block 1), so S_enc = 1 and S_dec = 1.
//  block 0, amax 6: s_b = 0x38 (1.0), r_b = 1, codes = E2M1 RNE of x (grid values and ties).
//  block 1, amax 2688: s_b = 0x7E (448), r_b = fp32(1/448) = (1/448)(1 + (3/8) 2^-23). Elements
//   are 448 * m, so x * r_b = m (1 + (3/8) 2^-23) before FP32 rounding: grid m land on their
//   codes; m = 2.5 is 0.47 ulp above 2.5 -> rounds to 2.5 -> tie -> 2 (code 4); m = 5 likewise
//   -> 4 (code 6); m = 0.25 -> 0.25 -> tie -> 0; m = 0.75 -> 0.75 + 2^-24 -> 1 (code 2).
//  block 2, amax 6 * 2^-9: s_b = E4M3 subnormal 0x01 (2^-9), r_b = 512 (exact scaling).
//  block 3, all zero: s_b = 0, r_b = FLT_MAX, codes 0.
TEST(Nvfp4Quantize, RowwiseHandBlocks) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const float b0[16] = {0,     0.5f,  1,     1.5f,  2,    3,    4, 6,
                        0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -6};
  const uint8_t c0[16] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 4, 4, 6, 6, 15};
  const float m1[16] = {6, 4, 3, 2, 1.5f, 1, 0.5f, 0, -3, 2.5f, 5, 0.25f, 0.75f, -6, -0.5f, 1};
  const uint8_t c1[16] = {7, 6, 5, 4, 3, 2, 1, 0, 13, 4, 6, 0, 2, 15, 9, 2};
  const float m2[16] = {6, 3, 0.5f, -1, 0.25f, 1.5f, 2, 5, 0, 0, 0, 0, 0, 0, 0, 0};
  const uint8_t c2[16] = {7, 5, 1, 10, 0, 3, 4, 6, 0, 0, 0, 0, 0, 0, 0, 0};
  std::vector<float> x(64, 0.0f);
  std::vector<uint8_t> want(64, 0);
  for (int blk = 0; blk < 3; ++blk) {
    std::vector<int> perm(16);
    for (int i = 0; i < 16; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < 16; ++i) {
      const int p = blk * 16 + perm[i];
      x[p] = blk == 0 ? b0[i] : blk == 1 ? 448.0f * m1[i] : std::ldexp(m2[i], -9);
      want[p] = blk == 0 ? c0[i] : blk == 1 ? c1[i] : c2[i];
    }
  }
  for (DType dt : {DType::kF32, DType::kBF16}) {  // every value is BF16-exact
    SCOPED_TRACE(dt == DType::kF32 ? "f32" : "bf16");
    Quantized q = quantize_checked(single(1, 64, x, dt), cfg_of(true, false));
    EXPECT_EQ(q.row_amax[0], 2688.0f);
    EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{0x38, 0x7E, 0x01, 0x00}));
    for (int i = 0; i < 64; ++i) EXPECT_EQ(nibble(q.row_data[0], 32, 0, i), want[i]) << i;
    // Packing: byte j = code(2j) | code(2j+1) << 4.
    for (int j = 0; j < 32; ++j)
      EXPECT_EQ(q.row_data[0][j], want[2 * j] | (want[2 * j + 1] << 4)) << j;
    // Dequantize with S_dec = decode_scale(2688) = 1: grid value * s_b.
    std::vector<float> dq = dequantize(q.row_data[0], q.row_scale[0], 1, 64, 1.0f);
    const float sb[4] = {1.0f, 448.0f, std::ldexp(1.0f, -9), 0.0f};
    for (int i = 0; i < 64; ++i) EXPECT_EQ(dq[i], grid_value(want[i]) * sb[i / 16]) << i;
  }
}

// Fixed packing order of a hand block: codes 0..15 in element order pack to 0x10, 0x32, ...
TEST(Nvfp4Quantize, NibbleOrder) {
  // Element i = grid_value(i) with amax 6: S_enc = 2688/6 = 448, s_b = e4m3(6 * fp32(448/6)) =
  // e4m3(448.00003) = 0x7E, S_dec = fp32(1/448), r_b = 1/(448 fp32(1/448)) = 1/1 = 1: code i.
  // Code 8 is -0: -0 * 1 = -0 -> code 8.
  std::vector<float> x(16);
  for (int i = 0; i < 16; ++i) x[i] = grid_value(static_cast<uint8_t>(i));
  Quantized q = quantize_checked(single(1, 16, x), cfg_of(true, false));
  EXPECT_EQ(q.row_data[0], (std::vector<uint8_t>{0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE}));
  EXPECT_EQ(q.row_scale[0], std::vector<uint8_t>{0x7E});
  EXPECT_EQ(q.row_amax[0], 6.0f);
}

// All-zero tensor: amax 0 -> S_enc = 1, all block scales 0, all codes 0, dequantized 0.
TEST(Nvfp4Quantize, ZeroTensor) {
  Quantized q =
      quantize_checked(single(16, 32, std::vector<float>(16 * 32, 0.0f)), cfg_of(true, true));
  EXPECT_EQ(q.row_amax[0], 0.0f);
  EXPECT_EQ(q.col_amax[0], 0.0f);
  for (const auto* v : {&q.row_data[0], &q.row_scale[0], &q.col_data[0], &q.col_scale[0]})
    for (uint8_t b : *v) EXPECT_EQ(b, 0);
  for (float d : dequantize(q.row_data[0], q.row_scale[0], 16, 32, nvfp4_decode_scale(0.0f)))
    EXPECT_EQ(d, 0.0f);
}

// Inf and NaN (B.3 satfinite): the tensor amax ignores NaN and is Inf -> S_enc = 2688/Inf = 0 ->
// 1, S_dec = 1. Block 0 has amax Inf -> s_b = e4m3(Inf) = 448 (0x7E, saturated), r_b =
// fp32(1/448): Inf -> 6 (code 7), -Inf -> 15, NaN -> 7, 448 -> 1 (2), -896 -> -2 (12), 1 ->
// 0.0022 -> 0. Block 1 (amax 6): s_b = 0x38, codes = E2M1 of x.
TEST(Nvfp4Quantize, InfAndNan) {
  std::vector<float> x(32, 0.0f);
  const float b0[6] = {kInf, -kInf, kNaN, 448.0f, -896.0f, 1.0f};
  const uint8_t c0[6] = {7, 15, 7, 2, 12, 0};
  for (int i = 0; i < 6; ++i) x[i] = b0[i];
  for (int i = 16; i < 32; ++i) x[i] = grid_value(static_cast<uint8_t>(i - 16));
  Quantized q = quantize_checked(single(1, 32, x), cfg_of(true, false));
  EXPECT_EQ(q.row_amax[0], kInf);
  EXPECT_EQ(q.row_scale[0], (std::vector<uint8_t>{0x7E, 0x38}));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(nibble(q.row_data[0], 16, 0, i), i < 6 ? c0[i] : 0) << i;
  for (int i = 16; i < 32; ++i) EXPECT_EQ(nibble(q.row_data[0], 16, 0, i), i - 16) << i;
}

// Columnwise layout (B.5): stored transposed (K, rows/2), blocks of 16 along rows. X[r][c] is the
// grid value of code (3r + 5c + o) % 16 (o random): every 16-run along a row or a column holds
// all 16 codes, so every block amax is 6 = the tensor amax, and as in NibbleOrder s_b = 0x7E,
// r_b = 1 and the code of X[r][c] is (3r + 5c + o) % 16 in both copies, at (r, c) rowwise and at
// (c, r) columnwise.
TEST(Nvfp4Quantize, ColumnwiseIsTransposed) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int o = std::uniform_int_distribution<int>(0, 15)(rng);
  const int64_t rows = 32, k = 48;
  std::vector<float> x(rows * k);
  auto code = [&](int64_t r, int64_t c) { return static_cast<uint8_t>((3 * r + 5 * c + o) % 16); };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) x[r * k + c] = grid_value(code(r, c));
  Quantized q = quantize_checked(single(rows, k, x, DType::kBF16), cfg_of(true, true));
  EXPECT_EQ(q.row_amax[0], 6.0f);
  EXPECT_EQ(q.col_amax[0], 6.0f);
  ASSERT_EQ(q.col_data[0].size(), size_t(k * rows / 2));
  ASSERT_EQ(q.col_scale[0].size(), size_t(k * rows / 16));
  for (uint8_t s : q.row_scale[0]) EXPECT_EQ(s, 0x7E);
  for (uint8_t s : q.col_scale[0]) EXPECT_EQ(s, 0x7E);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      EXPECT_EQ(nibble(q.row_data[0], k / 2, r, c), code(r, c)) << r << "," << c;
      EXPECT_EQ(nibble(q.col_data[0], rows / 2, c, r), code(r, c)) << r << "," << c;
    }
}

// 2D 16x16 tiles (B.4): one s_b per tile in all 16 rows (row_scale) and all 16 columns
// (col_scale); the columnwise copy is the exact transpose of the rowwise one; col_amax =
// row_amax. Hand tile: the tensor amax 2688 is planted in tile (1, 1) (S_enc = 1) and tile (0, 0)
// holds values in (-5.9, 5.9) plus one 6: s_b = 0x38, r_b = 1 in all 16 rows, although most rows
// of that tile have a smaller amax of their own. Every tile is checked against the building blocks.
TEST(Nvfp4Quantize, TwoDTilesAreTransposes) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t k = 64;
  Input in = random_input(rng, DType::kF32, k, {48, 0, 32});
  std::uniform_real_distribution<float> u(-5.9f, 5.9f);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) in.f32[0][r * k + c] = u(rng);
  in.f32[0][std::uniform_int_distribution<int>(0, 15)(rng) * k + 5] = -6.0f;
  in.f32[0][20 * k + 21] = 2688.0f;
  Quantized q = quantize_checked(in, cfg_of(true, true, true));
  EXPECT_EQ(q.row_amax[0], 2688.0f);
  for (int r = 0; r < 16; ++r) {
    EXPECT_EQ(q.row_scale[0][r * (k / 16)], 0x38);
    for (int c = 0; c < 16; ++c)
      EXPECT_EQ(nibble(q.row_data[0], k / 2, r, c), f32_to_e2m1(in.at(0, r, c))) << r << "," << c;
  }
  for (size_t g = 0; g < 3; ++g) {
    const int64_t rows = in.rows[g];
    EXPECT_EQ(q.col_amax[g], q.row_amax[g]);
    if (rows == 0) {
      EXPECT_EQ(q.row_amax[g], 0.0f);
      continue;
    }
    float amax = 0.0f;
    for (float v : in.f32[g]) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(q.row_amax[g], amax);
    const float s_enc = nvfp4_encode_scale(amax), s_dec = nvfp4_decode_scale(amax);
    for (int64_t tr = 0; tr < rows / 16; ++tr)
      for (int64_t tc = 0; tc < k / 16; ++tc) {
        float t_amax = 0.0f;
        for (int i = 0; i < 16; ++i)
          for (int j = 0; j < 16; ++j)
            t_amax = std::max(t_amax, std::fabs(in.at(g, tr * 16 + i, tc * 16 + j)));
        const uint8_t s_b = nvfp4_block_scale(t_amax, s_enc);
        const float r_b = nvfp4_block_rcp(s_b, s_dec);
        for (int i = 0; i < 16; ++i) {
          const int64_t r = tr * 16 + i, c = tc * 16 + i;
          EXPECT_EQ(q.row_scale[g][r * (k / 16) + tc], s_b);
          EXPECT_EQ(q.col_scale[g][c * (rows / 16) + tr], s_b);
          for (int j = 0; j < 16; ++j) {
            const int64_t cc = tc * 16 + j;
            const uint8_t want = nvfp4_encode(in.at(g, r, cc), r_b);
            ASSERT_EQ(nibble(q.row_data[g], k / 2, r, cc), want);
            ASSERT_EQ(nibble(q.col_data[g], rows / 2, cc, r), want);
          }
        }
      }
  }
}

// Without RHT the columnwise copy of X is the rowwise copy of X^T, bytes and amax (1x16 blocks).
TEST(Nvfp4Quantize, ColumnwiseEqualsRowwiseOfTranspose) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Input in = random_input(rng, dt, 48, {32, 16, 0, 48});
    Quantized q = quantize_checked(in, cfg_of(true, true));
    for (size_t g = 0; g < in.rows.size(); ++g) {
      const int64_t rows = in.rows[g];
      if (rows == 0) continue;
      Quantized t = quantize_checked(single(in.k, rows, columnwise_values(in, g, false)),
                                     cfg_of(true, false));
      EXPECT_EQ(q.col_data[g], t.row_data[0]) << g;
      EXPECT_EQ(q.col_scale[g], t.row_scale[0]) << g;
      EXPECT_EQ(q.col_amax[g], t.row_amax[0]) << g;
      EXPECT_EQ(q.col_amax[g], q.row_amax[g]) << g;
    }
  }
}

// With RHT the columnwise copy is the rowwise copy of T (K, rows) where each 16-run of a column
// went through rht16; col_amax is the amax of all of T (post-RHT amax), row_amax the raw one.
TEST(Nvfp4Quantize, RhtColumnwiseQuantizesTransformedValues) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Input in = random_input(rng, dt, 32, {32, 0, 64});
    Quantized q = quantize_checked(in, cfg_of(true, true, false, true));
    Quantized plain = quantize_checked(in, cfg_of(true, false));
    EXPECT_EQ(q.row_data, plain.row_data);  // RHT never touches the rowwise copy
    EXPECT_EQ(q.row_amax, plain.row_amax);
    EXPECT_EQ(q.col_amax[1], 0.0f);
    for (size_t g : {size_t{0}, size_t{2}}) {
      std::vector<float> t = columnwise_values(in, g, true);
      float t_amax = 0.0f;
      for (float v : t) t_amax = std::max(t_amax, std::fabs(v));
      Quantized r = quantize_checked(single(in.k, in.rows[g], t), cfg_of(true, false));
      EXPECT_EQ(q.col_amax[g], t_amax) << g;
      EXPECT_EQ(q.col_data[g], r.row_data[0]) << g;
      EXPECT_EQ(q.col_scale[g], r.row_scale[0]) << g;
    }
  }
}

// ---- stochastic rounding
// ---------------------------------------------------------------------------

// True when the SR code is one of the two E2M1 values bracketing y (B.7), sign kept.
bool brackets(float y, uint8_t code) {
  const float a = std::min(std::fabs(y), 6.0f);
  const float v = kGrid[code & 7];
  if ((code & 8) != (std::signbit(y) ? 8 : 0)) return false;
  float lo = 0.0f, hi = 6.0f;
  for (float gv : kGrid) {
    if (gv <= a) lo = gv;
    if (gv >= a && gv < hi) hi = gv;
  }
  return v == lo || v == hi;
}

// Every SR output is one of the two bracketing values of x * r_b (rowwise) or t * r_b (the RHT
// columnwise copy); the same (seed, offset) gives the same bytes; another seed other bytes.
TEST(Nvfp4Sr, OutputsBracketAndAreReproducible) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const uint64_t sr_seed = (uint64_t(rng()) << 32) | rng();
  const uint64_t offset = rng();
  Input in = random_input(rng, DType::kBF16, 64, {32, 48});
  const Nvfp4Config cfg = cfg_of(true, true, false, true, true, sr_seed, offset);
  Quantized q = quantize_checked(in, cfg);
  Quantized again = quantize(in, cfg);
  EXPECT_EQ(q.row_data, again.row_data);
  EXPECT_EQ(q.col_data, again.col_data);
  Quantized other = quantize(in, cfg_of(true, true, false, true, true, sr_seed + 1, offset));
  EXPECT_NE(q.row_data, other.row_data);
  EXPECT_NE(q.col_data, other.col_data);
  EXPECT_EQ(q.row_scale, other.row_scale);  // SR changes codes, never scales
  EXPECT_EQ(q.col_scale, other.col_scale);
  Quantized rn = quantize(in, cfg_of(true, true, false, true, false));
  EXPECT_EQ(q.row_scale, rn.row_scale);
  EXPECT_NE(q.row_data, rn.row_data);
  for (size_t g = 0; g < 2; ++g) {
    const int64_t rows = in.rows[g], k = in.k;
    for (int copy = 0; copy < 2; ++copy) {
      // The matrix the copy quantizes row by row: X (rows, K) or T (K, rows).
      const std::vector<float> m = copy == 0 ? in.f32[g] : columnwise_values(in, g, true);
      const int64_t mr = copy == 0 ? rows : k, mc = copy == 0 ? k : rows;
      const float amax = copy == 0 ? q.row_amax[g] : q.col_amax[g];
      const auto& data = copy == 0 ? q.row_data[g] : q.col_data[g];
      const float s_enc = nvfp4_encode_scale(amax), s_dec = nvfp4_decode_scale(amax);
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t b = 0; b < mc / 16; ++b) {
          float b_amax = 0.0f;
          for (int j = 0; j < 16; ++j) b_amax = std::max(b_amax, std::fabs(m[r * mc + b * 16 + j]));
          const float r_b = nvfp4_block_rcp(nvfp4_block_scale(b_amax, s_enc), s_dec);
          for (int j = 0; j < 16; ++j) {
            const float y = m[r * mc + b * 16 + j] * r_b;
            const uint8_t c = nibble(data, mc / 2, r, b * 16 + j);
            ASSERT_TRUE(brackets(y, c)) << "copy " << copy << " y=" << y << " code=" << int(c);
          }
        }
    }
  }
}

// The SR numbering of formats/nvfp4.h, spelled out for two groups (32 and 16 rows, K = 32):
// base_1 = 32 * 32/16 = 64. Rowwise block (r, kb) of group 1 draws philox_draw(seed, offset + 64
// + r*2 + kb, 0); columnwise block (c, rb) of group 1 draws philox_draw(seed, offset + 64 + c*1 +
// rb, 1). Element j takes byte j%4 of word j/4, and its code is the SR codec of x * r_b.
TEST(Nvfp4Sr, BlockNumberingAndStreams) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const uint64_t sr_seed = (uint64_t(rng()) << 32) | rng();
  const uint64_t offset = (uint64_t(rng()) << 20) | rng();
  Input in = random_input(rng, DType::kF32, 32, {32, 16});
  Quantized q = quantize_checked(in, cfg_of(true, true, false, false, true, sr_seed, offset));
  const uint64_t base1 = 64;
  auto byte_of = [](const Philox4& d, int j) {
    return uint8_t((d.v[j / 4] >> (8 * (j % 4))) & 0xFF);
  };
  for (int copy = 0; copy < 2; ++copy) {
    const std::vector<float> m = copy == 0 ? in.f32[1] : columnwise_values(in, 1, false);
    const int64_t mr = copy == 0 ? 16 : 32, mc = copy == 0 ? 32 : 16;
    const float amax = copy == 0 ? q.row_amax[1] : q.col_amax[1];
    const float s_enc = nvfp4_encode_scale(amax), s_dec = nvfp4_decode_scale(amax);
    for (int64_t r = 0; r < mr; ++r)
      for (int64_t b = 0; b < mc / 16; ++b) {
        const Philox4 d = philox_draw(sr_seed, offset + base1 + r * (mc / 16) + b, copy);
        float b_amax = 0.0f;
        for (int j = 0; j < 16; ++j) b_amax = std::max(b_amax, std::fabs(m[r * mc + b * 16 + j]));
        const float r_b = nvfp4_block_rcp(nvfp4_block_scale(b_amax, s_enc), s_dec);
        for (int j = 0; j < 16; ++j) {
          const uint8_t want = f32_to_e2m1_sr(m[r * mc + b * 16 + j] * r_b, byte_of(d, j));
          const auto& data = copy == 0 ? q.row_data[1] : q.col_data[1];
          ASSERT_EQ(nibble(data, mc / 2, r, b * 16 + j), want) << copy << " " << r << " " << b;
        }
      }
  }
  // The group base: group 1 alone with offset + 64 gives the same bytes as inside the call.
  Input g1 = make_input(DType::kF32, 32, {16}, {in.f32[1]});
  Quantized alone =
      quantize_checked(g1, cfg_of(true, true, false, false, true, sr_seed, offset + base1));
  EXPECT_EQ(alone.row_data[0], q.row_data[1]);
  EXPECT_EQ(alone.col_data[0], q.col_data[1]);
}

// offset + 1 draws for block b what offset draws for block b + 1: on a matrix whose blocks all
// hold the same 16 values (so the same scale), block b at offset o + 1 equals block b + 1 at o.
TEST(Nvfp4Sr, OffsetShiftsTheStream) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float v[16];
  for (float& x : v) x = n(rng);
  const uint64_t sr_seed = rng(), o = (uint64_t(rng()) << 16) | rng();
  // Rowwise: X[r][c] = v[c % 16], (16, 64): rowwise block b = 4r + kb.
  std::vector<float> xr(16 * 64), xc(64 * 16);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 64; ++c) xr[r * 64 + c] = v[c % 16];
  // Columnwise: X[r][c] = v[r % 16], (64, 16): columnwise block b = 4c + rb.
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 16; ++c) xc[r * 16 + c] = v[r % 16];
  for (int copy = 0; copy < 2; ++copy) {
    const Input in = copy == 0 ? single(16, 64, xr) : single(64, 16, xc);
    Quantized a =
        quantize_checked(in, cfg_of(copy == 0, copy == 1, false, false, true, sr_seed, o));
    Quantized b =
        quantize_checked(in, cfg_of(copy == 0, copy == 1, false, false, true, sr_seed, o + 1));
    const auto& da = copy == 0 ? a.row_data[0] : a.col_data[0];
    const auto& db = copy == 0 ? b.row_data[0] : b.col_data[0];
    const int blocks = 64;
    bool any_diff = false;
    for (int blk = 0; blk + 1 < blocks; ++blk) {
      EXPECT_EQ(0, std::memcmp(db.data() + blk * 8, da.data() + (blk + 1) * 8, 8)) << blk;
      any_diff |= std::memcmp(da.data() + blk * 8, da.data() + (blk + 1) * 8, 8) != 0;
    }
    EXPECT_TRUE(any_diff) << "blocks with equal values must still draw different bits";
  }
}

// The rowwise (stream 0) and columnwise (stream 1) copies draw different bits: on a symmetric X
// the two copies are equal bytes with RN and differ with SR.
TEST(Nvfp4Sr, RowAndColumnStreamsDiffer) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float w[16];
  for (float& x : w) x = n(rng);
  std::vector<float> x(16 * 16);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) x[r * 16 + c] = w[(r + c) % 16];
  Quantized rn = quantize_checked(single(16, 16, x), cfg_of(true, true));
  EXPECT_EQ(rn.row_data[0], rn.col_data[0]);
  Quantized sr =
      quantize_checked(single(16, 16, x), cfg_of(true, true, false, false, true, rng(), 0));
  EXPECT_NE(sr.row_data[0], sr.col_data[0]);
}

// SR is unbiased up to the 1/256 granularity: averaged over 400 seeds the dequantized value of
// each element is within 5 standard deviations (step/2/sqrt(400)) plus step/256 of x * r_b.
TEST(Nvfp4Sr, MeanIsUnbiased) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-6.0f, 6.0f);
  std::vector<float> x(16);
  for (float& v : x) v = u(rng);
  x[0] = 6.0f;  // amax 6: S_enc 448, s_b 0x7E, r_b 1 (as in NibbleOrder), so y = x
  std::vector<double> sum(16, 0.0);
  const int kDraws = 400;
  for (int s = 0; s < kDraws; ++s) {
    Quantized q = quantize(single(1, 16, x), cfg_of(true, false, false, false, true, rng(), s));
    for (int j = 0; j < 16; ++j) sum[j] += grid_value(nibble(q.row_data[0], 8, 0, j));
  }
  for (int j = 0; j < 16; ++j) {
    const double a = std::fabs(x[j]);
    const double step = a < 2 ? 0.5 : a < 4 ? 1.0 : 2.0;
    EXPECT_NEAR(sum[j] / kDraws, x[j], 5 * step / 2 / std::sqrt(kDraws) + step / 256) << x[j];
  }
}

// ---- groups, bounds, layouts
// ---------------------------------------------------------------------

// An empty group writes amax 0 and adds no blocks to the SR numbering: {16, 0, 32} gives the same
// bytes as {16, 32}, for every option.
TEST(Nvfp4Quantize, EmptyGroupIsInvisible) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  Input with = random_input(rng, DType::kBF16, 32, {16, 0, 32});
  Input without = make_input(DType::kF32, 32, {16, 32}, {with.f32[0], with.f32[2]});
  for (bool rht : {false, true})
    for (bool sr : {false, true}) {
      const Nvfp4Config cfg = cfg_of(true, true, false, rht, sr, rng(), rng());
      Quantized a = quantize_checked(with, cfg);
      Quantized b = quantize_checked(without, cfg);
      EXPECT_EQ(a.row_amax[1], 0.0f);
      EXPECT_EQ(a.col_amax[1], 0.0f);
      for (int i : {0, 1}) {
        const int ia = i == 0 ? 0 : 2;
        EXPECT_EQ(a.row_data[ia], b.row_data[i]);
        EXPECT_EQ(a.row_scale[ia], b.row_scale[i]);
        EXPECT_EQ(a.col_data[ia], b.col_data[i]);
        EXPECT_EQ(a.col_scale[ia], b.col_scale[i]);
        EXPECT_EQ(a.row_amax[ia], b.row_amax[i]);
        EXPECT_EQ(a.col_amax[ia], b.col_amax[i]);
      }
    }
}

// Round trip bound (RN). In block units y = x * r_b ~ x / (s_b S_dec); with a normal E4M3 s_b
// (relative rounding <= 2^-4) |y| <= 6 / (1 - 2^-4) < 6.4, so the E2M1 error |y - q| is at most
// half a grid step (0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]) or the saturation |y| - 6, all
// <= max(0.25, |y| / 4). Scaling back by D = s_b * S_dec (the FP32 roundings add a few 2^-24):
//   |x - dq| <= max(0.25 D, |x| / 4) (1 + 2^-20) + |x| 2^-20.
TEST(Nvfp4Quantize, RoundTripErrorBound) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{16, 16}, {32, 64}, {64, 48}};
  for (auto [rows, k] : shapes)
    for (float sigma : {1e-3f, 1.0f, 500.0f})
      for (int mode = 0; mode < 3; ++mode) {  // 1D, 2D, 1D with RHT columnwise
        Input in = random_input(rng, DType::kF32, k, {rows}, sigma);
        Quantized q = quantize_checked(in, cfg_of(true, true, mode == 1, mode == 2));
        for (int copy = 0; copy < 2; ++copy) {
          const std::vector<float> m = copy == 0 ? in.f32[0] : columnwise_values(in, 0, mode == 2);
          const int64_t mr = copy == 0 ? rows : k, mc = copy == 0 ? k : rows;
          const float s_dec = nvfp4_decode_scale(copy == 0 ? q.row_amax[0] : q.col_amax[0]);
          const auto& data = copy == 0 ? q.row_data[0] : q.col_data[0];
          const auto& scale = copy == 0 ? q.row_scale[0] : q.col_scale[0];
          std::vector<float> dq = dequantize(data, scale, mr, mc, s_dec);
          for (int64_t r = 0; r < mr; ++r)
            for (int64_t c = 0; c < mc; ++c) {
              const uint8_t s_b = scale[r * (mc / 16) + c / 16];
              ASSERT_GE(s_b, 0x08) << "test data must give normal E4M3 block scales";
              const double d = double(e4m3_to_f32(s_b)) * s_dec;
              const double xv = m[r * mc + c];
              const double bound =
                  std::max(0.25 * d, std::fabs(xv) / 4) * (1 + 1e-6) + std::fabs(xv) * 1e-6;
              ASSERT_LE(std::fabs(xv - dq[r * mc + c]), bound)
                  << "x=" << xv << " dq=" << dq[r * mc + c] << " mode=" << mode << " copy=" << copy;
            }
        }
      }
}

TEST(Nvfp4Dequantize, UsesTheGivenDecodeScale) {
  // Byte 0xF7: element 0 code 7 (+6), element 1 code 15 (-6); s_b 0x38 (1); decode scale 0.5
  // (as read from a file): 3 and -3, in F32 and in BF16 (0x4040 / 0xC040).
  const std::vector<uint8_t> data(8, 0xF7), scale{0x38};
  std::vector<float> f = dequantize(data, scale, 1, 16, 0.5f);
  std::vector<float> h = dequantize(data, scale, 1, 16, 0.5f, DType::kBF16);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(f[i], i % 2 ? -3.0f : 3.0f);
    EXPECT_EQ(f32_to_bf16(h[i]), i % 2 ? 0xC040 : 0x4040);
  }
}

// ---- packed vs discrete ------------------------------------------------------------------------

// The same (E, N, K) input as one packed buffer with outputs carved from single allocations, and
// as E separate allocations: bitwise identical for every option.
TEST(Nvfp4Quantize, PackedEqualsDiscrete) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  const int64_t e = 3, n = 32, k = 64;
  struct Opt {
    bool row, col, two_d, rht, sr;
  };
  const Opt opts[] = {{true, false, false, false, false}, {false, true, false, false, false},
                      {true, true, false, false, false},  {true, true, false, true, false},
                      {true, true, false, false, true},   {true, true, false, true, true},
                      {true, true, true, false, false},   {false, true, true, false, false}};
  for (DType dt : {DType::kF32, DType::kBF16})
    for (const Opt& o : opts) {
      SCOPED_TRACE(std::string("row ") + char('0' + o.row) + " col " + char('0' + o.col) + " 2d " +
                   char('0' + o.two_d) + " rht " + char('0' + o.rht) + " sr " + char('0' + o.sr));
      const Nvfp4Config cfg = cfg_of(o.row, o.col, o.two_d, o.rht, o.sr, rng(), rng());
      Input disc = random_input(rng, dt, k, std::vector<int64_t>(e, n));
      const size_t esz = dtype_bits(dt) / 8;
      std::vector<uint8_t> packed_in(e * n * k * esz);
      for (int64_t g = 0; g < e; ++g)
        std::memcpy(packed_in.data() + g * n * k * esz, disc.view().data[g], n * k * esz);
      const GroupedMatrices pin = packed_groups(packed_in.data(), dt, e, n, k);
      std::vector<uint8_t> rd(e * n * k / 2), rs(e * n * k / 16), cd(e * n * k / 2),
          cs(e * n * k / 16);
      std::vector<float> ra(e), ca(e);
      Nvfp4Outputs po;
      if (o.row) {
        for (void* p : carve(rd.data(), e, n * k / 2)) po.row_data.push_back(p);
        for (void* p : carve(rs.data(), e, n * k / 16)) po.row_scale.push_back(p);
        po.row_amax = ra.data();
      }
      if (o.col) {
        for (void* p : carve(cd.data(), e, n * k / 2)) po.col_data.push_back(p);
        for (void* p : carve(cs.data(), e, n * k / 16)) po.col_scale.push_back(p);
        po.col_amax = ca.data();
      }
      ASSERT_TRUE(quantize_nvfp4_cpu(pin, cfg, po).is_ok());
      Quantized q = quantize_checked(disc, cfg);
      for (int64_t g = 0; g < e; ++g) {
        if (o.row) {
          EXPECT_EQ(0, std::memcmp(rd.data() + g * n * k / 2, q.row_data[g].data(), n * k / 2));
          EXPECT_EQ(0, std::memcmp(rs.data() + g * n * k / 16, q.row_scale[g].data(), n * k / 16));
          EXPECT_EQ(f32_bits(ra[g]), f32_bits(q.row_amax[g]));
        }
        if (o.col) {
          EXPECT_EQ(0, std::memcmp(cd.data() + g * n * k / 2, q.col_data[g].data(), n * k / 2));
          EXPECT_EQ(0, std::memcmp(cs.data() + g * n * k / 16, q.col_scale[g].data(), n * k / 16));
          EXPECT_EQ(f32_bits(ca[g]), f32_bits(q.col_amax[g]));
        }
      }
    }
}

// ---- validation
// ----------------------------------------------------------------------------------

// row_bf16: the rowwise copy's values without S_dec, as BF16, exactly what dequantizing the copy
// with decode scale 1 gives (the GEMM's operand); every byte written; the codes themselves
// unchanged by asking for them. RN and SR, BF16 and F32 input, an empty group.
TEST(Nvfp4Quantize, RowBf16IsTheRowwiseCopyDequantizedWithoutSdec) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  for (bool sr : {false, true})
    for (DType dt : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(std::string(sr ? "sr " : "rn ") + std::string(dtype_name(dt)));
      const Input in = random_input(rng, dt, 48, {32, 0, 16});
      const Nvfp4Config cfg = cfg_of(true, true, false, true, sr, seed, 5);
      const Quantized plain = quantize(in, cfg);
      std::vector<std::vector<uint16_t>> bf16[2];
      for (int fill = 0; fill < 2; ++fill) {
        Quantized q = quantize(in, cfg);  // row_bf16 needs its own call: quantize() has none
        for (int64_t r : in.rows) bf16[fill].emplace_back(r * 48, fill ? 0xFFFF : 0);
        Nvfp4Outputs o = q.outputs();
        for (auto& v : bf16[fill]) o.row_bf16.push_back(v.data());
        const Status st = quantize_nvfp4_cpu(in.view(), cfg, o);
        ASSERT_TRUE(st.is_ok()) << st.message();
        EXPECT_EQ(q.row_data, plain.row_data) << "asking for row_bf16 changed the codes";
        EXPECT_EQ(q.col_data, plain.col_data);
      }
      EXPECT_EQ(bf16[0], bf16[1]) << "row_bf16 bytes left unwritten";
      {  // The rowwise copy kept as its values only (no data or scale): the same values.
        Quantized q = quantize(in, cfg);
        std::vector<std::vector<uint16_t>> only;
        Nvfp4Outputs o = q.outputs();
        o.row_data.clear();
        o.row_scale.clear();
        for (int64_t r : in.rows) o.row_bf16.push_back(only.emplace_back(r * 48, 0xFFFF).data());
        ASSERT_TRUE(o.row_values_only());
        const Status st = quantize_nvfp4_cpu(in.view(), cfg, o);
        ASSERT_TRUE(st.is_ok()) << st.message();
        EXPECT_EQ(only, bf16[0]) << "values-only rowwise copy";
        EXPECT_EQ(q.col_data, plain.col_data);
      }
      for (size_t g = 0; g < in.rows.size(); ++g) {
        if (in.rows[g] == 0) continue;
        Nvfp4Copy c;
        const float one = 1.0f;
        c.cols = 48;
        c.rows = {in.rows[g]};
        c.data = {plain.row_data[g].data()};
        c.scale = {plain.row_scale[g].data()};
        c.decode_scale = &one;
        std::vector<uint16_t> want(in.rows[g] * 48);
        ASSERT_TRUE(dequantize_nvfp4_cpu(c, DType::kBF16, {want.data()}).is_ok());
        EXPECT_EQ(bf16[0][g], want) << "group " << g;
      }
    }
}

TEST(Nvfp4Validate, BadRequestsFailWithoutTouchingMemory) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  Input in = random_input(rng, DType::kF32, 32, {16, 32});
  const std::vector<uint8_t> sentinel(64 * 64, 0xC3);
  std::vector<std::vector<uint8_t>> bufs(8, sentinel);
  std::vector<float> amax(4, -7.0f);
  const std::vector<float> amax_sentinel = amax;
  auto outputs = [&](bool row, bool col) {
    Nvfp4Outputs o;
    if (row) {
      o.row_data = {bufs[0].data(), bufs[1].data()};
      o.row_scale = {bufs[2].data(), bufs[3].data()};
      o.row_amax = amax.data();
    }
    if (col) {
      o.col_data = {bufs[4].data(), bufs[5].data()};
      o.col_scale = {bufs[6].data(), bufs[7].data()};
      o.col_amax = amax.data() + 2;
    }
    return o;
  };
  struct Case {
    const char* name;
    GroupedMatrices in;
    Nvfp4Config cfg;
    Nvfp4Outputs out;
    const char* needle;
  };
  const GroupedMatrices good = in.view();
  ASSERT_TRUE(validate_nvfp4(good, cfg_of(true, true), outputs(true, true)).is_ok());
  std::vector<Case> cases;
  GroupedMatrices g = good;
  g.cols = 24;
  cases.push_back({"K % 16", g, cfg_of(true, false), outputs(true, false), "multiple of 16"});
  g = good;
  g.rows = {16, 24};
  cases.push_back({"rows % 16 columnwise", g, cfg_of(false, true), outputs(false, true), "rows"});
  cases.push_back({"rows % 16 2D", g, cfg_of(true, false, true), outputs(true, false), "rows"});
  g = good;
  g.rows = {0, 0};
  cases.push_back({"empty", g, cfg_of(true, false), outputs(true, false), "empty"});
  g = good;
  g.dtype = DType::kE2M1;
  cases.push_back({"input dtype", g, cfg_of(true, false), outputs(true, false), "f32 or bf16"});
  cases.push_back({"2D + RHT", good, cfg_of(true, true, true, true), outputs(true, true), "RHT"});
  cases.push_back(
      {"2D + SR", good, cfg_of(true, true, true, false, true), outputs(true, true), "stochastic"});
  cases.push_back({"no copy", good, cfg_of(false, false), Nvfp4Outputs{}, "at least one"});
  Nvfp4Outputs o = outputs(true, false);
  o.row_amax = nullptr;
  cases.push_back({"missing amax", good, cfg_of(true, false), o, "row_amax"});
  o = outputs(false, true);
  o.col_scale.pop_back();
  cases.push_back({"short scale list", good, cfg_of(false, true), o, "col_scale"});
  o = outputs(true, false);
  o.row_data[0] = nullptr;
  cases.push_back({"null data", good, cfg_of(true, false), o, "null"});
  cases.push_back(
      {"unrequested copy", good, cfg_of(false, true), outputs(true, true), "not requested"});
  g = good;
  g.data.pop_back();
  cases.push_back({"input pointers", g, cfg_of(true, false), outputs(true, false), "pointers"});
  o = outputs(true, true);
  o.row_bf16 = {bufs[0].data(), bufs[1].data()};
  cases.push_back({"row_bf16 with 2D", good, cfg_of(true, true, true), o, "row_bf16"});
  o = outputs(false, true);
  o.row_bf16 = {bufs[0].data(), bufs[1].data()};
  cases.push_back({"row_bf16 without rowwise", good, cfg_of(false, true), o, "row_bf16"});
  o = outputs(true, false);
  o.row_bf16 = {bufs[0].data()};
  cases.push_back({"short row_bf16 list", good, cfg_of(true, false), o, "row_bf16"});
  o = outputs(true, false);
  o.row_scale.clear();
  o.row_bf16 = {bufs[0].data(), bufs[1].data()};
  cases.push_back({"values with data but no scales", good, cfg_of(true, false), o, "row_scale"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Status v = validate_nvfp4(c.in, c.cfg, c.out);
    const Status s = quantize_nvfp4_cpu(c.in, c.cfg, c.out);
    EXPECT_FALSE(v.is_ok());
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(v.message(), s.message());
    EXPECT_NE(s.message().find("quantize_nvfp4"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.message();
    for (const auto& b : bufs) ASSERT_EQ(b, sentinel) << "memory touched";
    ASSERT_EQ(amax, amax_sentinel) << "amax touched";
  }

  std::vector<float> out(64 * 64, 1.5f);
  const std::vector<float> out_sentinel = out;
  const float dscale = 1.0f;
  Nvfp4Copy c;
  c.cols = 32;
  c.rows = {16};
  c.data = {bufs[0].data()};
  c.scale = {bufs[2].data()};
  c.decode_scale = &dscale;
  ASSERT_TRUE(validate_nvfp4_copy(c, DType::kF32, {out.data()}).is_ok());
  struct CopyCase {
    const char* name;
    Nvfp4Copy q;
    DType dt;
    std::vector<void*> outs;
  };
  std::vector<CopyCase> cc;
  Nvfp4Copy bad = c;
  bad.cols = 40;
  cc.push_back({"cols % 16", bad, DType::kF32, {out.data()}});
  bad = c;
  bad.decode_scale = nullptr;
  cc.push_back({"no decode scale", bad, DType::kF32, {out.data()}});
  bad = c;
  bad.rows = {0};
  cc.push_back({"empty", bad, DType::kF32, {out.data()}});
  cc.push_back({"out dtype", c, DType::kE4M3, {out.data()}});
  cc.push_back({"missing out", c, DType::kF32, {}});
  bad = c;
  bad.data = {nullptr};
  cc.push_back({"null data", bad, DType::kF32, {out.data()}});
  for (const CopyCase& k : cc) {
    SCOPED_TRACE(k.name);
    const Status s = dequantize_nvfp4_cpu(k.q, k.dt, k.outs);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("dequantize_nvfp4"), std::string::npos) << s.message();
    EXPECT_EQ(out, out_sentinel) << "memory touched";
  }
}

}  // namespace
}  // namespace packmoe
