// MoEBlock: the Qwen3-MoE sparse MLP with explicit forward / backward. Router linear (E, H) ->
// softmax, top-k (+ load-balancing aux loss) -> permute (each expert padded to the recipe's token
// alignment) -> [TokenDispatcher::dispatch] -> FC1 (E, 2F, H) -> SwiGLU -> FC2 (E, H, F) ->
// [TokenDispatcher::combine] -> unpermute + combine (nn/token_dispatcher.h; local: the identity).
// Invariants: all arithmetic runs as Backend ops and with the BF16 recipe nothing waits on the
// host: the routing plan's counts and the aux loss stay in the backend's memory, and every row
// buffer is sized by routing_plan_max_rows (the GEMMs take the device counts; the row ops skip
// unused rows; a quantized recipe's quantizers need the counts on the host: one copy per
// forward, for FC1 and FC2, and the expert-parallel dispatcher has them anyway); the
// block's state machine (Idle -> ForwardDone -> [WgradPending] -> Idle) mirrors its linears'; both
// layouts issue identical ops, so their results are bitwise equal.
// Backward starts the combine of the dX rows (TokenDispatcher::start_combine) after FC1's dgrad,
// runs the router's backward and, under expert parallelism (overlaps_combine), the two expert
// wgrads beside that transfer (on one rank each wgrad follows its dgrad), and finishes the
// combine before the permute's backward reads the rows. A dispatcher whose dispatch_dtype() is
// kRecipe gets FC1's input as its recipe's rowwise payload (nn/dispatch_payload.h: the sender
// quantizes per expert), and FC1 runs from the received payload (GroupedLinear::forward_received).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/moe.h"
#include "core/tensor.h"
#include "nn/grouped_linear.h"
#include "nn/grouped_param.h"
#include "nn/recipe.h"
#include "nn/token_dispatcher.h"

namespace packmoe {

struct MoEBlockConfig {
  int64_t top_k = 2;            // k (num_experts_per_tok)
  bool norm_topk_prob = false;  // renormalise the k router weights to sum to 1
  // The aux loss enters the loss as aux_loss_coef * aux (router_aux_loss_coef); 0 turns it off
  // (Hugging Face's output_router_logits = false).
  float aux_loss_coef = 0.0f;
  // FC1 / FC2 only: the router is always BF16 with an FP32 master and FP32 logits. FC1 draws its
  // NVFP4 stochastic rounding from seed 2 * sr_seed, FC2 from 2 * sr_seed + 1, so the two never
  // share random bits.
  QuantRecipe recipe;
  PrimaryWeight primary = PrimaryWeight::kHighPrecision;  // FC1 / FC2
  Layout layout = Layout::kSingle;                        // all three params
  bool grad_accum_fusion = true;                          // all three linears
  bool delay_wgrad = false;  // FC1 / FC2 queue their wgrads for backward_dw; the router never does
  DType out_dtype = DType::kBF16;  // y: kBF16 or kF32
  // FC1 / FC2 outputs and their dgrads (h, yp, da, dxp): kBF16 as in TransformerEngine, or kF32
  // (fewer roundings, for gradient checks). GEMM operands are BF16 (or quantized) either way.
  DType activation_dtype = DType::kBF16;
};

// Initial weights, F32, on the host or in the backend's memory (each param keeps its copy until
// an optimizer takes it).
struct MoEBlockInit {
  Tensor router;  // (E, H)   Hugging Face mlp.gate.weight
  // The experts this block holds: all E, or (expert parallelism) a contiguous E_local of them.
  Tensor fc1;     // (E_local, 2F, H) gate rows [0, F), up rows [F, 2F) (mlp.experts.gate_up_proj)
  Tensor fc2;     // (E_local, H, F)  mlp.experts.down_proj
};

// The statistics the load-balancing aux loss is formed from (backend/ops/moe.h: counts C and
// probability sums P over T' tokens), in the backend's memory. A block alone adds only its own
// forward's (the one-layer loss); a Model gives every MoE layer one shared instance, so the loss is
// Hugging Face's single loss over all the layers' router outputs.
struct AuxLossStats {
  AuxLossStats(Backend& backend, int64_t experts);  // zeroed
  void reset(Backend& backend);                     // zeros C and P, T' = 0
  // aux (1,) F32 in the backend's memory from the statistics (ops::aux_loss). Needs tokens > 0.
  void loss(Backend& backend, float* aux) const;

  Tensor counts;       // (E) I64
  Tensor prob_sums;    // (E) F32
  int64_t tokens = 0;  // T', host
};

enum class BlockState {
  kIdle,          // nothing saved
  kForwardDone,   // routing, router outputs and expert activations saved for backward
  kWgradPending,  // backward ran; FC1 / FC2 wgrads queued for backward_dw (delay_wgrad)
};

class MoEBlock {
 public:
  MoEBlock(Backend& backend, const MoEBlockConfig& cfg, const MoEBlockInit& init);
  MoEBlock(const MoEBlock&) = delete;
  MoEBlock& operator=(const MoEBlock&) = delete;

  const MoEBlockConfig& config() const { return cfg_; }
  BlockState state() const { return state_; }
  int64_t experts() const { return router_.param().n(); }  // E (the router's)
  int64_t hidden() const { return fc1_.param().k(); }         // H
  int64_t ffn() const { return fc2_.param().k(); }            // F

