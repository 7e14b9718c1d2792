// ParallelOptimizer: the dense and expert DistOptimizers and their shared norm
// (dist/parallel_optimizer.h).
#include "dist/parallel_optimizer.h"

#include <cmath>
#include <cstring>

namespace packmoe {

ParallelOptimizer::ParallelOptimizer(Communicator& world, Communicator* edp,
                                     const std::vector<DistParam>& params,
                                     const std::vector<bool>& expert,
                                     const DistOptimizerConfig& cfg)
    : world_(&world), norm_(world.backend(), sizeof(double)) {
  PACKMOE_CHECK(expert.size() == params.size(), "ParallelOptimizer: an expert flag per param");
  PACKMOE_CHECK(edp == nullptr || &edp->backend() == &world.backend(),
                "ParallelOptimizer: both communicators on one backend");
  std::vector<DistParam> dense, experts;
  for (size_t p = 0; p < params.size(); ++p) {
    const bool e = edp != nullptr && expert[p];
    std::vector<DistParam>& into = e ? experts : dense;
    where_.emplace_back(e, static_cast<int>(into.size()));
    into.push_back(params[p]);
  }
  dense_ = std::make_unique<DistOptimizer>(world, std::move(dense), cfg);
  if (edp != nullptr) {
    PACKMOE_CHECK(!experts.empty(), "ParallelOptimizer: expert parallelism without expert params");
    experts_ = std::make_unique<DistOptimizer>(*edp, std::move(experts), cfg);
  }
}

void ParallelOptimizer::prepare_forward() {
  dense_->prepare_forward();
  if (experts_) experts_->prepare_forward();
}

void ParallelOptimizer::prepare_backward(bool last_of_step) {
  dense_->prepare_backward(last_of_step);
  if (experts_) experts_->prepare_backward(last_of_step);
}

void ParallelOptimizer::grad_ready(int p) {
  const auto [e, i] = where_[static_cast<size_t>(p)];
  (e ? *experts_ : *dense_).grad_ready(i);
}

void ParallelOptimizer::set_lr(float lr) {
  dense_->set_lr(lr);
  if (experts_) experts_->set_lr(lr);
}

DistStepResult ParallelOptimizer::step(double max_norm) {
  if (!experts_) return dense_->step(max_norm);
  dense_->reduce_gradients();
  experts_->reduce_gradients();
  // Every rank's shards of both cover each gradient element once: the dense buffer is sharded over
  // the world, each EP rank's experts over its expert-data-parallel group.
  const double mine = dense_->shard_sum_squares() + experts_->shard_sum_squares();
  norm_.upload({reinterpret_cast<const uint8_t*>(&mine), sizeof mine});
  world_->all_reduce(static_cast<double*>(norm_.get()), static_cast<double*>(norm_.get()), 1,
                     ReduceOp::kSum);
  double sum = 0;
  std::memcpy(&sum, norm_.download().data(), sizeof sum);
  const double norm = std::sqrt(sum);
  DistStepResult r = dense_->apply(norm, max_norm);
  const DistStepResult e = experts_->apply(norm, max_norm);
  r.applied = r.applied && e.applied;
  return r;
}

}  // namespace packmoe
