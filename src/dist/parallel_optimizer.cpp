// ParallelOptimizer: the dense and expert DistOptimizers and their shared norm
// (dist/parallel_optimizer.h).
#include "dist/parallel_optimizer.h"

#include <cmath>
#include <cstring>

namespace packmoe {

ParallelOptimizer::ParallelOptimizer(Communicator& world, Communicator* ep, Communicator* edp,
                                     const std::vector<DistParam>& params,
                                     const std::vector<bool>& expert,
                                     const DistOptimizerConfig& cfg)
    : world_(&world), ep_(ep), norm_(world.backend(), sizeof(double)) {
  PACKMOE_CHECK(expert.size() == params.size(), "ParallelOptimizer: an expert flag per param");
  PACKMOE_CHECK((ep == nullptr) == (edp == nullptr),
                "ParallelOptimizer: both expert-parallel communicators or neither");
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

namespace {

// The (count) floats of every rank of `comm`, in rank order.
std::vector<float> gather_floats(Communicator& comm, const std::vector<float>& mine) {
  const int64_t bytes = static_cast<int64_t>(mine.size() * sizeof(float));
  DeviceBuffer in(comm.backend(), static_cast<size_t>(bytes));
  in.upload({reinterpret_cast<const uint8_t*>(mine.data()), static_cast<size_t>(bytes)});
  DeviceBuffer out(comm.backend(), static_cast<size_t>(bytes) * comm.size());
  comm.all_gather(in.get(), out.get(), bytes);
  const std::vector<uint8_t> all = out.download();
  std::vector<float> f(mine.size() * comm.size());
  if (!f.empty()) std::memcpy(f.data(), all.data(), all.size());
  return f;
}

}  // namespace

std::vector<ParamGeometry> ParallelOptimizer::geometries() const {
  std::vector<ParamGeometry> g;
  const std::vector<ParamGeometry> dense = dense_->plan().geometries();
  const std::vector<ParamGeometry> experts =
      experts_ ? experts_->plan().geometries() : std::vector<ParamGeometry>{};
  for (const auto& [e, i] : where_) {
    ParamGeometry p = e ? experts[i] : dense[i];
    if (e) p.experts *= ep_->size();
    g.push_back(p);
  }
  return g;
}

FullOptimizerState ParallelOptimizer::gather_state() {
  if (!experts_) return dense_->gather_state();
  const FullOptimizerState dense = dense_->gather_state();
  const FullOptimizerState local = experts_->gather_state();
  FullOptimizerState full;
  full.steps = dense.steps;
  full.params = geometries();
  for (const auto& [e, i] : where_) {
    if (!e) {
      full.master.push_back(dense.master[i]);
      full.exp_avg.push_back(dense.exp_avg[i]);
      full.exp_avg_sq.push_back(dense.exp_avg_sq[i]);
      continue;
    }
    // EP rank r holds experts [r * E_local, (r + 1) * E_local): rank order is expert order.
    full.master.push_back(gather_floats(*ep_, local.master[i]));
    full.exp_avg.push_back(gather_floats(*ep_, local.exp_avg[i]));
    full.exp_avg_sq.push_back(gather_floats(*ep_, local.exp_avg_sq[i]));
  }
  return full;
}

Status ParallelOptimizer::load_state(const FullOptimizerState& state) {
  if (!experts_) return dense_->load_state(state);
  if (state.params != geometries())
    return Status::error(
        "optimizer state: its parameters (shapes or quantization blocks) differ from this "
        "model's");
  for (const auto* v : {&state.master, &state.exp_avg, &state.exp_avg_sq})
    if (v->size() != where_.size())
      return Status::error("optimizer state: one tensor per parameter expected");
  FullOptimizerState dense, local;
  dense.steps = local.steps = state.steps;
  dense.params = dense_->plan().geometries();
  local.params = experts_->plan().geometries();
  const int64_t rank = ep_->rank(), ranks = ep_->size();
  for (size_t p = 0; p < where_.size(); ++p) {
    const bool e = where_[p].first;
    FullOptimizerState& into = e ? local : dense;
    auto part = [&](const std::vector<float>& all) {
      if (!e) return all;
      const size_t per_rank = all.size() / static_cast<size_t>(ranks);
      return std::vector<float>(all.begin() + rank * per_rank, all.begin() + (rank + 1) * per_rank);
    };
    into.master.push_back(part(state.master[p]));
    into.exp_avg.push_back(part(state.exp_avg[p]));
    into.exp_avg_sq.push_back(part(state.exp_avg_sq[p]));
  }
  PACKMOE_RETURN_IF_ERROR(dense_->load_state(dense));
  return experts_->load_state(local);
}

}  // namespace packmoe