  GroupedLinear& router() { return router_; }  // G = 1: weight (1, E, H)
  GroupedLinear& fc1() { return fc1_; }
  GroupedLinear& fc2() { return fc2_; }
  // Router, FC1, FC2: what an optimizer updates.
  std::vector<GroupedParam*> params();
  void zero_grad();  // GroupedParam::zero_grad on each param

  // x: (T, H) BF16 in the backend's memory, T > 0. Returns y (T, H) in out_dtype. Allowed from
  // kIdle and kForwardDone (a forward never followed by backward, e.g. eval, is dropped); with
  // wgrads pending it would lose them: PACKMOE_CHECK error. `recomputed`: the same x again for
  // backward after release (nn/recompute.h): the router statistics are not added a second time.
  Tensor forward(const Tensor& x, bool recomputed = false);
  // dy: (T, H) BF16 or F32, the gradient of the loss w.r.t. y; the loss also holds
  // loss_scale * aux_loss_coef * aux when the aux loss is on (loss_scale: the factor the caller's
  // loss carries, e.g. 1 / micro-batches, already inside dy). Returns dx (T, H) F32: the expert
  // path plus the router path. Writes (accum) every main_grad, or queues FC1 / FC2's
  // (delay_wgrad). Only from kForwardDone.
  Tensor backward(const Tensor& dy, GradAccum accum, float loss_scale = 1.0f);
  // Runs FC2's and FC1's queued wgrads (-> kIdle). Only from kWgradPending.
  void backward_dw();
  // Recomputation (nn/recompute.h). Selective: forward keeps FC1's output h but not the SwiGLU's
  // (FC2's input), which backward re-runs before FC2's backward; set only between a backward and
  // the next forward. release: frees what the last forward kept (-> kIdle), a recomputed forward
  // comes next.
  void set_recompute_swiglu(bool on) { recompute_swiglu_ = on; }
  void release();

  // Where the expert MLP's rows come from and go back to (default LocalTokenDispatcher: every
  // expert here; with E_local < E a dispatcher that brings each rank its experts' rows, e.g.
  // dist/ep_token_dispatcher.h). Only in state Idle.
  void set_token_dispatcher(std::unique_ptr<TokenDispatcher> dispatcher);
  const TokenDispatcher& token_dispatcher() const { return *dispatcher_; }

  // The routing plan of the last forward (tokens per expert, rows), for metrics and tests: its
  // counts copied to the host (a wait); dest and row_slot stay in the backend's memory (empty
  // here).
  RoutingPlan plan() const;
  // The aux loss (without the coefficient) of the statistics the last forward added to: its own
  // (this layer's) or the shared ones, copied to the host (a wait, for tests). Needs
  // aux_loss_coef != 0.
  float aux_loss() const;
  // Makes forward add its router statistics into `stats` (which its owner resets before each
  // forward of all the layers sharing it) and backward read the totals there. Only in state Idle.
  void share_aux_loss_stats(std::shared_ptr<AuxLossStats> stats);

 private:
  Backend* backend_;
  MoEBlockConfig cfg_;
  GroupedLinear router_;  // (1, E, H) BF16, out F32 (logits, dx)
  GroupedLinear fc1_;     // (E, 2F, H)
  GroupedLinear fc2_;     // (E, H, F)
  std::unique_ptr<TokenDispatcher> dispatcher_ = std::make_unique<LocalTokenDispatcher>();
  BlockState state_ = BlockState::kIdle;
  bool has_plan_ = false;
  std::shared_ptr<AuxLossStats> aux_stats_;  // with aux_loss_coef != 0: own or shared
  bool aux_stats_shared_ = false;            // shared: reset by their owner, not by forward
  bool recompute_swiglu_ = false;
  Tensor counts_;  // (E + 1) I64 of the last forward's plan (plan())

  // Saved by forward for backward (backend memory unless noted). Row buffers hold C =
  // routing_plan_max_rows rows, of which the plan uses M (rows_ on the device).
  int64_t tokens_ = 0;    // T, host
  int64_t capacity_ = 0;  // C, host
  ExpertRows plan_rows_;  // counts (E) I64 padded, used (1) I64 = M; rows undefined
  Tensor dest_;           // (T, k) I32, the plan's
  Tensor row_slot_;       // (C) I32, the plan's (-1 past row M)
  Tensor probs_;          // (T, E) F32
  Tensor idx_;            // (T, k) I32
  Tensor w_;              // (T, k) F32
  Tensor h_;              // (CL, 2F) activation_dtype, FC1's output (SwiGLU's input), expert side
  Tensor yp_;             // (C, H) activation_dtype, FC2's output (the combine's input)

  // a (CL, F) BF16 = swiglu(h_) over the rows `local` uses: FC2's input.
  Tensor swiglu(const ExpertRows& local) const;
  // --dispatch-dtype recipe: all's rows (C, H) BF16 become FC1's rowwise payload per expert
  // (nn/dispatch_payload.h), dispatched into `local`; returns FC1's output h (CL, 2F).
  Tensor forward_fc1_from_payload(ExpertRows& all, ExpertRows& local);
};

}  // namespace packmoe
