// ModelConfig presets, validation, parameter count and config.json I/O. Every path that produces
// a ModelConfig ends in validate(), so callers never see a config that would fail later in a
// shape check deep inside a layer.
#include "train/model_config.h"

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>
#include <span>
#include <tuple>
#include <sstream>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "io/read_file.h"
#include "train/metrics.h"  // write_file_atomically

namespace packmoe::train {

using nlohmann::json;

ParameterCount parameter_count(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, F = c.moe_intermediate_size;
  const int64_t attention = H * c.num_attention_heads * hd        // q_proj
                            + 2 * H * c.num_key_value_heads * hd  // k_proj, v_proj
                            + c.num_attention_heads * hd * H      // o_proj
                            + 2 * hd                              // q_norm, k_norm
                            + 2 * H;                              // input / post-attention norms
  ParameterCount n;
  n.total = n.active = V * H + H + (c.tie_word_embeddings ? 0 : V * H);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    n.total += attention;
    n.active += attention;
    if (c.is_moe_layer(i)) {
      n.total += E * H + E * 3 * F * H;  // router + experts (gate, up, down)
      n.active += E * H + k * 3 * F * H;
    } else {
      n.total += 3 * c.intermediate_size * H;
      n.active += 3 * c.intermediate_size * H;
    }
  }
  return n;
}

namespace {

std::string str(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

Status positive(const char* name, int64_t v) {
  if (v > 0) return Status::ok();
  return Status::error(std::string(name) + " = " + std::to_string(v) + " must be positive");
}

Status positive(const char* name, double v) {
  if (v > 0) return Status::ok();  // also rejects NaN
  return Status::error(std::string(name) + " = " + str(v) + " must be positive");
}

// An upper bound of every weight's element count, and of the parameter count times 16 bytes (FP32
// master, gradient and two AdamW moments), fit in int64 (so parameter_count and every allocation
// size are exact); whether the machine holds them is check_model_fits's question.
Status check_sizes(const ModelConfig& c) {
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const int64_t F = std::max(c.intermediate_size, c.moe_intermediate_size);
  const std::optional<int64_t> per_layer = checked_add(
      checked_product({4, H + 1, std::max(c.num_attention_heads, c.num_key_value_heads), hd + 1})
          .value_or(-1),
      checked_product({4, std::max<int64_t>(c.num_experts, 1), F, H}).value_or(-1));
  const std::optional<int64_t> total = checked_add(
      checked_product({2, c.vocab_size, H + 1}).value_or(-1),
      per_layer ? checked_mul(*per_layer, c.num_hidden_layers).value_or(-1) : -1);
  if (!total || !checked_mul(*total, 16))
    return Status::error("the model is too large: its parameter count (vocab_size = " +
                         std::to_string(c.vocab_size) + ", hidden_size = " + std::to_string(H) +
                         ", " + std::to_string(c.num_hidden_layers) + " layers of " +
                         std::to_string(c.num_experts) + " experts) overflows a 64-bit byte count");
  return Status::ok();
}

}  // namespace

Status check_model_fits(const ModelConfig& c, int64_t bytes_available) {
  const ParameterCount n = parameter_count(c);  // exact: validate() bounded it
  return check_fits(checked_mul(n.total, kBytesPerParameter), bytes_available,
                    "the model's " + std::to_string(n.total) + " parameters (one FP32 copy, " +
                        std::to_string(kBytesPerParameter) + " bytes each)");
}

Status validate(const ModelConfig& c) {
  if (c.model_type != "qwen3_moe")
    return Status::error("model_type = \"" + printable_text(c.model_type, true) +
                         "\" is not supported (expected \"qwen3_moe\")");
  PACKMOE_RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  PACKMOE_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  PACKMOE_RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  PACKMOE_RETURN_IF_ERROR(positive("num_hidden_layers", c.num_hidden_layers));
  PACKMOE_RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads));
  PACKMOE_RETURN_IF_ERROR(positive("num_key_value_heads", c.num_key_value_heads));
  PACKMOE_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  PACKMOE_RETURN_IF_ERROR(positive("max_position_embeddings", c.max_position_embeddings));
  PACKMOE_RETURN_IF_ERROR(positive("rms_norm_eps", c.rms_norm_eps));
  PACKMOE_RETURN_IF_ERROR(positive("rope_theta", c.rope_theta));
  PACKMOE_RETURN_IF_ERROR(positive("initializer_range", c.initializer_range));
  PACKMOE_RETURN_IF_ERROR(positive("decoder_sparse_step", c.decoder_sparse_step));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return Status::error(
        "num_key_value_heads = " + std::to_string(c.num_key_value_heads) +
        " must divide num_attention_heads = " + std::to_string(c.num_attention_heads));
  // RoPE rotates pairs of channels.
  if (c.head_dim % 2 != 0)
    return Status::error("head_dim = " + std::to_string(c.head_dim) + " must be even (RoPE)");
  if (c.num_experts < 0)
    return Status::error("num_experts = " + std::to_string(c.num_experts) +
                         " must not be negative");
  if (c.num_experts > 0) {
    PACKMOE_RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
    PACKMOE_RETURN_IF_ERROR(positive("num_experts_per_tok", c.num_experts_per_tok));
    if (c.num_experts_per_tok > c.num_experts)
      return Status::error("num_experts_per_tok = " + std::to_string(c.num_experts_per_tok) +
                           " must not exceed num_experts = " + std::to_string(c.num_experts));
  }
  if (!(c.router_aux_loss_coef >= 0))
    return Status::error("router_aux_loss_coef = " + str(c.router_aux_loss_coef) +
                         " must not be negative");
  for (int64_t layer : c.mlp_only_layers)
    if (layer < 0 || layer >= c.num_hidden_layers)
      return Status::error("mlp_only_layers entry " + std::to_string(layer) +
                           " is not a layer index in [0, " + std::to_string(c.num_hidden_layers) +
                           ")");
  return check_sizes(c);
}

