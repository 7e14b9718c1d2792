// GroupedParam: the packed expert weight (E, N, K) of one grouped linear: its primary weight in the
// recipe's format (the copies belong to its LinearRecipe), the FP32 main_grad and, until an
// optimizer takes over, the FP32 init. The FP32 masters and moments belong to the optimizer
// (dist/dist_optimizer.h, sharded over 1..N ranks), which makes them from the init. Invariants:
// every low-precision copy comes from ONE quantize call over all E experts (or, in a
// data-parallel gather, one per rank's row range, with the same bytes); per-expert views are
// pointers into storage they do not own; both layouts feed the same ops.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "core/tensor.h"
#include "nn/grouped_storage.h"
#include "nn/linear_recipe.h"
#include "nn/recipe.h"

namespace packmoe {

// What the param keeps of its FP32 value. Transitions: kInitHeld -> kReleased (release_init) or
// -> kReplicated (keep_fp32_replica), once, when an optimizer takes the master from the init.
enum class Fp32State {
  kInitHeld,  // the FP32 init is kept; no optimizer holds a master of it yet
  kReleased,  // the optimizer holds the master; no FP32 copy is kept here
  // The optimizer holds the master, and this param keeps a full FP32 copy that the optimizer's
  // gather refreshes: for layers that read the FP32 weight itself (norms, the embedding table:
  // nn/layer_ops.h f32_weight).
  kReplicated,
};
std::string_view fp32_state_name(Fp32State s);

// Whether the primary weight was made from the latest master. Only the optimizer that holds the
// master makes it stale: its step updates the master, and its parameter gather writes the primary.
enum class PrimaryState {
  kCurrent,         // made from the init or the latest master
  kAwaitingGather,  // the master moved on; the gather has not written the primary yet
};

// Whether main_grad holds every gradient the layer has computed.
enum class GradState {
  kSettled,       // nothing owed
  kWgradPending,  // a delayed wgrad is queued (GroupedLinear::backward_dw pays it)
};

// What the next gradient write does to main_grad. Transitions: kAdd -> kOverwrite
// (expect_grad_overwrite: the grad buffer's owner left the previous step's gradients there instead
// of zeroing them) -> kAdd (take_grad_write: the first writer of the next backward writes).
enum class GradWrite {
  kAdd,        // writers add into main_grad
  kOverwrite,  // main_grad holds stale values: the next writer writes every element
};

// Who owns main_grad's memory. Transition: kOwned -> kBound (bind_main_grad), once.
enum class GradBinding {
  kOwned,  // the param's own storage; zero_grad() zeroes it
  kBound,  // views of the optimizer's grad buffer, zeroed only by its state machine (dist/)
};

// Whether the compute copies the GEMMs read match the current weight (high-precision primary
// with a quantized recipe re-quantizes at every forward; every other case is always current).
enum class ComputeCopyState { kStale, kCurrent };

class GroupedParam {
 public:
  // init: (E, N, K) F32 on the host or in `backend`'s memory. It is copied into `backend`'s
  // memory (one upload of a host init) and kept there until an optimizer takes it. The primary
  // weight is made from it now: bf16(init) (RNE), quantized once over the pack.
  GroupedParam(Backend& backend, const QuantRecipe& recipe, PrimaryWeight primary, Layout layout,
               const Tensor& init);
  GroupedParam(const GroupedParam&) = delete;
  GroupedParam& operator=(const GroupedParam&) = delete;

  Backend& backend() const { return *backend_; }
  const QuantRecipe& recipe() const { return recipe_; }
  PrimaryWeight primary() const { return primary_; }
  Layout layout() const { return layout_; }
  int64_t experts() const { return e_; }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  Fp32State fp32_state() const { return fp32_state_; }
  GradState grad_state() const { return grad_state_; }
  ComputeCopyState compute_state() const { return compute_state_; }
  PrimaryState primary_state() const { return primary_state_; }
  GradBinding grad_binding() const { return grad_binding_; }
  GradWrite grad_write() const { return grad_write_; }

