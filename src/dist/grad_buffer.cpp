// GradBuffer: transitions, bucketed in-place reduce-scatter, zeroing.
#include "dist/grad_buffer.h"

#include <algorithm>

namespace packmoe {

std::string_view grad_buffer_state_name(GradBufferState s) {
  switch (s) {
    case GradBufferState::kZeroed:
      return "Zeroed";
    case GradBufferState::kAccumulating:
      return "Accumulating";
    case GradBufferState::kReduced:
      return "Reduced";
    case GradBufferState::kParamsStaged:
      return "ParamsStaged";
    case GradBufferState::kParamsGathered:
      return "ParamsGathered";
  }
  return "?";
}

bool grad_buffer_transition_legal(GradBufferState from, GradBufferState to) {
  using S = GradBufferState;
  switch (from) {
    case S::kZeroed:
      return to == S::kAccumulating || to == S::kParamsStaged;
    case S::kAccumulating:
      return to == S::kAccumulating || to == S::kReduced;
    case S::kReduced:
      return to == S::kParamsStaged || to == S::kZeroed;
    case S::kParamsStaged:
      return to == S::kParamsStaged || to == S::kParamsGathered;
    case S::kParamsGathered:
      return to == S::kZeroed;
  }
  return false;
}

GradBuffer::GradBuffer(Communicator& comm, const ShardPlan& plan)
    : comm_(&comm), plan_(&plan), buffer_(comm.backend(), plan.total() * sizeof(float)) {
  PACKMOE_CHECK(plan.world_size() == comm.size(),
                "a plan for " << plan.world_size() << " ranks on " << comm.size());
  fill_zero();
}

void GradBuffer::advance(GradBufferState to, std::string_view event) {
  PACKMOE_CHECK(grad_buffer_transition_legal(state_, to),
                "grad buffer: illegal transition " << grad_buffer_state_name(state_) << " -> "
                                                   << grad_buffer_state_name(to) << " (" << event
                                                   << ")");
  state_ = to;
}

void GradBuffer::reduce_scatter() {
  advance(GradBufferState::kReduced, "step: reduce-scatter");
  const FlatRange mine = shard();
  for (size_t b = 0; b < plan_->buckets().size(); ++b) {
    const FlatRange bk = plan_->buckets()[b];
    const std::vector<int64_t> counts = plan_->bucket_counts(b);
    // In place: this rank's part of the bucket sits at its prefix offset within the bucket.
    const int64_t mine_begin = std::max(bk.begin, std::min(mine.begin, bk.end));
    comm_->reduce_scatterv(data() + bk.begin, data() + mine_begin, counts);
  }
}

void GradBuffer::fill_zero() { comm_->backend().fill_zero(buffer_.get(), buffer_.size()); }

}  // namespace packmoe
