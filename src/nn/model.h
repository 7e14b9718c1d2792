// Model: the Qwen3-MoE decoder (HF Qwen3MoeForCausalLM) with explicit forward / backward over
// Backend ops. Every parameter is a GroupedParam (dense ones with E = 1) made from its FP32 init;
// MoE experts use the precision recipe, everything else BF16 GEMM operands and FP32 activations.
// Invariants: weights come from a ModelWeights map (random init or a checkpoint), which the
// optimizer's FP32 masters are made from (dist/dist_optimizer.h), never dequantized values; both expert layouts issue identical ops (bitwise equal
// results); gradients are ACCUMULATED into main_grad (the trainer zeroes them once per step).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"
#include "nn/grouped_param.h"
#include "nn/model_config.h"
#include "nn/recipe.h"
#include "nn/recompute.h"

namespace packmoe {

// Precision and layout of the MoE experts (FC1 / FC2 of every MoE layer). Attention, norms,
// router, dense MLPs, embedding and LM head always use BF16 GEMM operands with FP32 masters.
struct ModelPrecision {
  QuantRecipe recipe;                                    // sr_seed seeds every layer's SR
  PrimaryWeight primary = PrimaryWeight::kLowPrecision;  // experts' primary weight
  Layout layout = Layout::kSingle;                       // every parameter's layout
  bool grad_accum_fusion = true;
};

// Host F32 weights by name. Dense weights use their HF names and shapes, e.g.
//   "model.embed_tokens.weight" (V, H), "model.layers.N.input_layernorm.weight" (H),
//   "model.layers.N.self_attn.q_proj.weight" (Hq*D, H), ".k_proj" / ".v_proj" (Hkv*D, H),
//   ".o_proj" (H, Hq*D), ".q_norm" / ".k_norm" (D), "model.layers.N.post_attention_layernorm.weight"
//   (H), "model.layers.N.mlp.gate.weight" (E, H) (router), "model.norm.weight" (H),
//   "lm_head.weight" (V, H) (absent when tie_word_embeddings).
// Gate and up projections are packed (HF stores them apart on disk; io/hf_weights splits them):
//   experts:   "model.layers.N.mlp.experts.gate_up_proj" (E, 2F, H): gate rows [0, F), up [F, 2F)
//              "model.layers.N.mlp.experts.down_proj"    (E, H, F)
//   dense MLP: "model.layers.N.mlp.gate_up_proj" (2I, H): gate rows [0, I), up rows [I, 2I)
//              "model.layers.N.mlp.down_proj.weight" (H, I)   (mlp_only_layers)
using ModelWeights = std::map<std::string, Tensor>;

enum class ParamInit { kNormal, kOnes };  // N(0, initializer_range) for matrices, 1 for norms

struct ParamSpec {
  std::string name;   // a ModelWeights key
  Shape shape;        // as in ModelWeights
  ParamInit init;
  bool weight_decay;  // false for norms (AdamW applies no decay to them)
};

// Every parameter of the config, in the model's fixed order: embedding, per layer (input norm,
// q, k, v, o, q_norm, k_norm, post-attention norm, then router, gate_up, down or the dense
// gate, up, down), final norm, lm_head.
std::vector<ParamSpec> model_param_specs(const ModelConfig& config);

// Deterministic init: parameter i of model_param_specs draws from Philox stream (seed, i); normal
// values by Box-Muller in FP64, rounded once to FP32 (ops::init_normal); norms are 1. Same seed,
// same weights, on every machine and thread count. Made in `backend`'s memory (on CUDA: on the
// device, no host copy); the CUDA values are within kInitNormalMaxUlp of the CPU's
// (backend/ops/init.h).
ModelWeights random_model_weights(Backend& backend, const ModelConfig& config, uint64_t seed);
ModelWeights random_model_weights(const ModelConfig& config, uint64_t seed);  // on the host

// Checks that `weights` has exactly the names of model_param_specs with their shapes, F32, in host
// memory or on `device`; the error names the first offending tensor.
Status validate_model_weights(const ModelConfig& config, const ModelWeights& weights,
                              Device device = Device::kCPU);

// One micro-batch of B rows of S tokens (host). targets[t] is the next token of inputs[t] or -100
// (ignored). By default each row is one causal sequence with positions 0..S-1; with document
// masking, doc_start[t] is the position in its row where token t's document starts (tokens attend
// only inside their document), and positions[t] the RoPE position of token t.
struct Batch {
  int64_t batch = 0;               // B
  int64_t seq = 0;                 // S
  std::vector<int32_t> inputs;     // (B * S)
  std::vector<int32_t> targets;    // (B * S)
  std::vector<int32_t> doc_start;  // (B * S), or empty: causal rows
  std::vector<int32_t> positions;  // (B * S), or empty: 0..S-1 in every row
};

struct ForwardLosses {
  float lm_loss = 0;          // cross-entropy, mean over the non-ignored targets
  // Hugging Face's load-balancing loss over every MoE layer's router outputs together (without the
  // coef; backend/ops/moe.h): k (num_experts_per_tok) when the routing is balanced.
  float aux_loss = 0;
  float aux_coef = 0;         // router_aux_loss_coef of the config
  int64_t target_tokens = 0;  // non-ignored targets
  // What backward differentiates: lm_loss + aux_coef * aux_loss.
  float total() const { return lm_loss + aux_coef * aux_loss; }
};

// The losses of one micro-batch with the scalars still in the backend's memory
// (Model::queue_forward): nothing waited for them. read_losses brings any number of them to the
// host with one wait.
struct QueuedLosses {
  Tensor values;              // (2) F32: lm_loss | aux_loss (0 without the aux loss)
  float aux_coef = 0;         // router_aux_loss_coef of the config
  int64_t target_tokens = 0;  // non-ignored targets (counted on the host from the batch)
};
// The host values of `queued`, in order (a trainer: once per optimizer step).
std::vector<ForwardLosses> read_losses(Backend& b, const std::vector<QueuedLosses>& queued);

class DecoderLayer;   // nn/decoder_layer.h
class GroupedLinear;  // nn/grouped_linear.h
class RmsNorm;        // nn/rms_norm.h

// A parameter with its name (a ModelWeights key), whether AdamW decays it, and whether a layer
// reads its FP32 weight itself (nn/layer_ops.h f32_weight: every RMSNorm and the embedding table,
// also when tied to the LM head) rather than only its primary weight, so that data parallelism
// must keep a full FP32 replica of it on every rank (dist/dist_optimizer.h WeightForm::kFp32).
struct NamedParam {
  std::string name;
  GroupedParam* param;  // (1, N, K) for dense weights (norms: (1, 1, D)), (E_local, N, K) for experts
  bool weight_decay;
  bool reads_fp32 = false;
  bool expert = false;  // an MoE layer's FC1 / FC2: sharded over ranks by expert parallelism
};

// Called by Model::backward with a params() index once that parameter's gradient of this backward
// is final: every write into its main_grad is queued on the backend (the CPU backend: done).
// Fired once per parameter per backward, after the backward of the layer that owns it.
using GradReadyHook = std::function<void(size_t param_index)>;

enum class ModelState {
  kIdle,         // no backward owed (an evaluation forward leaves the model here)
  kForwardDone,  // a training forward's activations are saved; its backward must run next
};

// The experts of every MoE layer this model holds: [first, first + count) of the E (expert
// parallelism: dist/expert_layout.h); count 0 = all E. The init map always holds all E (names and
// shapes as above); the model keeps only the slice.
struct ExpertSlice {
  int64_t first = 0;
  int64_t count = 0;
};

class Model {
 public:
  // Builds every layer from `init` (validated: a bad map is a PACKMOE_CHECK error, callers check
  // validate_model_weights first for user data); each param keeps its FP32 init for the optimizer.
  // With a slice of the experts, each MoE layer's FC1 / FC2 hold E_local = slice.count experts and
  // need a dispatcher that brings them their rows (MoEBlock::set_token_dispatcher).
  Model(Backend& backend, const ModelConfig& config, const ModelPrecision& precision,
        const ModelWeights& init, ExpertSlice experts = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const ModelPrecision& precision() const { return precision_; }
  // The experts each MoE layer holds (count = E when not expert-parallel).
  ExpertSlice expert_slice() const { return expert_slice_; }
  Backend& backend() const { return *backend_; }
  ModelState state() const { return state_; }

  // Every parameter, in model_param_specs order (the tied LM head is not listed twice).
  const std::vector<NamedParam>& params() const { return params_; }
  // Sets the NVFP4 stochastic-rounding offset of every GroupedLinear (each has its own seed):
  // the trainer's nvfp4_grad_sr_offset of the coming micro-batch. With the seed, that is the
  // whole random state of a run, so a checkpoint needs none.
  void set_grad_sr_offset(uint64_t offset);
  // What a training forward keeps for backward (nn/recompute.h; default kNone). Only in kIdle.
  void set_recompute(Recompute mode);
  Recompute recompute() const { return recompute_; }

  // Evaluation forward of one micro-batch: its losses (one host sync), no gradient; kIdle stays
  // kIdle. Bad ids / targets are a Status error before anything is computed.
  Result<ForwardLosses> forward(const Batch& batch);
  // Training forward: the losses, and the first part of the backward of the loss
  // loss_scale * (lm_loss + coef * aux_loss): the LM head and the cross-entropy run fused in
  // chunks of tokens (nn/lm_head_loss.h), so the head's weight gradient is ADDED into its main_grad
  // here (call it where a backward may write gradients: after DistOptimizer::prepare_backward).
  // kIdle -> kForwardDone; any forward from kForwardDone is a PACKMOE_CHECK error (that backward
  // is owed).
  Result<ForwardLosses> forward(const Batch& batch, float loss_scale);
  // The same with the aux loss's gradient scaled apart: loss_scale * lm_loss + aux_scale * coef *
  // aux_loss (SFT weighs a micro-batch's lm loss by its share of the step's targets).
  Result<ForwardLosses> forward(const Batch& batch, float loss_scale, float aux_scale);
  // Either forward with its losses left in the backend's memory (no host wait): loss_scale given,
  // the training forward; absent, the evaluation one. read_losses reads them. aux_scale: the aux
  // loss's backward scale when it differs from loss_scale.
  Result<QueuedLosses> queue_forward(const Batch& batch, std::optional<float> loss_scale,
                                     std::optional<float> aux_scale = std::nullopt);
  // The rest of the training forward's backward: every gradient is ADDED into its main_grad.
  // Only from kForwardDone (-> kIdle). Fires the grad-ready hook (if any) for each parameter as
  // its gradient becomes final (the LM head's first, as before).
  void backward();
  void zero_grad();  // every main_grad = 0
  // Per MoE layer (decoder layer index, counts (E)): the (token, choice) pairs routed to each
  // expert by the last forward, copied to the host (a wait; for metrics).
  std::vector<std::pair<int64_t, std::vector<int64_t>>> expert_counts() const;
  // Installs (or, empty, removes) the hook backward fires per parameter: data parallelism starts
  // a bucket's gradient reduce-scatter as soon as all its parameters are final.
  void set_grad_ready_hook(GradReadyHook hook) { grad_ready_ = std::move(hook); }

  // The layers themselves, for inference that runs them its own way (the KV-cached forward of
  // nn/kv_cache.h): decoder layer i < num_hidden_layers, the final norm, the LM head and the
  // embedding table (1, V, H) (the LM head's weight when tied).
  DecoderLayer& layer(int64_t i);
  RmsNorm& final_norm();
  GroupedLinear& lm_head();
  const GroupedParam& embedding() const;

 private:
  Backend* backend_;
  ModelConfig config_;
  ModelPrecision precision_;
  ExpertSlice expert_slice_;
  ModelState state_ = ModelState::kIdle;
  Recompute recompute_ = Recompute::kNone;
  std::vector<NamedParam> params_;
  std::vector<GroupedLinear*> linears_;  // every GroupedLinear (set_grad_sr_offset)
  GradReadyHook grad_ready_;
  void grad_ready(size_t first, size_t end) const;  // the hook for params() [first, end)

  struct Impl;  // layers and saved activations (nn/model.cpp)
  std::unique_ptr<Impl> impl_;
};

}  // namespace packmoe
