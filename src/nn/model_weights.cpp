// The model's parameter list (names, shapes, init rule, weight decay), its deterministic random
// init and the check of a ModelWeights map against it. The list order is the model's parameter
// order everywhere (optimizer, checkpoints, Philox streams of the init).
#include <cmath>
#include <cstring>
#include <set>

#include "core/philox.h"
#include "nn/model.h"

namespace packmoe {
namespace {

std::string layer_name(int64_t i, const char* rest) {
  return "model.layers." + std::to_string(i) + "." + rest;
}

// Uniform in (0, 1] from 32 random bits (never 0, so log() is finite).
double unit_uniform(uint32_t bits) { return (static_cast<double>(bits) + 1.0) / 4294967296.0; }

}  // namespace

std::vector<ParamSpec> model_param_specs(const ModelConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t E = c.num_experts, F = c.moe_intermediate_size, I = c.intermediate_size;
  std::vector<ParamSpec> s;
  s.push_back({"model.embed_tokens.weight", {V, H}, ParamInit::kNormal, true});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    s.push_back({layer_name(i, "input_layernorm.weight"), {H}, ParamInit::kOnes, false});
    s.push_back({layer_name(i, "self_attn.q_proj.weight"), {Hq * D, H}, ParamInit::kNormal, true});
    s.push_back({layer_name(i, "self_attn.k_proj.weight"), {Hkv * D, H}, ParamInit::kNormal, true});
    s.push_back({layer_name(i, "self_attn.v_proj.weight"), {Hkv * D, H}, ParamInit::kNormal, true});
    s.push_back({layer_name(i, "self_attn.o_proj.weight"), {H, Hq * D}, ParamInit::kNormal, true});
    s.push_back({layer_name(i, "self_attn.q_norm.weight"), {D}, ParamInit::kOnes, false});
    s.push_back({layer_name(i, "self_attn.k_norm.weight"), {D}, ParamInit::kOnes, false});
    s.push_back({layer_name(i, "post_attention_layernorm.weight"), {H}, ParamInit::kOnes, false});
    if (c.is_moe_layer(i)) {
      s.push_back({layer_name(i, "mlp.gate.weight"), {E, H}, ParamInit::kNormal, true});
      s.push_back({layer_name(i, "mlp.experts.gate_up_proj"), {E, 2 * F, H}, ParamInit::kNormal,
                   true});
      s.push_back({layer_name(i, "mlp.experts.down_proj"), {E, H, F}, ParamInit::kNormal, true});
    } else {
      s.push_back({layer_name(i, "mlp.gate_up_proj"), {2 * I, H}, ParamInit::kNormal, true});
      s.push_back({layer_name(i, "mlp.down_proj.weight"), {H, I}, ParamInit::kNormal, true});
    }
  }
  s.push_back({"model.norm.weight", {H}, ParamInit::kOnes, false});
  if (!c.tie_word_embeddings)
    s.push_back({"lm_head.weight", {V, H}, ParamInit::kNormal, true});
  return s;
}

ModelWeights random_model_weights(const ModelConfig& config, uint64_t seed) {
  Allocator& host = cpu_backend();
  const std::vector<ParamSpec> specs = model_param_specs(config);
  ModelWeights w;
  for (size_t p = 0; p < specs.size(); ++p) {
    const ParamSpec& spec = specs[p];
    Tensor t = Tensor::empty(host, DType::kF32, spec.shape);
    float* v = t.data_as<float>();
    const int64_t n = t.numel();
    if (spec.init == ParamInit::kOnes) {
      for (int64_t i = 0; i < n; ++i) v[i] = 1.0f;
    } else {
      // Box-Muller: draw j gives elements 2j and 2j + 1 from its first two 32-bit words.
      const double std = config.initializer_range;
      for (int64_t j = 0; 2 * j < n; ++j) {
        const Philox4 r = philox_draw(seed, static_cast<uint64_t>(j), static_cast<uint32_t>(p));
        const double radius = std::sqrt(-2.0 * std::log(unit_uniform(r.v[0])));
        const double angle = 2.0 * M_PI * unit_uniform(r.v[1]);
        v[2 * j] = static_cast<float>(std * radius * std::cos(angle));
        if (2 * j + 1 < n) v[2 * j + 1] = static_cast<float>(std * radius * std::sin(angle));
      }
    }
    w.emplace(spec.name, std::move(t));
  }
  return w;
}

Status validate_model_weights(const ModelConfig& config, const ModelWeights& weights) {
  std::set<std::string> expected;
  for (const ParamSpec& spec : model_param_specs(config)) {
    expected.insert(spec.name);
    const auto it = weights.find(spec.name);
    if (it == weights.end()) return Status::error("missing weight " + spec.name);
    const Tensor& t = it->second;
    if (t.dtype() != DType::kF32 || t.device() != Device::kCPU)
      return Status::error("weight " + spec.name + " must be F32 in host memory");
    if (t.shape() != spec.shape)
      return Status::error("weight " + spec.name + " has shape " + shape_string(t.shape()) +
                           ", the model needs " + shape_string(spec.shape));
  }
  for (const auto& [name, t] : weights)
    if (!expected.count(name)) return Status::error("unexpected weight " + name + " for this model");
  return Status::ok();
}

}  // namespace packmoe
