// GroupedLinear: per expert g, Y_g (m_g, N) = X_g (m_g, K) . W_g^T over a packed GroupedParam, with
// explicit forward / backward (no autograd); the wgrad lands in the param's FP32 main_grad.
// Invariants: each activation is quantized by ONE call over all groups; the layer's state
// machine (Idle -> ForwardDone -> [WgradPending] -> Idle) makes a lost or doubled wgrad a
// PACKMOE_CHECK error; both layouts issue identical ops, so their results are bitwise equal.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "core/tensor.h"
#include "nn/grouped_param.h"
#include "nn/recipe.h"

namespace packmoe {

enum class LinearState {
  kIdle,          // nothing saved
  kForwardDone,   // X's wgrad copy and the token counts are saved for backward
  kWgradPending,  // backward ran dgrad; the wgrad is queued for backward_dw (delay_wgrad)
};

// What the wgrad does to main_grad. kOverwrite is for the first micro-batch of a step (no
// zero_grad needed); experts without tokens then get zeros.
enum class GradAccum { kAccumulate, kOverwrite };

struct GroupedLinearConfig {
  QuantRecipe recipe;
  PrimaryWeight primary = PrimaryWeight::kHighPrecision;
  Layout layout = Layout::kSingle;
  // ON: the wgrad GEMM writes main_grad itself (beta = 1 when accumulating). OFF: it writes a
  // separate FP32 grad (E, N, K) that is then added (or, for kOverwrite, copied) into main_grad.
  bool grad_accum_fusion = true;
  bool delay_wgrad = false;         // backward queues the wgrad; backward_dw() runs it
  DType out_dtype = DType::kBF16;   // y and dx: kBF16 or kF32
};

class GroupedLinear {
 public:
  // init: (E, N, K) F32 on the host or in `backend`'s memory (GroupedParam keeps it until an
  // optimizer takes it).
  GroupedLinear(Backend& backend, const GroupedLinearConfig& cfg, const Tensor& init);
  GroupedLinear(const GroupedLinear&) = delete;
  GroupedLinear& operator=(const GroupedLinear&) = delete;

  GroupedParam& param() { return param_; }
  const GroupedParam& param() const { return param_; }
  const GroupedLinearConfig& config() const { return cfg_; }
  LinearState state() const { return state_; }
  // SR offset the next dY quantization uses: it advances by the M * N / 16 blocks each call draws.
  uint64_t grad_sr_offset() const { return grad_sr_offset_; }
  // Sets it: a trainer, before each micro-batch, to nvfp4_grad_sr_offset of that micro-batch.
  void set_grad_sr_offset(uint64_t offset);

