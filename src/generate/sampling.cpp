// Greedy choice and seeded temperature / top-k / top-p sampling (generate/sampling.h), on the host
// in FP64 over one row of logits.
#include "generate/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/philox.h"

namespace packmoe::generate {

Status validate(const SamplingConfig& c) {
  if (!std::isfinite(c.temperature) || c.temperature < 0.0)
    return Status::error("--temperature must be finite and >= 0 (0: greedy), got " +
                         std::to_string(c.temperature));
  if (c.top_k < 0)
    return Status::error("--top-k must be >= 0 (0: no limit), got " + std::to_string(c.top_k));
  if (!(c.top_p > 0.0 && c.top_p <= 1.0))
    return Status::error("--top-p must be in (0, 1], got " + std::to_string(c.top_p));
  return Status::ok();
}

std::vector<Candidate> candidates(std::span<const float> logits, const SamplingConfig& c) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t keep =
      c.top_k > 0 ? std::min(order.size(), static_cast<size_t>(c.top_k)) : order.size();
  const auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
  order.resize(keep);

  std::vector<Candidate> out;
  out.reserve(keep);
  const double top = logits[order[0]];
  double sum = 0.0;
  for (int32_t id : order) {
    const double p = std::exp((static_cast<double>(logits[id]) - top) / c.temperature);
    out.push_back({id, p});
    sum += p;
  }
  double cumulative = 0.0;
  size_t n = 0;
  while (n < out.size()) {
    out[n].p /= sum;
    cumulative += out[n].p;
    ++n;
    if (cumulative >= c.top_p) break;
  }
  out.resize(n);
  for (Candidate& x : out) x.p /= cumulative;
  return out;
}

double uniform_draw(uint64_t seed, uint64_t step) {
  const Philox4 r = philox_draw(seed, step, 0);
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 21) | (r.v[1] >> 11);  // 53 bits
  return static_cast<double>(bits) / 9007199254740992.0;                          // / 2^53
}

int32_t choose_token(std::span<const float> logits, const SamplingConfig& c, uint64_t step) {
  if (c.temperature == 0.0) {
    size_t best = 0;
    for (size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  const std::vector<Candidate> set = candidates(logits, c);
  const double u = uniform_draw(c.seed, step);
  double cumulative = 0.0;
  for (const Candidate& x : set) {
    cumulative += x.p;
    if (u < cumulative) return x.id;
  }
  return set.back().id;
}

}  // namespace packmoe::generate