  // main_grad = 0. A pending delayed wgrad would be lost, and a bound main_grad is zeroed by its
  // buffer's owner only: PACKMOE_CHECK errors.
  void zero_grad();
  // Bound main_grad only (the grad buffer's state machine, dist/dist_optimizer.h): its contents
  // are stale, so the next backward's first write overwrites instead of adding. kAdd -> kOverwrite.
  void expect_grad_overwrite();
  // Every writer of main_grad calls this once before it writes: kOverwrite means write (every
  // element, zeros where there is no gradient), kAdd means add. Leaves kAdd.
  GradWrite take_grad_write();
  // Called by forward: a high-precision primary under a quantized recipe is quantized for compute
  // (one call over the pack); otherwise nothing to do.
  void prepare_compute();

  // ---- the optimizer's side: the master it holds, and the parameter gather (dist/) -----------
  // Rows of one quantization block of the weight along N (MXFP8 32, NVFP4 16, BF16 1): a shard
  // boundary inside the pack falls on a multiple of it, so a rank quantizes its rows alone.
  int64_t shard_unit_rows() const;
  // dst (count F32, the backend's memory) = elements [begin, begin + count) of the flat (E*N*K)
  // init (kInitHeld only): what the optimizer's master is made from.
  void copy_init(int64_t begin, int64_t count, float* dst) const;
  // kInitHeld -> kReleased: the init is freed; the optimizer holds the master from now on.
  void release_init();
  // kInitHeld -> kReplicated: the init stays as the FP32 weight its layer reads; from now on only
  // write_fp32_replica changes it, and fp32_weight() is an error while the replica awaits its
  // gather (PrimaryState).
  void keep_fp32_replica();
  // kReplicated: the full FP32 copy = f32 (E*N*K F32, the backend's memory).
  void write_fp32_replica(const float* f32);
  // kReplicated: the replica becomes E views (N*K F32 each; consecutive in kSingle) of memory the
  // caller owns, the optimizer's FP32 gather buffer, so its gather refreshes the replica in place
  // (write_fp32_replica of those views copies nothing); the own copy is freed. Only while the
  // replica awaits its gather.
  void bind_fp32_replica(const std::vector<void*>& views);
  // kReplicated: the primary from the replica, as from any FP32 value: bf16 (RNE), then the
  // recipe's quantization (what a BF16 gather of this param would bring, without the traffic).
  // -> kCurrent.
  void write_primary_from_replica();
  // main_grad becomes E views (N*K F32 each; consecutive in kSingle) of memory the caller owns, a
  // data-parallel grad buffer; the param's own main_grad is freed (kOwned -> kBound). Needs no
  // pending wgrad.
  void bind_main_grad(const std::vector<void*>& views);
  // The BF16 param (keeps_bf16() only) becomes E views (N*K BF16 each; consecutive in kSingle) of
  // memory the caller owns, the optimizer's BF16 gather image: the gather then writes the primary
  // in place, and write_primary_from_bf16 of those same views copies nothing. The param's own BF16
  // storage is freed. Only while the primary awaits its gather (the image holds the newer bytes).
  void bind_bf16_primary(const std::vector<void*>& views);
  // kCurrent -> kAwaitingGather (kReleased or kReplicated): forward (fprop_weight, dgrad_weight,
  // prepare_compute, and fp32_weight() of a replica) is an error until a write_primary_from_*
  // call.
  void mark_primary_awaiting_gather();
  // The primary from a BF16 (E, N, K) image (views of any layout): a copy into the BF16 param, or
  // ONE quantize launch over the pack. -> kCurrent. amax (needs_global_amax() only, else null):
  // the image's (E,) per-expert amax when the caller has it (the bytes are the same as without).
  void write_primary_from_bf16(const GroupedStorage& bf16, const float* amax = nullptr);

