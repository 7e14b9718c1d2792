// GradBuffer: the one contiguous FP32 gradient buffer of data parallelism (laid out by a
// ShardPlan) and the explicit state machine that governs its memory, which the reuse-grad-buffer
// gather also uses to all-gather BF16 parameters. Invariants: every change of role is one checked
// transition of the table below (an illegal one aborts naming both states); gradients accumulate
// only into a buffer that was zeroed after its last other use, or are written over the gradients
// of the step before (never over a parameter image); alignment gaps stay zero; the reduce-scatter
// is a plain sum.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "backend/device_buffer.h"
#include "dist/communicator.h"
#include "dist/shard_plan.h"

namespace packmoe {

// The buffer's role. Legal transitions (event):
//   Zeroed         -> Accumulating   (prepare_backward)
//   Zeroed         -> ParamsStaged   (construction, load_state: masters staged for the gather)
//   Stale          -> Accumulating   (prepare_backward: every param's first write overwrites)
//   Stale          -> ParamsStaged   (load_state)
//   Accumulating   -> Accumulating   (prepare_backward of a further micro-batch)
//   Accumulating   -> Reduced        (step: reduce-scatter)
//   Reduced        -> ParamsStaged   (step: update applied, shard staged for the gather)
//   Reduced        -> Zeroed         (step skipped: non-finite grad norm)
//   ParamsStaged   -> ParamsStaged   (load_state)
//   ParamsStaged   -> ParamsGathered (gather_params, or prepare_forward: the all-gather)
//   ParamsGathered -> Zeroed         (prepare_forward: primaries written, buffer zeroed)
//   ParamsGathered -> Stale          (prepare_forward, when the gather did not use the buffer)
// So the only way from a parameter image in the buffer back to gradients is through zeroing
// (Megatron's reuse-grad-buffer bug skipped exactly that after an eval step); gradients of the
// step before are not zeroed but written over, which saves one pass over the buffer per step.
// The optimizer's step checks that the backward wrote every param (GradWrite, nn/grouped_param.h).
enum class GradBufferState : uint8_t {
  kZeroed,          // all zeros; the primary weights match the masters
  kStale,           // the step before's gradients (gaps zero); the primary weights match the masters
  kAccumulating,    // backward has added gradients of this step
  kReduced,         // this rank's shard holds the sum over ranks; the rest is stale
  kParamsStaged,    // the updated master shard is staged for the gather (reuse mode: in here)
  kParamsGathered,  // the parameters are all-gathered (reuse mode: as BF16 in here)
};
std::string_view grad_buffer_state_name(GradBufferState s);
bool grad_buffer_transition_legal(GradBufferState from, GradBufferState to);

class GradBuffer {
 public:
  // (plan.total()) F32 zeros in comm.backend()'s memory; state kZeroed.
  GradBuffer(Communicator& comm, const ShardPlan& plan);

  GradBufferState state() const { return state_; }
  // The checked transition: aborts with "grad buffer: illegal transition A -> B (event)".
  void advance(GradBufferState to, std::string_view event);

  float* data() const { return static_cast<float*>(buffer_.get()); }  // (total) F32
  // The first half of the bytes as BF16 (total): the reuse mode's parameter image.
  uint16_t* bf16_image() const { return static_cast<uint16_t*>(buffer_.get()); }
  int64_t size() const { return plan_->total(); }
  FlatRange shard() const { return plan_->shard(comm_->rank()); }

  // Overlap with backward: bucket b's sum over ranks into this rank's part of it, launched while
  // backward still runs (Accumulating; each bucket at most once per step) once every gradient in
  // it is final. Queued on the communicator's side stream after all backend work so far (host
  // communicators: done on return). From then on no further backward may start
  // (prepare_backward aborts) until reduce_scatter() ends the step's reduction.
  void reduce_scatter_bucket(size_t b);
  // Sum over ranks into this rank's shard, bucket by bucket (reduce_scatterv in place), the
  // buckets not launched yet on the backend stream, then the backend stream waits for the
  // launched ones: Accumulating -> Reduced.
  void reduce_scatter();
  bool reducing() const { return launched_count_ > 0; }  // some bucket launched this step
  // Every element = 0; the caller's transition says why.
  void fill_zero();
  std::vector<uint8_t> download() const { return buffer_.download(); }

 private:
  Communicator* comm_;
  const ShardPlan* plan_;
  DeviceBuffer buffer_;
  GradBufferState state_ = GradBufferState::kZeroed;
  std::vector<bool> launched_;  // (buckets) reduce-scattered ahead by reduce_scatter_bucket
  size_t launched_count_ = 0;

  void launch(size_t b, StreamHandle stream);  // bucket b's in-place reduce_scatterv
};

}  // namespace packmoe