std::vector<std::string> model_config_preset_names() {
  return {"tiny", "small", "qwen3_30b_a3b_layers", "qwen3_30b_a3b"};
}

Result<ModelConfig> model_config_preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    // Byte-level vocabulary so it trains on raw text with no tokenizer.
    c.vocab_size = 256;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.moe_intermediate_size = 32;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 512;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.norm_topk_prob = true;
    c.rope_theta = 10000.0;
  } else if (name == "small") {
    // About 100M parameters in total (parameter_count: 101,787,136), 54,601,216 active.
    c.vocab_size = 32768;
    c.hidden_size = 512;
    c.intermediate_size = 1536;
    c.moe_intermediate_size = 320;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.max_position_embeddings = 4096;
    c.num_experts = 16;
    c.num_experts_per_tok = 4;
    c.norm_topk_prob = true;
    c.rope_theta = 1e6;
  } else if (name == "qwen3_30b_a3b_layers" || name == "qwen3_30b_a3b") {
    // Qwen3-30B-A3B's layer shapes (head_dim * heads = 4096 != hidden 2048): 4 of its 48 layers,
    // or all of them (its published config.json: tests/unit/test_model_config.cpp).
    c.vocab_size = 151936;
    c.hidden_size = 2048;
    c.intermediate_size = 6144;
    c.moe_intermediate_size = 768;
    c.num_hidden_layers = name == "qwen3_30b_a3b" ? 48 : 4;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.max_position_embeddings = 40960;
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.norm_topk_prob = true;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6;
  } else {
    std::string known;
    for (const std::string& n : model_config_preset_names())
      known += (known.empty() ? "" : ", ") + n;
    return Status::error("unknown model preset '" + name + "' (known: " + known + ")");
  }
  PACKMOE_RETURN_IF_ERROR(validate(c));
  return c;
}

