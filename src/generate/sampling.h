// Choosing the next token from one row of logits (docs/generate.md): greedy (temperature 0) or
// seeded sampling with temperature, top-k and top-p. Invariant: a choice is a pure function of
// (logits, settings, seed, step): the random number of step n is the Philox draw (seed, n) of
// core/philox.h, so a seed means the same draws on every machine, device and thread count.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace packmoe::generate {

struct SamplingConfig {
  double temperature = 0.0;  // 0: greedy; else > 0, finite
  int64_t top_k = 0;         // 0: every token; else keep the k largest logits
  double top_p = 1.0;        // in (0, 1]: keep the smallest top set of probability >= top_p
  uint64_t seed = 0;
};

// One error line for a setting outside its range (temperature < 0 or not finite, top_k < 0,
// top_p outside (0, 1]), naming the flag.
Status validate(const SamplingConfig& config);

// The candidates sampling draws from at these settings, in FP64 (temperature > 0):
// ids sorted by logit descending (a tie: the lower id first); the first top_k of them (all when
// 0); p_i = exp((z_i - z_max) / temperature) / sum over those; then the shortest prefix whose
// cumulative p reaches top_p (at least one id), renormalised. Returns (id, probability) pairs in
// that order.
struct Candidate {
  int32_t id;
  double p;
};
std::vector<Candidate> candidates(std::span<const float> logits, const SamplingConfig& config);

// The next token: temperature 0: the argmax (the lowest id among equal maxima). Otherwise the
// first candidate whose cumulative probability exceeds u = uniform_draw(seed, step) (the last one
// if rounding leaves u above them all).
int32_t choose_token(std::span<const float> logits, const SamplingConfig& config, uint64_t step);

// u in [0, 1) of a step: with (v0, v1, ...) = philox_draw(seed, offset = step, stream = 0),
// u = (v0 * 2^21 + floor(v1 / 2^11)) / 2^53.
double uniform_draw(uint64_t seed, uint64_t step);

}  // namespace packmoe::generate
