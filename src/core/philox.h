// Philox4x32-10 counter-based RNG (Salmon, Moraes, Dror, Shaw, SC'11; Random123), header-only for
// CPU and CUDA. Invariant: a draw is a pure function of (seed, offset, stream), so host and device,
// any thread count and any launch shape produce the same bits — there is no generator state.
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace packmoe {

struct Philox4 {
  uint32_t v[4];
};

namespace philox_detail {

inline constexpr uint32_t kMul0 = 0xD2511F53u;
inline constexpr uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
inline constexpr int kRounds = 10;

PACKMOE_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

PACKMOE_HD Philox4 single_round(Philox4 c, uint32_t k0, uint32_t k1) {
  const uint32_t hi0 = mulhi32(kMul0, c.v[0]);
  const uint32_t lo0 = kMul0 * c.v[0];
  const uint32_t hi1 = mulhi32(kMul1, c.v[2]);
  const uint32_t lo1 = kMul1 * c.v[2];
  return Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
}

}  // namespace philox_detail

// The ten round keys of a key (key0, key1): the key, then bumped by the Weyl constants once per
// round. A kernel that draws many times from one seed computes them once (e.g. on the host, into
// its launch arguments) instead of per draw.
struct PhiloxKeys {
  uint32_t k0[philox_detail::kRounds];
  uint32_t k1[philox_detail::kRounds];
};

PACKMOE_HD PhiloxKeys philox_round_keys(uint32_t key0, uint32_t key1) {
  PhiloxKeys k{};
  for (int r = 0; r < philox_detail::kRounds; ++r) {
    k.k0[r] = key0;
    k.k1[r] = key1;
    key0 += philox_detail::kWeyl0;
    key1 += philox_detail::kWeyl1;
  }
  return k;
}

// The Random123 philox4x32_10 bijection: 10 rounds with the round keys above. Matches
// Random123's kat_vectors (tests/unit/test_philox.cpp).
PACKMOE_HD Philox4 philox4x32_10(Philox4 counter, const PhiloxKeys& keys) {
  PACKMOE_UNROLL
  for (int r = 0; r < philox_detail::kRounds; ++r)
    counter = philox_detail::single_round(counter, keys.k0[r], keys.k1[r]);
  return counter;
}

PACKMOE_HD Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  return philox4x32_10(counter, philox_round_keys(key0, key1));
}

// The round keys of a 64-bit seed: key = {lo32(seed), hi32(seed)}.
PACKMOE_HD PhiloxKeys philox_seed_keys(uint64_t seed) {
  return philox_round_keys(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// THE definition of the random stream "(seed, offset)" used everywhere in packmoe (stochastic
// rounding, dropout, init): the n-th 128-bit draw of stream s is philox_draw(seed, offset + n, s),
// with counter = {lo32(offset), hi32(offset), stream, 0} and key = {lo32(seed), hi32(seed)}.
// A consumer that needs more bits advances offset; independent consumers sharing a seed use
// distinct streams (e.g. the rowwise and columnwise SR copies of one gradient).
PACKMOE_HD Philox4 philox_draw(const PhiloxKeys& seed_keys, uint64_t offset, uint32_t stream) {
  const Philox4 counter{{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                         stream, 0u}};
  return philox4x32_10(counter, seed_keys);
}

PACKMOE_HD Philox4 philox_draw(uint64_t seed, uint64_t offset, uint32_t stream) {
  return philox_draw(philox_seed_keys(seed), offset, stream);
}

}  // namespace packmoe