  // What a low-precision gather carries per element of the pack, in image order: the BF16 param
  // (high-precision primary or bf16 recipe) {bf16}; MXFP8 2D {row_data, row_scale}; MXFP8 1D
  // {row_data, row_scale, col_data, col_scale}; NVFP4 {row_data, row_scale} plus the (E,) amax.
  // The columnwise copy of 2D weights is derived after the gather (formats/weight_2d.h).
  std::vector<PackedComponent> packed_components() const;
  // NVFP4 low-precision primary: the per-expert amax must be agreed on before rows are quantized.
  bool needs_global_amax() const;
  // amax[e] (backend memory) = the amax of rows [r0, r1) of the flat (E*N, K) pack that lie in
  // expert e, for each expert they touch (others are not written). bf16_rows: (r1 - r0, K) BF16.
  // One launch. needs_global_amax() only.
  void rows_amax(const void* bf16_rows, int64_t r0, int64_t r1, float* amax) const;
  // Rows [r0, r1) (multiples of shard_unit_rows) of the flat (E*N, K) pack, given as BF16 rows
  // (r1 - r0, K), quantized exactly as the whole pack would be (NVFP4: with the global (E,)
  // amax) into images[c] of packed_components() at the rows' own offsets. One launch.
  void quantize_rows(const void* bf16_rows, int64_t r0, int64_t r1, const float* amax,
                     const std::vector<void*>& images) const;
  // The primary from whole images (+ NVFP4's (E,) amax): copies, the columnwise copy of 2D
  // weights derived in one launch. -> kCurrent.
  void write_primary_from_packed(const std::vector<const void*>& images, const float* amax);

  // Per-expert operands of the grouped GEMM (table in backend/ops/gemm.h). Need current
  // compute copies. The pointers stay valid until the primary is next written / prepare_compute.
  GemmOperand fprop_weight() const;  // W rowwise
  GemmOperand dgrad_weight() const;  // W columnwise

  // (E, N, K) F32: the init (kInitHeld) or the current replica (kReplicated): the FP32 weight
  // that norms and the embedding read.
  const GroupedStorage& fp32_weight() const;
  const GroupedStorage& main_grad() const { return main_grad_; }  // (E, N, K) F32
  // The primary weight's components (the BF16 param, or the quantized copies of a low-precision
  // primary) plus a high-precision primary's compute copies while they are current; for byte
  // comparisons and checkpoints.
  std::vector<NamedStorage> weight_components() const;

  // The recipe's weight copies and activation quantization (GroupedLinear's too).
  const LinearRecipe& recipe_ops() const { return *ops_; }
  // Whether the primary or the compute input is the BF16 param: the bf16 recipe, or a
  // high-precision primary.
  bool keeps_bf16() const { return !quantized() || primary_ == PrimaryWeight::kHighPrecision; }

 private:
  friend class GroupedLinear;  // the only writer of main_grad and producer of delayed wgrads
  void mark_wgrad_pending();
  void mark_wgrad_settled();

  bool quantized() const { return ops_->quantized(); }
  void write_primary_from(const GroupedStorage& f32);  // (E, N, K) F32 -> primary weight
  void check_primary_current(const char* what) const;
  // Rows [r0, r1) of the flat (E*N, K) pack as groups of whole experts' row ranges (BF16 input
  // at bf16_rows); first_expert receives the expert of group 0.
  GroupedMatrices row_groups(const void* bf16_rows, int64_t r0, int64_t r1,
                             int64_t& first_expert) const;

  Backend* backend_;
  QuantRecipe recipe_;
  PrimaryWeight primary_;
  Layout layout_;
  int64_t e_, n_, k_;
  Fp32State fp32_state_ = Fp32State::kInitHeld;
  GradState grad_state_ = GradState::kSettled;
  ComputeCopyState compute_state_ = ComputeCopyState::kStale;
  PrimaryState primary_state_ = PrimaryState::kCurrent;
  GradBinding grad_binding_ = GradBinding::kOwned;
  GradWrite grad_write_ = GradWrite::kAdd;

  GroupedStorage fp32_;       // (E, N, K) F32, the backend's memory: the init, then the replica
  GroupedStorage main_grad_;  // (E, N, K) F32
  GroupedStorage bf16_;       // (E, N, K) BF16 param (bf16 recipe or high-precision primary)
  // The recipe; its copies are the primary (low precision) or compute copies (high precision).
  std::unique_ptr<LinearRecipe> ops_;
};

}  // namespace packmoe
