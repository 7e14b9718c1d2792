// GradBuffer: transitions, bucketed in-place reduce-scatter (ahead of the step, overlapped with
// backward, or in the step), zeroing.
#include "dist/grad_buffer.h"

#include <algorithm>

namespace packmoe {

std::string_view grad_buffer_state_name(GradBufferState s) {
  switch (s) {
    case GradBufferState::kZeroed:
      return "Zeroed";
    case GradBufferState::kStale:
      return "Stale";
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
    case S::kStale:
      return to == S::kAccumulating || to == S::kParamsStaged;
    case S::kAccumulating:
      return to == S::kAccumulating || to == S::kReduced;
    case S::kReduced:
      return to == S::kParamsStaged || to == S::kZeroed;
    case S::kParamsStaged:
      return to == S::kParamsStaged || to == S::kParamsGathered;
    case S::kParamsGathered:
      return to == S::kZeroed || to == S::kStale;
  }
  return false;
}

GradBuffer::GradBuffer(Communicator& comm, const ShardPlan& plan)
    : comm_(&comm),
      plan_(&plan),
      buffer_(comm.backend(), plan.total() * sizeof(float)),
      launched_(plan.buckets().size(), false) {
  PACKMOE_CHECK(plan.world_size() == comm.size(),
                "a plan for " << plan.world_size() << " ranks on " << comm.size());
  fill_zero();
}

void GradBuffer::advance(GradBufferState to, std::string_view event) {
  PACKMOE_CHECK(grad_buffer_transition_legal(state_, to),
                "grad buffer: illegal transition " << grad_buffer_state_name(state_) << " -> "
                                                   << grad_buffer_state_name(to) << " (" << event
                                                   << ")");
  PACKMOE_CHECK(!(to == GradBufferState::kAccumulating && reducing()),
                "grad buffer: " << event << " after " << launched_count_
                                << " bucket(s) began their reduce-scatter: that backward's "
                                   "gradients would be lost; only the step's last backward "
                                   "may start them");
  state_ = to;
}

void GradBuffer::launch(size_t b, StreamHandle stream) {
  const FlatRange bk = plan_->buckets()[b];
  const FlatRange mine = shard();
  const std::vector<int64_t> counts = plan_->bucket_counts(b);
  // In place: this rank's part of the bucket sits at its prefix offset within the bucket.
  const int64_t mine_begin = std::max(bk.begin, std::min(mine.begin, bk.end));
  comm_->reduce_scatterv(data() + bk.begin, data() + mine_begin, counts, stream);
}

void GradBuffer::reduce_scatter_bucket(size_t b) {
  PACKMOE_CHECK(state_ == GradBufferState::kAccumulating,
                "grad buffer: a bucket reduce-scatter in state " << grad_buffer_state_name(state_));
  PACKMOE_CHECK(b < launched_.size() && !launched_[b],
                "grad buffer: bucket " << b << " reduce-scattered twice in one step");
  comm_->side_waits_for_backend();  // its gradients' last writes are queued there
  launch(b, comm_->side_stream());
  launched_[b] = true;
  ++launched_count_;
}

void GradBuffer::reduce_scatter() {
  advance(GradBufferState::kReduced, "step: reduce-scatter");
  for (size_t b = 0; b < launched_.size(); ++b)
    if (!launched_[b]) launch(b, kBackendStream);
  if (launched_count_ > 0) comm_->backend_waits_for_side();
  launched_.assign(launched_.size(), false);
  launched_count_ = 0;
}

void GradBuffer::fill_zero() { comm_->backend().fill_zero(buffer_.get(), buffer_.size()); }

}  // namespace packmoe