json model_config_to_json(const ModelConfig& c, DType weights_dtype) {
  PACKMOE_CHECK(weights_dtype == DType::kF32 || weights_dtype == DType::kBF16,
                "config.json describes F32 or BF16 weights");
  json j;
  j["architectures"] = json::array({"Qwen3MoeForCausalLM"});
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;  // transformers 4; 5 reads rope_parameters
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["decoder_sparse_step"] = c.decoder_sparse_step;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["num_experts"] = c.num_experts;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  j["mlp_only_layers"] = c.mlp_only_layers;
  j["initializer_range"] = c.initializer_range;
  // Fields transformers needs to build the model that packmoe does not vary.
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["use_cache"] = true;
  j["output_router_logits"] = false;
  const char* dtype = weights_dtype == DType::kF32 ? "float32" : "bfloat16";
  j["torch_dtype"] = dtype;
  j["dtype"] = dtype;
  return j;
}

namespace {

// The type and a short form of the value; never a recursive dump (core/json_limits.h).
std::string describe(const json& v) {
  return v.is_structured() ? json_brief(v) : std::string(v.type_name()) + " " + json_brief(v);
}

// Absent and null both leave the default: HF writes null for unset optional fields.
Status read_int(const json& j, const char* key, int64_t& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_number_integer())
    return Status::error(std::string(key) + " must be an integer (got " + describe(*it) + ")");
  if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX})
    return Status::error(std::string(key) + " must be at most 2^63 - 1 (got " + describe(*it) +
                         ")");
  out = it->get<int64_t>();
  return Status::ok();
}

Status read_double(const json& j, const char* key, double& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_number())
    return Status::error(std::string(key) + " must be a number (got " + describe(*it) + ")");
  out = it->get<double>();
  return Status::ok();
}

Status read_bool(const json& j, const char* key, bool& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_boolean())
    return Status::error(std::string(key) + " must be true or false (got " + describe(*it) + ")");
  out = it->get<bool>();
  return Status::ok();
}

bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

// ---- what a Hugging Face config may say (docs/model-config.md has the reasons) ----------------

// Read into ModelConfig (or checked to have the one value packmoe implements, below).
constexpr const char* kReadKeys[] = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "tie_word_embeddings", "decoder_sparse_step", "num_experts_per_tok",
    "num_experts", "num_local_experts", "norm_topk_prob", "router_aux_loss_coef",
    "mlp_only_layers", "initializer_range", "hidden_act", "attention_bias", "attention_dropout",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
    "quantization_config"};
// Known and without effect on the model packmoe trains: token ids of the tokenizer and of
// generation, the dtype the weights were saved in (the weight reader checks the tensors'),
// inference switches, bookkeeping.
constexpr const char* kIgnoredKeys[] = {
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "output_router_logits", "_name_or_path"};
// The sizes a config must give: absent, Qwen3MoeConfig's defaults would silently make a
// 30B-class layer shape ({"vocab_size": 1024, "num_hidden_layers": 2} would be 1.2B parameters).
constexpr const char* kRequiredKeys[] = {"vocab_size", "hidden_size", "intermediate_size",
                                         "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads"};
constexpr const char* kRequiredMoeKeys[] = {"moe_intermediate_size", "num_experts_per_tok"};

bool one_of(const std::string& key, std::span<const char* const> keys) {
  for (const char* k : keys)
    if (key == k) return true;
  return false;
}

Status unsupported(const std::string& field, const json& v, const std::string& why) {
  return Status::error(field + " = " + json_brief(v) + " is not supported (" + why + ")");
}

