// The optimizer of a test that trains layers without a trainer: DistOptimizer over a 1-rank
// communicator in the params' backend, as one process trains (dist/single_rank_communicator.h).
// It owns the FP32 masters and moments; master(p) reads one back. Invariant: the same code, so
// the same bits, as the optimizer of a one-process training run.
#pragma once

#include <memory>
#include <vector>

#include "dist/dist_optimizer.h"
#include "dist/single_rank_communicator.h"

namespace packmoe {

// Every param decayed, its primary weight gathered (layers that read no FP32 weight).
inline std::vector<DistParam> decayed_params(const std::vector<GroupedParam*>& params) {
  std::vector<DistParam> out;
  for (GroupedParam* p : params) out.push_back({p, true});
  return out;
}

class SingleRankOptimizer {
 public:
  SingleRankOptimizer(Backend& backend, std::vector<DistParam> params, const AdamWConfig& cfg,
                      GatherMode mode = GatherMode::kBf16)
      : comm_(make_single_rank_communicator(backend)),
        opt_(*comm_, std::move(params), DistOptimizerConfig{cfg, mode}) {}

  DistOptimizer& operator*() { return opt_; }
  DistOptimizer* operator->() { return &opt_; }
  // Param p's FP32 master, (E*N*K) F32 on the host (between steps).
  std::vector<float> master(int p) { return opt_.gather_state().master[p]; }
  std::vector<uint8_t> master_bytes(int p) {
    const std::vector<float> m = master(p);
    const auto* b = reinterpret_cast<const uint8_t*>(m.data());
    return {b, b + m.size() * sizeof(float)};
  }

 private:
  std::unique_ptr<Communicator> comm_;
  DistOptimizer opt_;
};

}  // namespace packmoe
