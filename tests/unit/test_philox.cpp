// Philox4x32-10 against Random123's published known-answer vectors (tests/kat_vectors), and the
// (seed, offset, stream) -> (counter, key) mapping that defines every packmoe random stream.
// The KAT values are external data (Random123 distribution, also used by TensorFlow/XLA's tests),
// not produced by this code.
#include "core/philox.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace packmoe {
namespace {

void expect_words(const Philox4& got, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  EXPECT_EQ(got.v[0], w0);
  EXPECT_EQ(got.v[1], w1);
  EXPECT_EQ(got.v[2], w2);
  EXPECT_EQ(got.v[3], w3);
}

TEST(Philox, Random123KnownAnswerZero) {
  expect_words(philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu,
               0x9b00dbd8u);
}

TEST(Philox, Random123KnownAnswerAllOnes) {
  expect_words(philox4x32_10(Philox4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                             0xffffffffu, 0xffffffffu),
               0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu);
}

TEST(Philox, Random123KnownAnswerPi) {
  // Counter and key are the leading hex digits of pi.
  expect_words(philox4x32_10(Philox4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                             0xa4093822u, 0x299f31d0u),
               0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
}

TEST(Philox, DrawMapsSeedOffsetStreamToCounterAndKey) {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint64_t offset = 0xfedcba9876543210ull;
  const uint32_t stream = 0x5a5a1234u;
  const Philox4 got = philox_draw(seed, offset, stream);
  const Philox4 want =
      philox4x32_10(Philox4{{0x76543210u, 0xfedcba98u, stream, 0u}}, 0x89abcdefu, 0x01234567u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], want.v[i]) << "word " << i;

  // The KAT vectors expressed through philox_draw: seed 0, offset 0, stream 0 is the zero vector.
  expect_words(philox_draw(0, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
  // Counter word 3 is always 0, so the all-ones KAT is not reachable; the pi KAT neither.
}

TEST(Philox, DrawDependsOnEveryInputWord) {
  // Each of seed lo/hi, offset lo/hi and stream changes the output: no input word is dropped.
  const Philox4 base = philox_draw(1, 1, 1);
  const Philox4 variants[] = {
      philox_draw(2, 1, 1),
      philox_draw(1 | (1ull << 32), 1, 1),
      philox_draw(1, 2, 1),
      philox_draw(1, 1 | (1ull << 32), 1),
      philox_draw(1, 1, 2),
  };
  for (const Philox4& v : variants) {
    bool differs = false;
    for (int i = 0; i < 4; ++i) differs |= v.v[i] != base.v[i];
    EXPECT_TRUE(differs);
  }
}

TEST(Philox, StreamDrawsAreConsecutiveCounters) {
  // The n-th draw of stream s at offset o is philox_draw(seed, o + n, s); offset carries into the
  // high counter word.
  const uint64_t seed = 42;
  const uint64_t offset = 0xffffffffull;  // o + 1 carries into counter word 1
  const Philox4 next = philox_draw(seed, offset + 1, 7);
  const Philox4 want = philox4x32_10(Philox4{{0u, 1u, 7u, 0u}}, 42u, 0u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(next.v[i], want.v[i]);
}

}  // namespace
}  // namespace packmoe
