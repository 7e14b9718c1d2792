// The model's parameter list (names, shapes, init rule, weight decay), its deterministic random
// init (written by the init ops straight into the backend's memory) and the check of a
// ModelWeights map against it. The list order is the model's parameter order everywhere
// (optimizer, checkpoints, Philox streams of the init).
#include <set>

#include "backend/ops/init.h"
#include "nn/grouped_storage.h"
#include "nn/model.h"

namespace packmoe {
namespace {

std::string layer_name(int64_t i, const char* rest) {
  return "model.layers." + std::to_string(i) + "." + rest;
}

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

ModelWeights random_model_weights(Backend& backend, const ModelConfig& config, uint64_t seed) {
  const std::vector<ParamSpec> specs = model_param_specs(config);
  ModelWeights w;
  for (size_t p = 0; p < specs.size(); ++p) {
    const ParamSpec& spec = specs[p];
    Tensor t = Tensor::empty(backend, DType::kF32, spec.shape);
    if (spec.init == ParamInit::kOnes) {
      check_op(ops::fill_f32(backend, FillArgs{1.0f, t.data_as<float>(), t.numel()}), "init: ones");
    } else {
      InitNormalArgs a;
      a.seed = seed;
      a.stream = static_cast<uint32_t>(p);
      a.stddev = config.initializer_range;
      a.out = t.data_as<float>();
      a.n = t.numel();
      check_op(ops::init_normal(backend, a), "init: normal");
    }
    w.emplace(spec.name, std::move(t));
  }
  return w;
}

ModelWeights random_model_weights(const ModelConfig& config, uint64_t seed) {
  return random_model_weights(cpu_backend(), config, seed);
}

Status validate_model_weights(const ModelConfig& config, const ModelWeights& weights,
                              Device device) {
  std::set<std::string> expected;
  for (const ParamSpec& spec : model_param_specs(config)) {
    expected.insert(spec.name);
    const auto it = weights.find(spec.name);
    if (it == weights.end()) return Status::error("missing weight " + spec.name);
    const Tensor& t = it->second;
    if (t.dtype() != DType::kF32 || (t.device() != Device::kCPU && t.device() != device))
      return Status::error("weight " + spec.name + " must be F32 in host memory" +
                           (device == Device::kCPU
                                ? std::string()
                                : " or on " + std::string(device_name(device))));
    if (t.shape() != spec.shape)
      return Status::error("weight " + spec.name + " has shape " + shape_string(t.shape()) +
                           ", the model needs " + shape_string(spec.shape));
  }
  for (const auto& [name, t] : weights)
    if (!expected.count(name)) return Status::error("unexpected weight " + name + " for this model");
  return Status::ok();
}

}  // namespace packmoe
