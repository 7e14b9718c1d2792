// DistOptimizer: ZeRO-1 AdamW over GroupedParams. Gradients accumulate in one flat FP32 buffer
// (GradBuffer, laid out by a ShardPlan) that every param's main_grad views; a step reduce-scatters
// it, takes the global grad norm, updates the FP32 masters and moments of this rank's shard only,
// and stages the shard for the parameter all-gather, which the next prepare_forward runs in one of
// three modes. It owns the FP32 masters and moments for any rank count (one process: a 1-rank
// communicator, dist/single_rank_communicator.h). Invariants: masters come from the params' FP32
// inits, never from dequantized values; all three modes write bitwise the same primary weights; every use of the buffer's memory
// is a checked GradBufferState transition; ops go through Backend and Communicator only, so the
// same code runs on the CPU over MPI and on GPUs over NCCL.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/device_buffer.h"
#include "dist/communicator.h"
#include "dist/grad_buffer.h"
#include "dist/optimizer_state.h"
#include "dist/shard_plan.h"
#include "nn/grouped_param.h"
#include "optim/adamw.h"

namespace packmoe {

// How updated parameters reach every rank (docs/dist.md has the bytes per element).
enum class GatherMode : uint8_t {
  kBf16,             // all-gather BF16 shards; every rank quantizes each whole pack (one launch)
  kLowp,             // each rank quantizes its rows; the quantized bytes and scales are gathered
  kReuseGradBuffer,  // as kBf16, through the grad buffer's memory (no gather buffer)
};
std::string_view gather_mode_name(GatherMode m);           // "bf16", "lowp", "reuse-grad-buffer"
Result<GatherMode> parse_gather_mode(std::string_view s);  // the names above

struct DistOptimizerConfig {
  AdamWConfig adamw;
  GatherMode gather = GatherMode::kBf16;
  int64_t bucket_elems = int64_t{1} << 24;  // reduce-scatter unit: 64 MiB of FP32
};

// What the param's layer reads in forward and backward.
enum class WeightForm : uint8_t {
  kPrimary,  // the primary weight (BF16 or quantized): gathered in the optimizer's mode
  // The FP32 weight itself (norms, the embedding table: nn/layer_ops.h f32_weight): every rank
  // keeps a full FP32 replica (Fp32State::kReplicated), refreshed by an FP32 all-gather; its
  // primary (a tied LM head's GEMM weight) is made from the replica on every rank, not gathered.
  kFp32,
};

struct DistParam {
  GroupedParam* param;
  bool weight_decay;  // false: decay = 1 exactly (norms)
  WeightForm form = WeightForm::kPrimary;
};

struct DistStepResult {
  double grad_norm = 0;  // of the summed gradient, before clipping
  float clip_scale = 1;  // what the gradient was multiplied by (1: not clipped)
  bool applied = false;  // false: non-finite norm; nothing was updated
};

// Collective traffic of one step's parameter gather on this job (the same on every rank).
struct GatherTraffic {
  int64_t all_gather_bytes = 0;  // the gathered buffers' sizes: what all ranks contribute together
  int64_t all_reduce_bytes = 0;  // lowp and bf16 NVFP4: the per-expert amax (F32 each)
  int64_t fp32_bytes = 0;        // of all_gather_bytes: the FP32 replicas (WeightForm::kFp32)
  int64_t param_elements = 0;    // parameters' elements, no padding
  int64_t reduce_scatter_bytes = 0;  // the step's reduce-scatter: the FP32 grad buffer, padded
  double bytes_per_element() const {
    return static_cast<double>(all_gather_bytes) / static_cast<double>(param_elements);
  }
};

class DistOptimizer {
 public:
  // Every param: in comm.backend()'s memory, no pending wgrad, its FP32 init still held (under
  // no other optimizer). Binds every main_grad into the grad buffer (its old content is
  // dropped), copies this rank's master shard from the inits, frees the params' inits (kFp32
  // params keep theirs as their replica), and stages the masters, so the first prepare_forward
  // gathers them (every rank then holds the same weights). Collective: every rank, same params.
  DistOptimizer(Communicator& comm, std::vector<DistParam> params, const DistOptimizerConfig& cfg);
  DistOptimizer(const DistOptimizer&) = delete;
  DistOptimizer& operator=(const DistOptimizer&) = delete;

