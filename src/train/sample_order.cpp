// Feistel permutation, order keys and the blend rule.
#include "train/sample_order.h"

#include <bit>
#include <cmath>

#include "core/status.h"

namespace packmoe::train {
namespace {

__extension__ typedef unsigned __int128 U128;  // exact blend errors (GCC and Clang)

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t permute(uint64_t index, uint64_t n, uint64_t key) {
  PACKMOE_CHECK(n >= 1 && index < n, "permute(" << index << ", " << n << ")");
  if (n == 1) return 0;
  // Halves of `half` bits each: the domain 2^(2 half) >= n, at most 4n, so cycle walking takes
  // fewer than 4 rounds on average.
  const int bits = std::bit_width(n - 1);
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = index;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = mix(right ^ mix(key + round)) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

uint64_t order_key(uint64_t seed, OrderKind what, uint64_t source, uint64_t epoch) {
  return mix(mix(mix(mix(seed) ^ static_cast<uint64_t>(what)) ^ source) ^ epoch);
}

BlendOrder::BlendOrder(std::vector<uint64_t> weights) : weights_(std::move(weights)) {
  PACKMOE_CHECK(!weights_.empty(), "a blend of no sources");
  PACKMOE_CHECK(weights_.size() <= kMaxBlendSources, weights_.size() << " blend sources");
  for (uint64_t w : weights_) {
    PACKMOE_CHECK(w >= 1 && w <= kMaxBlendWeight, "blend weight " << w);
    total_ += w;
  }
}

std::vector<uint64_t> BlendOrder::quantize(std::span<const double> weights) {
  double sum = 0;
  for (double w : weights) {
    PACKMOE_CHECK(w > 0 && std::isfinite(w), "blend weight " << w);
    sum += w;
  }
  std::vector<uint64_t> q;
  for (double w : weights)
    q.push_back(std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(w / sum * 0x1p40))));
  return q;
}

size_t BlendOrder::next(std::span<const int64_t> counts) const {
  PACKMOE_CHECK(counts.size() == weights_.size(), counts.size() << " counts for "
                                                                << weights_.size() << " sources");
  U128 n = 0;
  for (int64_t c : counts) n += static_cast<uint64_t>(c);
  // Compare (n + 1) q_d - c_d Q without signs, as lhs_d + rhs_best > lhs_best + rhs_d: with
  // c_d < 2^63, n < 2^73, q_d <= 2^48 and Q <= 2^58 every term and sum stays below 2^124.
  size_t best = 0;
  U128 best_lhs = 0, best_rhs = 0;  // lhs_d - rhs_d is the error of d
  for (size_t d = 0; d < weights_.size(); ++d) {
    const U128 lhs = (n + 1) * weights_[d];
    const U128 rhs = U128{static_cast<uint64_t>(counts[d])} * total_;
    // lhs - rhs > best_lhs - best_rhs  <=>  lhs + best_rhs > best_lhs + rhs
    if (d == 0 || lhs + best_rhs > best_lhs + rhs) {
      best = d;
      best_lhs = lhs;
      best_rhs = rhs;
    }
  }
  return best;
}

}  // namespace packmoe::train
