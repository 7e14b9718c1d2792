// The order in which a sampler reads: seeded permutations (documents and samples of an epoch)
// and the weighted blend of several sources. Both are pure functions of their integer inputs
// (no floating point, no threads, no state but counters), so a run reads the same rows on every
// machine and a resumed run, given the counters, continues exactly.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace packmoe::train {

// A seeded bijection of [0, n): a 4-round Feistel network on the smallest power-of-two domain
// holding n, cycle-walked back into [0, n). Distinct keys give unrelated orders. n >= 1.
uint64_t permute(uint64_t index, uint64_t n, uint64_t key);

// The permutation key of (seed, what, source, epoch): `what` tells apart the orders of one run
// (documents or samples, training or validation).
enum class OrderKind : uint64_t { kTrainDocuments, kTrainSamples, kValidDocuments, kValidSamples };
uint64_t order_key(uint64_t seed, OrderKind what, uint64_t source, uint64_t epoch);

// Megatron's blending rule (megatron/core/datasets/helpers.cpp, build_blending_indices), in
// exact integer arithmetic: the next sample comes from the source whose count lags its share
// most, i.e. the largest (n + 1) q_d - c_d Q (q_d the integer weights, Q their sum, c_d the
// samples drawn from d so far, n their sum; ties to the lowest d). After any n samples every
// |c_d - n q_d / Q| stays below 2 (below 1 for two sources; tests/unit/test_sampling.cpp), and at
// n = Q each source has given exactly q_d in every case tested.
inline constexpr size_t kMaxBlendSources = size_t{1} << 10;
inline constexpr uint64_t kMaxBlendWeight = uint64_t{1} << 48;  // a source's samples, at most

class BlendOrder {
 public:
  explicit BlendOrder(std::vector<uint64_t> weights);  // each in [1, kMaxBlendWeight]
  // Integer weights for real ones (> 0): round(w_d / sum x 2^40), at least 1.
  static std::vector<uint64_t> quantize(std::span<const double> weights);

  // The source of the next sample given the counts so far (counts.size() == sources()).
  size_t next(std::span<const int64_t> counts) const;
  size_t sources() const { return weights_.size(); }

 private:
  std::vector<uint64_t> weights_;
  uint64_t total_ = 0;  // Q <= kMaxBlendSources x kMaxBlendWeight
};

}  // namespace packmoe::train