  // The loss scale of each micro-batch's backward when every rank runs `micro_batches` of them:
  // 1 / (micro_batches * world size). The reduce-scatter is a plain sum, so the result is the mean
  // over all micro-batches of the job, with the bits of one rank accumulating them all (MPI).
  float loss_scale(int64_t micro_batches) const;

  // Before ANY forward (training, eval, export): finishes the parameter sync, whatever is left of
  // it: the gather (ParamsStaged -> ParamsGathered), then the zeroing (ParamsGathered -> Zeroed);
  // nothing in Zeroed or Accumulating. Collective when it gathers (every rank reaches the same
  // point).
  void prepare_forward();
  // ParamsStaged -> ParamsGathered: the all-gather, and every primary weight written from it. In
  // reuse-grad-buffer mode the parameters now fill the grad buffer; the only way back to
  // gradients is prepare_forward's zeroing. Collective.
  void gather_params();
  // Before each backward: Zeroed | Accumulating -> Accumulating (anything else aborts).
  // `last_of_step`: no further backward runs before step(), so grad_ready may start each bucket's
  // reduce-scatter as soon as its gradients are final (overlapped with the rest of backward).
  void prepare_backward(bool last_of_step = false);
  // Param p's gradient of the current backward is final (its last write queued on the backend).
  // After prepare_backward(true), the last param of a bucket to become final launches that
  // bucket's reduce-scatter (GradBuffer::reduce_scatter_bucket); otherwise nothing. The result is
  // bitwise the same as reducing every bucket in step(): the same calls on the same bytes.
  void grad_ready(int p);
  // Accumulating -> Reduced -> ParamsStaged (or -> Zeroed when the norm is not finite): the
  // reduce-scatter of the buckets grad_ready has not launched, the global norm (all-reduce of
  // this shard's FP64 sum of squares), the clip scale min(1, max_norm / (norm + 1e-6))
  // (max_norm <= 0: no clipping), AdamW on the shard, staging for the gather. A delayed wgrad
  // still pending on a param is a PACKMOE_CHECK error. Collective.
  DistStepResult step(double max_norm = 0.0);
  // step() in parts, for optimizers that share one global norm (expert parallelism: the dense
  // params' optimizer over all ranks and the experts' over the expert-data-parallel ranks):
  // reduce_gradients (Accumulating -> Reduced: the reduce-scatter of the buckets not launched yet;
  // collective), shard_sum_squares (this rank's shard's FP64 sum of squares of the reduced
  // gradient, on the host; no communication), apply (clip by grad_norm, AdamW, staging: ->
  // ParamsStaged, or -> Zeroed when grad_norm is not finite).
  void reduce_gradients();
  double shard_sum_squares();
  DistStepResult apply(double grad_norm, double max_norm);
  void set_lr(float lr) { cfg_.adamw.lr = lr; }
  float lr() const { return cfg_.adamw.lr; }
  int64_t steps() const { return steps_; }

  // ---- state (Zeroed or ParamsStaged only: not in the middle of a step) ----------------------
  // This rank's shard, to save as one file per rank; no communication.
  OptimizerShard shard_state() const;
  // Collective: every rank receives the whole state, per parameter (e.g. for HF weights).
  FullOptimizerState gather_state();
  // Takes this rank's shard of a state saved by any world size, then stages the masters
  // (-> ParamsStaged), so the next prepare_forward rebuilds every primary from them. Errors
  // (Status, nothing changed): parameters that differ from this optimizer's.
  Status load_state(const FullOptimizerState& state);

  // ---- observation -----------------------------------------------------------------------------
  const ShardPlan& plan() const { return plan_; }
  GatherMode gather_mode() const { return cfg_.gather; }
  GradBufferState state() const { return grads_.state(); }
  const GradBuffer& grad_buffer() const { return grads_; }
  FlatRange shard() const { return plan_.shard(comm_->rank()); }
  std::vector<float> master_shard() const;  // (shard size) F32, padding positions 0
  const GatherTraffic& traffic() const { return traffic_; }

 private:
  // A gather buffer: one component of the params that have it, laid out by gather_slots
  // (dist/shard_plan.h), so each rank's bytes are one contiguous range.
  struct GatherClass : GatherSlots {
    std::vector<int64_t> counts;  // (world) bytes each rank contributes
    std::optional<DeviceBuffer> buffer;
  };