// The fields whose other values packmoe does not implement: each such value is an error naming
// the field and the value, never silently trained as something else.
Status check_unsupported(const json& j) {
  // Arrays of names: every entry must be the one packmoe implements; the first other one is named.
  for (const auto& [field, name, why] :
       {std::tuple{"architectures", "Qwen3MoeForCausalLM", "packmoe trains Qwen3MoeForCausalLM"},
        std::tuple{"layer_types", "full_attention", "every layer is \"full_attention\""}}) {
    if (!present(j, field)) continue;
    const json& a = j[field];
    if (!a.is_array()) return unsupported(field, a, std::string("an array of \"") + name + "\"");
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != name)
        return unsupported(std::string(field) + "[" + std::to_string(i) + "]", a[i], why);
  }
  if (present(j, "hidden_act") && j["hidden_act"] != "silu")
    return unsupported("hidden_act", j["hidden_act"], "the experts and MLPs are SwiGLU: silu");
  if (present(j, "attention_bias") && j["attention_bias"] != false)
    return unsupported("attention_bias", j["attention_bias"], "q/k/v/o projections have no bias");
  if (present(j, "attention_dropout") &&
      !(j["attention_dropout"].is_number() && j["attention_dropout"].get<double>() == 0))
    return unsupported("attention_dropout", j["attention_dropout"], "packmoe has no dropout");
  if (present(j, "use_sliding_window") && j["use_sliding_window"] != false)
    return unsupported("use_sliding_window", j["use_sliding_window"],
                       "attention is full causal attention over the sequence");
  if (present(j, "quantization_config"))
    return unsupported("quantization_config", j["quantization_config"],
                       "packmoe reads F32 or BF16 weights and quantizes them itself");
  // RoPE: the default rotation only; rope_scaling (v4) or rope_parameters (v5) of another type,
  // or with parameters of one (factor, ...), would be trained as something else.
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    if (!present(j, field)) continue;
    const json& r = j[field];
    if (!r.is_object())
      return Status::error(std::string(field) + " must be an object (got " + describe(r) + ")");
    const char* type_key = r.contains("rope_type") || !r.contains("type") ? "rope_type" : "type";
    const json type = r.value(type_key, json("default"));
    if (type != "default")
      return unsupported(std::string(field) + "." + type_key, type,
                         "packmoe implements rope_type \"default\" only");
    for (const auto& [key, v] : r.items())
      if (key != type_key && !(key == "rope_theta" && std::string(field) == "rope_parameters"))
        return unsupported(std::string(field) + "." + key, v,
                           "the default RoPE takes rope_theta only");
  }
  return Status::ok();
}

}  // namespace

