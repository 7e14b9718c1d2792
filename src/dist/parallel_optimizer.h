// ParallelOptimizer: a model's optimizer under data parallelism, with or without expert
// parallelism. Without it: one DistOptimizer over all ranks holds every parameter. With it
// (dist/expert_layout.h): the dense parameters' DistOptimizer runs over all ranks and the expert
// parameters' (each rank's E / EP experts) over the expert-data-parallel ranks that hold the same
// experts; both reduce-scatter, then ONE global norm (every rank's shards of both, all-reduced
// over all ranks) clips both, and each applies AdamW to its shard. Invariants: every parameter
// lives in exactly one of them; both are driven through the same calls in the same order on every
// rank; the loss scale is the world's (an expert's gradient sums the tokens of its EP group's
// ranks, and its expert-data-parallel reduce-scatter sums over the groups: every micro-batch of
// the job once).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backend/device_buffer.h"
#include "dist/dist_optimizer.h"
#include "dist/optimizer_state.h"

namespace packmoe {

class ParallelOptimizer {
 public:
  // params in the model's order; expert[p]: param p is an expert weight (FC1 / FC2 of an MoE
  // layer). ep / edp: this rank's expert-parallel and expert-data-parallel communicators, both or
  // neither (no expert parallelism: expert[] is ignored). Collective over world (and edp).
  ParallelOptimizer(Communicator& world, Communicator* ep, Communicator* edp,
                    const std::vector<DistParam>& params, const std::vector<bool>& expert,
                    const DistOptimizerConfig& cfg);

  // DistOptimizer's calls, on both (dist/dist_optimizer.h); p indexes the model's params.
  void prepare_forward();
  void prepare_backward(bool last_of_step = false);
  void grad_ready(int p);
  float loss_scale(int64_t micro_batches) const { return dense_->loss_scale(micro_batches); }
  void set_lr(float lr);
  DistStepResult step(double max_norm = 0.0);

  // The whole state per parameter in the model's order, experts of all EP ranks included (their
  // E = EP x E_local, in expert order): the same as a run without expert parallelism holds.
  // Collective (world, and ep). Only between steps.
  FullOptimizerState gather_state();
  // Each optimizer's part of a whole state (saved by any layout): the dense params, and of each
  // expert param the E_local experts this rank holds. Errors as DistOptimizer::load_state.
  Status load_state(const FullOptimizerState& state);
  // The whole state's parameter geometries (experts with all E).
  std::vector<ParamGeometry> geometries() const;

  // Every parameter's optimizer, or with expert parallelism the dense parameters'.
  DistOptimizer& all_ranks() { return *dense_; }
  const DistOptimizer& all_ranks() const { return *dense_; }
  // The expert parameters' (null without expert parallelism).
  DistOptimizer* experts() { return experts_.get(); }
  bool expert_parallel() const { return experts_ != nullptr; }

 private:
  Communicator* world_;
  Communicator* ep_ = nullptr;
  std::unique_ptr<DistOptimizer> dense_;
  std::unique_ptr<DistOptimizer> experts_;
  std::vector<std::pair<bool, int>> where_;  // (P) model param -> (expert?, index there)
  DeviceBuffer norm_;                         // (1) F64: the world's sum of squares
};

}  // namespace packmoe