  void check_between_steps(const char* what) const;
  // The global norm of the reduced gradient: N ranks sum their shard's squares (one call) and
  // all-reduce; one rank sums per parameter in params order (optim/grad_clip.h, what a single
  // process has always computed: a shard-wide call chunks the elements differently, so its
  // rounding differs).
  double shard_grad_norm();
  double single_rank_grad_norm() const;
  void shard_squares_into_norm();  // norm_ = this rank's shard's FP64 sum of squares
  double norm_value() const;        // norm_ on the host
  // masters -> the mode's gather source; params await the gather. image_written: AdamW already
  // wrote the BF16 image (the BF16 gather after a step).
  void stage(bool image_written = false);
  // ratio[p] = {num, den} bytes per element of param p's component; {0, 1}: p has none. The
  // class owns a zeroed buffer unless `allocate` is false (reuse-grad-buffer: the grad buffer).
  // Each param's slot starts `align`-byte aligned in it.
  GatherClass make_class(const std::vector<std::pair<int64_t, int64_t>>& ratio,
                         bool allocate, int64_t align);
  // {2, 1} for params whose primary travels, {0, 1} for WeightForm::kFp32 ones (theirs is made
  // from the gathered replica).
  std::vector<std::pair<int64_t, int64_t>> bf16_ratio() const;
  void build_lowp_layout();
  // The per-expert amax slices of the NVFP4 params (amax_offset_, amax_count_, amax_).
  void build_amax_layout();
  // Byte position in a class buffer of flat buffer position `flat` (a legal shard boundary).
  int64_t class_position(const GatherClass& cls, int64_t flat) const;
  // Param p's E expert views (N*K elements of elem_bytes each) in `base`, a buffer in cls's
  // layout.
  std::vector<void*> slot_views(const GatherClass& cls, const uint8_t* base, int p,
                                size_t elem_bytes) const;
  // Param p's full (E, N, K) FP32 after the gather (WeightForm::kFp32): its slot of fp32_, or on
  // one rank its slot of the master (the shard is the whole buffer).
  const float* replica_source(int p) const;
  // Param p's (E, N, K) BF16 in a class image (bf16_class_ layout).
  GroupedStorage bf16_views(const uint8_t* image, int p) const;
  // The shard's pieces of primary-form params, cast to BF16 at their class positions in `image`.
  void stage_bf16_image(uint8_t* image);
  void cast_shard_to_bf16(uint16_t* dst);  // (shard size) BF16

  Communicator* comm_;
  Backend* be_;
  DistOptimizerConfig cfg_;
  std::vector<DistParam> params_;
  ShardPlan plan_;
  GradBuffer grads_;
  std::vector<ShardPiece> pieces_;  // this rank's, buffer order
  DeviceBuffer master_;             // (shard size) F32
  // (shard size) F32 each; made once the params have released their inits (the start-up peak).
  std::optional<DeviceBuffer> exp_avg_, exp_avg_sq_;
  DeviceBuffer norm_;               // (1) F64
  int64_t steps_ = 0;
  GatherTraffic traffic_;
  // Overlap: the bucket of each param, and per bucket the params whose gradient is not final yet
  // in the step's last backward (armed by prepare_backward(true)).
  std::vector<size_t> bucket_of_;    // (P)
  std::vector<int> bucket_params_;   // (buckets) params per bucket
  std::vector<int> bucket_waiting_;  // (buckets) while armed
  std::vector<bool> param_ready_;    // (P) while armed
  bool overlap_armed_ = false;

  // kBf16 / kReuseGradBuffer: the BF16 image of the primary-form params (kBf16: its own buffer;
  // reuse: laid out in the grad buffer's memory). kLowp: the shard's BF16 rows and one gather
  // buffer per component position. kLowp and kBf16: the per-expert amax of every NVFP4 param
  // ((sum E) F32; amax_offset[p] its slice, -1 for others); kBf16 takes it in AdamW's pass over
  // the image (image_amax_current_ until the next stage()), the quantizer after the gather reads
  // it instead of the image. WeightForm::kFp32 params travel only as replicas.
  std::optional<GatherClass> bf16_class_;
  std::optional<DeviceBuffer> shard_bf16_;
  std::optional<DeviceBuffer> amax_;
  std::vector<int64_t> amax_offset_;
  int64_t amax_count_ = 0;
  bool image_amax_current_ = false;
  std::vector<GatherClass> lowp_;
  // The FP32 replicas of WeightForm::kFp32 params (every mode), when there are any and more than
  // one rank.
  std::optional<GatherClass> fp32_;
};

}  // namespace packmoe
