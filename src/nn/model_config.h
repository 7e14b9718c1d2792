// ModelConfig: the shape of a Qwen3-MoE decoder, with Hugging Face `Qwen3MoeConfig` field names
// (train/model_config.h reads and writes it as config.json, validates it and has the presets).
// Invariant: nn/ builds the model from these fields only; a config that reaches nn/ was validated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace packmoe {

struct ModelConfig {
  // Defaults are the HF class defaults (v4 for rope_theta and head_dim, see
  // docs/formats.md, "Files of other tools"), so a config.json that omits a field means the same.
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
  bool is_moe_layer(int64_t i) const {
    for (int64_t l : mlp_only_layers)
      if (l == i) return false;
    return num_experts > 0 && (i + 1) % decoder_sparse_step == 0;
  }
};

}  // namespace packmoe
