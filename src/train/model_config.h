// ModelConfig: the model's shape, with Hugging Face `Qwen3MoeConfig` field names so that our
// config.json is the one `transformers` reads. Invariant: a ModelConfig returned by any function
// here (preset, parse, load) has passed validate(), and a config read from JSON says nothing
// packmoe would train differently: a field value packmoe does not implement (rope scaling,
// sliding window, another architecture, ...) is an error naming it, a key it does not know is
// reported to the caller (docs/model-config.md lists every key of a Qwen3-MoE config).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "nn/model_config.h"

namespace packmoe::train {

// The struct lives in nn/ (the model is built from it); train/ adds presets, counts and JSON.
using packmoe::ModelConfig;


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

// Bytes per parameter that any reader or trainer of a model holds at least: one FP32 copy (the
// masters a checkpoint or Hugging Face reader allocates; the FP32 gradient buffer every training
// rank holds whole, whatever the sharding). A lower bound, so it never refuses a model that fits.
inline constexpr int64_t kBytesPerParameter = 4;
// An error unless the model's parameters (kBytesPerParameter each) fit in `bytes_available`
// (e.g. host_memory_bytes()): a model too large for the machine is refused before allocation.
Status check_model_fits(const ModelConfig& config, int64_t bytes_available);

// Presets: "tiny" (byte-level, trains on 2 CPU cores in about a minute), "small" (about 100M
// parameters), "qwen3_30b_a3b_layers" (the layer shapes of Qwen3-30B-A3B with 4 layers),
// "qwen3_30b_a3b" (the whole model, 48 layers: for `packmoe train --dry-run`, or a GPU cluster).
std::vector<std::string> model_config_preset_names();
Result<ModelConfig> model_config_preset(const std::string& name);

// JSON <-> ModelConfig. Writing gives a complete Hugging Face config.json: every field above plus
// the fields transformers reads that packmoe does not vary (architectures, hidden_act, attention
// bias / dropout, sliding window off, use_cache, output_router_logits, rope_parameters), and the
// dtype of the weights it goes with as "torch_dtype" (transformers 4) and "dtype" (5): "float32"
// or "bfloat16" for weights_dtype kF32 / kBF16. Reading accepts v5-style
// `rope_parameters.rope_theta`, the `num_local_experts` alias, and `null` for an absent value; a
// wrong JSON type is an error naming the field, and so is a missing size (vocab_size,
// hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
// num_experts and, with experts, moe_intermediate_size and num_experts_per_tok: HF's defaults
// for them are a 30B-class shape) and a value packmoe does not implement (architectures other
// than Qwen3MoeForCausalLM, hidden_act other than silu, attention_bias, attention_dropout,
// use_sliding_window, non-full layer_types, rope_scaling / rope_parameters other than the
// default type, quantization_config). Keys it neither reads nor knows to be without effect go to
// `unknown_keys` (when given), in key order, for the caller's warning.
nlohmann::json model_config_to_json(const ModelConfig& config, DType weights_dtype = DType::kF32);
Result<ModelConfig> model_config_from_json(const nlohmann::json& json,
                                           std::vector<std::string>* unknown_keys = nullptr);
Result<ModelConfig> parse_model_config(const std::string& text,
                                       std::vector<std::string>* unknown_keys = nullptr);

// config.json on disk; saving writes a temporary file next to `path` and renames it over `path`,
// so a crash never leaves a half-written config.
Result<ModelConfig> load_model_config(const std::string& path,
                                      std::vector<std::string>* unknown_keys = nullptr);
Status save_model_config(const ModelConfig& config, const std::string& path,
                         DType weights_dtype = DType::kF32);

// OK when `found` (read from `where`, e.g. a checkpoint's config.json) is the same model as
// `expected` (every field of model_config_to_json equal); else one error naming the first field
// that differs: "WHERE is another model: hidden_size = 128 there, 64 here".
Status check_same_model(const ModelConfig& expected, const ModelConfig& found,
                        const std::string& where);

}  // namespace packmoe::train
