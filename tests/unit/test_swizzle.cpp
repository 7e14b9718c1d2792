// GEMM-ready scale swizzle (formats/swizzle.{h,cpp}, reference A.6): the index formula checked by
// hand, against TE's PyTorch view/permute formulation and the documented inner order; bijection,
// zero padding, inverse and the transpose option on random compact scales (fresh seed, printed).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "formats/swizzle.h"

namespace packmoe {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }

TEST(Swizzle, PaddedSize) {
  // (roundup(rows, 128)) * (roundup(cols, 4)).
  EXPECT_EQ(swizzled_scale_bytes(1, 1), 128 * 4);
  EXPECT_EQ(swizzled_scale_bytes(128, 4), 512);
  EXPECT_EQ(swizzled_scale_bytes(129, 5), 256 * 8);
  EXPECT_EQ(swizzled_scale_bytes(300, 10), 384 * 12);
}

TEST(Swizzle, IndexByHand) {
  // off = tile*512 + (i%32)*16 + ((i%128)/32)*4 + (j%4), tile = (i/128)*ceil(cols/4) + j/4.
  EXPECT_EQ(swizzled_scale_index(0, 0, 4), 0);
  EXPECT_EQ(swizzled_scale_index(0, 3, 4), 3);
  EXPECT_EQ(swizzled_scale_index(1, 0, 4), 16);               // (1%32)*16
  EXPECT_EQ(swizzled_scale_index(31, 0, 4), 496);             // 31*16
  EXPECT_EQ(swizzled_scale_index(32, 0, 4), 4);               // ((32%128)/32)*4
  EXPECT_EQ(swizzled_scale_index(33, 2, 4), 22);              // 16 + 4 + 2
  EXPECT_EQ(swizzled_scale_index(127, 3, 4), 511);            // 496 + 12 + 3: last byte of tile 0
  EXPECT_EQ(swizzled_scale_index(0, 4, 8), 512);              // tile 1 (second column tile)
  EXPECT_EQ(swizzled_scale_index(128, 0, 8), 1024);           // tile (1, 0) = 1*2 + 0 = 2
  EXPECT_EQ(swizzled_scale_index(130, 5, 8), 1536 + 32 + 1);  // tile 3, (130%32)*16, j%4 = 1
  EXPECT_EQ(swizzled_scale_index(0, 4, 5), 512);              // cols 5 -> 2 column tiles
  EXPECT_EQ(swizzled_scale_index(200, 6, 5), 3 * 512 + 8 * 16 + 2 * 4 + 2);  // 200%128 = 72
}

TEST(Swizzle, DocumentedInnerOrder) {
  // The 128 four-byte rows of a 128x4 tile are stored in the order 0, 32, 64, 96, 1, 33, ...:
  // four-byte slot m holds compact row (m%4)*32 + m/4.
  for (int m = 0; m < 128; ++m) {
    const int64_t row = (m % 4) * 32 + m / 4;
    for (int j = 0; j < 4; ++j) EXPECT_EQ(swizzled_scale_index(row, j, 4), 4 * m + j) << m;
  }
}

TEST(Swizzle, MatchesTorchViewPermute) {
  // TE's _rowwise_swizzle_mxfp8_scale: S.view(M/128, 4, 32, Kb/4, 4).permute(0, 3, 2, 1, 4),
  // flattened. Row i = a*128 + b*32 + c, column j = d*4 + e lands at ((((a*D + d)*32 + c)*4 + b)*4
  // + e) with D = Kb/4.
  const int64_t m = 256, kb = 12, d_tiles = kb / 4;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < kb; ++j) {
      const int64_t a = i / 128, b = (i % 128) / 32, c = i % 32, d = j / 4, e = j % 4;
      const int64_t want = (((a * d_tiles + d) * 32 + c) * 4 + b) * 4 + e;
      ASSERT_EQ(swizzled_scale_index(i, j, kb), want) << i << "," << j;
    }
}

TEST(Swizzle, BijectionOnAlignedShapes) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{128, 4}, {256, 8}, {384, 12}}) {
    std::vector<int> hits(swizzled_scale_bytes(rows, cols), 0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) ++hits[swizzled_scale_index(i, j, cols)];
    for (int h : hits) ASSERT_EQ(h, 1);
  }
}

// swizzle_scales_cpu places every compact byte at its index, zeroes all padding (the output is
// pre-filled with garbage), and unswizzling by the same index recovers the compact matrix.
TEST(Swizzle, CpuPlacesBytesAndZeroesPadding) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {130, 5}, {256, 8}, {77, 13}}) {
    std::vector<uint8_t> s(rows * cols);
    for (auto& v : s) v = static_cast<uint8_t>(1 + rng() % 255);  // nonzero: padding is visible
    std::vector<uint8_t> out(swizzled_scale_bytes(rows, cols), 0xEE);
    swizzle_scales_cpu(s.data(), rows, cols, false, out.data());
    std::vector<bool> used(out.size(), false);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t idx = swizzled_scale_index(i, j, cols);
        used[idx] = true;
        ASSERT_EQ(out[idx], s[i * cols + j]);
      }
    for (size_t t = 0; t < out.size(); ++t) {
      if (!used[t]) {
        ASSERT_EQ(out[t], 0) << "padding byte " << t;
      }
    }
  }
}

// transpose = true swizzles S^T: the (cols, rows) matrix, e.g. MXFP8 columnwise scales
// (rows/32, K) as the (K, rows/32) matrix the GEMM reads.
TEST(Swizzle, TransposeSwizzlesTheTransposedMatrix) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{4, 256}, {3, 130}, {9, 40}}) {
    std::vector<uint8_t> s(rows * cols), st(rows * cols);
    for (auto& v : s) v = static_cast<uint8_t>(rng());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) st[j * rows + i] = s[i * cols + j];
    std::vector<uint8_t> a(swizzled_scale_bytes(cols, rows), 0x11);
    std::vector<uint8_t> b(swizzled_scale_bytes(cols, rows), 0x22);
    swizzle_scales_cpu(s.data(), rows, cols, true, a.data());
    swizzle_scales_cpu(st.data(), cols, rows, false, b.data());
    EXPECT_EQ(a, b);
    // By hand: compact S[i][j] lands at the index of (j, i) in a matrix with `rows` columns.
    EXPECT_EQ(a[swizzled_scale_index(1, 2, rows)], s[2 * cols + 1]);
  }
}

}  // namespace
}  // namespace packmoe
