// ModelConfig: the model's shape, with Hugging Face `Qwen3MoeConfig` field names so that our
// config.json is the one `transformers` reads. Invariant: a ModelConfig returned by any function
// here (preset, parse, load) has passed validate(); unknown JSON keys are ignored, since real HF
// configs carry many fields we do not use.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/status.h"

namespace packmoe::train {

struct ModelConfig {
  // Defaults are the HF class defaults (v4 for rope_theta and head_dim, see
  // reference/style-and-ecosystem.md §2b), so a config.json that omits a field means the same here.
  std::string model_type = "qwen3_moe";
  int64_t vocab_size = 151936;          // V
  int64_t hidden_size = 2048;           // H
  int64_t intermediate_size = 6144;     // dense MLP width, only for mlp_only_layers
  int64_t moe_intermediate_size = 768;  // F, per-expert FFN width
  int64_t num_hidden_layers = 24;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 4;  // GQA
  int64_t head_dim = 64;            // absent in JSON: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  int64_t decoder_sparse_step = 1;
  int64_t num_experts_per_tok = 8;  // k
  int64_t num_experts = 128;        // E (alias in JSON: num_local_experts)
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.001;
  std::vector<int64_t> mlp_only_layers;
  double initializer_range = 0.02;

  // HF's rule (Qwen3MoeDecoderLayer): layer i is MoE iff i is not in mlp_only_layers, there are
  // experts, and (i + 1) is a multiple of decoder_sparse_step.
  bool is_moe_layer(int64_t i) const;
};

struct ParameterCount {
  int64_t total = 0;   // every parameter, as stored in the HF checkpoint
  int64_t active = 0;  // used per token: only k of E experts per MoE layer
};

// Parameters of Qwen3MoeForCausalLM with this config: embedding, per layer (2 RMSNorms, q/k/v/o
// projections without bias, q_norm and k_norm of head_dim, router (E, H) and E experts of
// gate/up/down, or a dense gate/up/down MLP), final norm, and lm_head unless tied.
ParameterCount parameter_count(const ModelConfig& config);

// One error per bad value, naming the field and the value, e.g.
// "num_key_value_heads = 3 must divide num_attention_heads = 32".
Status validate(const ModelConfig& config);

// Presets: "tiny" (byte-level, trains on 2 CPU cores in about a minute), "small" (about 100M
// parameters), "qwen3_30b_a3b_layers" (the layer shapes of Qwen3-30B-A3B with 4 layers).
std::vector<std::string> model_config_preset_names();
Result<ModelConfig> model_config_preset(const std::string& name);

// JSON <-> ModelConfig. Reading accepts v5-style `rope_parameters.rope_theta`, the
// `num_local_experts` alias, and `null` for an absent value; a wrong JSON type is an error naming
// the field.
nlohmann::json model_config_to_json(const ModelConfig& config);
Result<ModelConfig> model_config_from_json(const nlohmann::json& json);
Result<ModelConfig> parse_model_config(const std::string& text);

// config.json on disk; saving writes a temporary file next to `path` and renames it over `path`,
// so a crash never leaves a half-written config.
Result<ModelConfig> load_model_config(const std::string& path);
Status save_model_config(const ModelConfig& config, const std::string& path);

}  // namespace packmoe::train