Result<ModelConfig> model_config_from_json(const json& j, std::vector<std::string>* unknown_keys) {
  if (!j.is_object())
    return Status::error("config.json must be a JSON object (got " + describe(j) + ")");
  PACKMOE_RETURN_IF_ERROR(check_unsupported(j));
  for (const auto& [key, v] : j.items())
    if (!one_of(key, kReadKeys) && !one_of(key, kIgnoredKeys) && unknown_keys)
      unknown_keys->push_back(key);
  std::string missing;
  for (const char* key : kRequiredKeys)
    if (!present(j, key)) missing += (missing.empty() ? "" : ", ") + std::string(key);
  const bool no_experts = (present(j, "num_experts") && j["num_experts"] == 0) ||
                          (present(j, "num_local_experts") && j["num_local_experts"] == 0);
  if (!present(j, "num_experts") && !present(j, "num_local_experts"))
    missing += (missing.empty() ? "" : ", ") + std::string("num_experts");
  if (!no_experts)
    for (const char* key : kRequiredMoeKeys)
      if (!present(j, key)) missing += (missing.empty() ? "" : ", ") + std::string(key);
  if (!missing.empty())
    return Status::error("the config does not give " + missing +
                         " (packmoe takes no model size from Qwen3MoeConfig's defaults, the "
                         "shape of a 30B-class model)");
  ModelConfig c;
  if (present(j, "model_type")) {
    if (!j["model_type"].is_string())
      return Status::error("model_type must be a string (got " + describe(j["model_type"]) + ")");
    c.model_type = j["model_type"].get<std::string>();
  }
  PACKMOE_RETURN_IF_ERROR(read_int(j, "vocab_size", c.vocab_size));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "hidden_size", c.hidden_size));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "intermediate_size", c.intermediate_size));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "moe_intermediate_size", c.moe_intermediate_size));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", c.num_hidden_layers));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_attention_heads", c.num_attention_heads));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_key_value_heads", c.num_key_value_heads));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "max_position_embeddings", c.max_position_embeddings));
  PACKMOE_RETURN_IF_ERROR(read_double(j, "rms_norm_eps", c.rms_norm_eps));
  // v5 moved rope_theta into rope_parameters; a top-level value wins when both exist.
  if (present(j, "rope_parameters"))
    PACKMOE_RETURN_IF_ERROR(read_double(j["rope_parameters"], "rope_theta", c.rope_theta));
  PACKMOE_RETURN_IF_ERROR(read_double(j, "rope_theta", c.rope_theta));
  PACKMOE_RETURN_IF_ERROR(read_bool(j, "tie_word_embeddings", c.tie_word_embeddings));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "decoder_sparse_step", c.decoder_sparse_step));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_experts_per_tok", c.num_experts_per_tok));
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_local_experts", c.num_experts));  // HF attribute_map
  PACKMOE_RETURN_IF_ERROR(read_int(j, "num_experts", c.num_experts));
  PACKMOE_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", c.norm_topk_prob));
  PACKMOE_RETURN_IF_ERROR(read_double(j, "router_aux_loss_coef", c.router_aux_loss_coef));
  PACKMOE_RETURN_IF_ERROR(read_double(j, "initializer_range", c.initializer_range));
  if (present(j, "mlp_only_layers")) {
    const json& layers = j["mlp_only_layers"];
    if (!layers.is_array())
      return Status::error("mlp_only_layers must be an array of integers (got " + describe(layers) +
                           ")");
    for (const json& v : layers) {
      if (!v.is_number_integer() ||
          (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}))
        return Status::error("mlp_only_layers must be an array of integers (got an entry " +
                             describe(v) + ")");
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  // HF falls back to hidden / heads only when head_dim is absent (docs/formats.md; checkpoints set it).
  if (present(j, "head_dim")) {
    PACKMOE_RETURN_IF_ERROR(read_int(j, "head_dim", c.head_dim));
  } else if (c.num_attention_heads > 0) {
    if (c.hidden_size % c.num_attention_heads != 0)
      return Status::error("head_dim is absent and hidden_size = " + std::to_string(c.hidden_size) +
                           " is not a multiple of " +
                           "num_attention_heads = " + std::to_string(c.num_attention_heads));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  PACKMOE_RETURN_IF_ERROR(validate(c));
  return c;
}

Result<ModelConfig> parse_model_config(const std::string& text,
                                       std::vector<std::string>* unknown_keys) {
  Result<json> j = parse_json_text(text, "config.json");
  if (!j) return j.status();
  return model_config_from_json(j.value(), unknown_keys);
}

Result<ModelConfig> load_model_config(const std::string& path,
                                      std::vector<std::string>* unknown_keys) {
  Result<std::string> text = io::read_regular_file(path, io::kMaxJsonFileBytes);
  if (!text) return Status::error("cannot open model config: " + text.status().message());
  Result<ModelConfig> config = parse_model_config(text.value(), unknown_keys);
  // A config that describes a model this machine cannot hold is refused here, before a reader
  // (a checkpoint, Hugging Face weights) allocates its tensors.
  if (config) {
    if (Status s = check_model_fits(config.value(), host_memory_bytes()); !s) config = s;
  }
  if (!config) return Status::error(path + ": " + config.status().message());
  return config;
}

Status save_model_config(const ModelConfig& config, const std::string& path, DType weights_dtype) {
  PACKMOE_RETURN_IF_ERROR(validate(config));
  return write_file_atomically(path, model_config_to_json(config, weights_dtype).dump(2) + "\n");
}

Status check_same_model(const ModelConfig& expected, const ModelConfig& found,
                        const std::string& where) {
  const json want = model_config_to_json(expected), got = model_config_to_json(found);
  for (const auto& [key, value] : want.items()) {
    if (got[key] == value) continue;
    return Status::error(where + " is another model: " + key + " = " + got[key].dump() +
                         " there, " + value.dump() + " here");
  }
  return Status::ok();
}

}  // namespace packmoe::train