  // x: (M, K) BF16 in the backend's memory, expert g's m[g] rows after expert g-1's; m: (E,) host
  // token counts, each a multiple of token_alignment(recipe), summing to at most M. Returns y (M,
  // N) in out_dtype, its rows past the sum left unwritten (backward's dy and dx: the same M rows,
  // the rows past the sum never read). m may also hold S x E counts (S >= 1 sources, source-major:
  // group s * E + e is source s's rows for expert e, e.g. the tokens expert parallelism received
  // from S ranks): each group is its own GEMM group and quantization group, so a source's rows get
  // the bytes they get in a call of that source's alone, and the wgrad sums the sources in order s
  // = 0, 1, ... into main_grad (one wgrad per source: source 0 as `accum` says, the others
  // accumulating), the order of a rank-ordered sum of S per-source gradients. Allowed from kIdle
  // and kForwardDone (a forward never followed by backward, e.g. an eval step, is dropped); with a
  // wgrad pending it would be lost: PACKMOE_CHECK error.
  // BF16 recipe: an x that owns its memory is saved for the wgrad by reference, not copied, so
  // the caller must not write into it until the wgrad has run (backward, or backward_dw).
  Tensor forward(const Tensor& x, const std::vector<int64_t>& m);
  // The same with the counts in the backend's memory: x (C, K) holds expert g's m[g] rows after
  // g-1's, m_device (E,) I64 multiples of the alignment summing to at most C. The BF16 recipe
  // never waits on the host (the grouped GEMMs' m_device). A quantized recipe's activation
  // quantizers group rows by host counts, so it copies the counts to the host first (one wait).
  // Same bytes as forward(x, m) with the counts on the host.
  Tensor forward(const Tensor& x, const Tensor& m_device);
  // x that arrived as its recipe's rowwise copy (--dispatch-dtype recipe, nn/dispatch_payload.h):
  // p.rows (M, W) holds groups m (host counts, S x E as above) of K columns. The fprop reads the
  // payload's values, so y is bitwise forward(x, m)'s for the rows the payload was made from; the
  // wgrad's copy is quantized from the dequantized rows (LinearRecipe::received_input_copies).
  // Quantized recipes only; restore_input is refused after it (its copy would come from x, not
  // from the payload).
  Tensor forward_received(const DispatchPayload& p, const std::vector<int64_t>& m);
  // dy: (M, N) BF16 (M: x's rows). Returns dx (M, K) in out_dtype. Runs dgrad, and wgrad now (-> kIdle) or
  // queued (-> kWgradPending) per delay_wgrad, or queued whatever delay_wgrad says with
  // kQueued (a caller that first starts work the wgrad can run beside: MoEBlock's combine).
  // Only from kForwardDone. A queued BF16 wgrad holds dy by reference like x.
  enum class Wgrad { kAsConfigured, kQueued };
  Tensor backward(const Tensor& dy, GradAccum accum, Wgrad wgrad = Wgrad::kAsConfigured);
  // Runs the queued wgrad (-> kIdle). Only from kWgradPending: a second call is a doubled wgrad.
  void backward_dw();
  // Activation recomputation (nn/recompute.h), only in kForwardDone: release_input frees the
  // forward's saved copy of x; restore_input(x), x the same bytes recomputed, makes that copy
  // again (the same quantize call) before backward, which refuses to run without it.
  void release_input();
  void restore_input(const Tensor& x);

 private:
  Tensor run_forward(const Tensor& x);  // with m_ / m_device_ and rows_ set
  Tensor run_fprop();                   // with x_ set too
  void run_wgrad(GradAccum accum);
  // The saved forward's counts into a GEMM's args (m, or m_device with packed token operands).
  void set_counts(GroupedGemmArgs& a) const;
  // The token groups the activation copies and token-side pointers are carved by: m_, or one
  // group of all rows_ rows when the counts stay on the device.
  std::vector<int64_t> token_groups() const;
  // The weight operand for every group: the param's E experts, repeated S times (S > 1).
  GemmOperand weight_for_groups(GemmOperand w);

  Backend* backend_;
  GroupedLinearConfig cfg_;
  GroupedParam param_;
  LinearState state_ = LinearState::kIdle;
  uint64_t grad_sr_offset_ = 0;
  std::vector<int64_t> m_;  // (S * E,) token counts of the saved forward, on the host, or
  Tensor m_device_;         // (E,) I64 the same in the backend's memory (m_ empty)
  int64_t rows_ = 0;        // x's rows (>= the counts' sum)
  int64_t sources_ = 1;     // S: the counts' groups over the param's experts
  std::optional<DeviceBuffer> repeated_decode_;  // (S * E) F32: NVFP4 weight decode scales per group (S > 1)
  ActivationCopies x_;      // X (M, K): columnwise kept for wgrad
  bool input_released_ = false;  // release_input ran, restore_input not yet
  bool input_received_ = false;  // the saved forward's x came as a payload (forward_received)
  ActivationCopies dy_;     // dY (M, N): columnwise kept while the wgrad is queued
  GradAccum pending_accum_ = GradAccum::kAccumulate;
};

}  // namespace packmoe
