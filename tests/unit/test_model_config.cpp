// Tests of train/model_config: every preset round-trips through config.json unchanged, a real
// HF-style config.json (with many keys we ignore) parses, every validation rule gives its own
// error message, HF's MoE-layer rule, and parameter_count against formulas written out here.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/checked_math.h"
#include "train/model_config.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path temp_dir() {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  fs::path dir = base / ("model_config_" + std::to_string(::getpid()) + "_" +
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void expect_equal(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.router_aux_loss_coef, b.router_aux_loss_coef);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
}

ModelConfig tiny() { return model_config_preset("tiny").value(); }

TEST(ModelConfig, EveryPresetRoundTripsThroughConfigJson) {
  fs::path dir = temp_dir();
  for (const std::string& name : model_config_preset_names()) {
    SCOPED_TRACE(name);
    Result<ModelConfig> preset = model_config_preset(name);
    ASSERT_TRUE(preset.is_ok()) << preset.status().message();
    const std::string path = (dir / (name + ".json")).string();
    ASSERT_TRUE(save_model_config(preset.value(), path).is_ok());
    // load_model_config refuses a model larger than this machine (qwen3_30b_a3b on a laptop);
    // the file's text round-trips all the same.
    const bool fits = check_model_fits(preset.value(), host_memory_bytes()).is_ok();
    std::ifstream file(path);
    const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    Result<ModelConfig> loaded = fits ? load_model_config(path) : parse_model_config(text);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
    expect_equal(preset.value(), loaded.value());
    // Atomic write: no temporary file is left next to the target.
    for (const auto& e : fs::directory_iterator(dir))
      EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

TEST(ModelConfig, RoundTripKeepsNonDefaultFields) {
  ModelConfig c = tiny();
  c.tie_word_embeddings = true;
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {0};
  c.router_aux_loss_coef = 0.01;
  c.initializer_range = 0.006;
  c.rms_norm_eps = 1e-5;
  Result<ModelConfig> back = model_config_from_json(model_config_to_json(c));
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  expect_equal(c, back.value());
}

TEST(ModelConfig, PresetShapes) {
  ModelConfig t = tiny();
  EXPECT_EQ(t.vocab_size, 256);
  EXPECT_EQ(t.hidden_size, 64);
  EXPECT_EQ(t.num_hidden_layers, 2);
  EXPECT_EQ(t.num_attention_heads, 4);
  EXPECT_EQ(t.num_key_value_heads, 2);
  EXPECT_EQ(t.head_dim, 16);
  EXPECT_EQ(t.num_experts, 4);
  EXPECT_EQ(t.num_experts_per_tok, 2);
  EXPECT_EQ(t.moe_intermediate_size, 32);

  ModelConfig q = model_config_preset("qwen3_30b_a3b_layers").value();
  EXPECT_EQ(q.hidden_size, 2048);
  EXPECT_EQ(q.num_attention_heads, 32);
  EXPECT_EQ(q.num_key_value_heads, 4);
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.num_experts_per_tok, 8);
  EXPECT_EQ(q.moe_intermediate_size, 768);
  EXPECT_TRUE(q.norm_topk_prob);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.num_hidden_layers, 4);
  EXPECT_EQ(q.vocab_size, 151936);
}

TEST(ModelConfig, UnknownPreset) {
  Result<ModelConfig> r = model_config_preset("huge");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(),
            "unknown model preset 'huge' (known: tiny, small, qwen3_30b_a3b_layers, "
            "qwen3_30b_a3b)");
}

// Qwen3-30B-A3B's config.json as published on the Hub: every key is read, checked or known to be
// without effect (docs/model-config.md).
constexpr const char* kHfConfig = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

TEST(ModelConfig, ParsesRealHfConfigAndKnowsEveryKey) {
  std::vector<std::string> unknown;
  Result<ModelConfig> r = parse_model_config(kHfConfig, &unknown);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(unknown.empty()) << unknown.front();
  ModelConfig c = r.value();
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  // The same shapes as our 4-layer preset, but 48 layers.
  ModelConfig preset = model_config_preset("qwen3_30b_a3b_layers").value();
  preset.num_hidden_layers = 48;
  expect_equal(preset, c);
  // The whole-model preset is that config.
  expect_equal(model_config_preset("qwen3_30b_a3b").value(), c);
  // Qwen3-30B-A3B: ~30.5B total, ~3.3B active (the model's name).
  ParameterCount n = parameter_count(c);
  EXPECT_NEAR(static_cast<double>(n.total), 30.5e9, 0.2e9);
  EXPECT_NEAR(static_cast<double>(n.active), 3.3e9, 0.1e9);
}

TEST(ModelConfig, HfFallbacksAndAliases) {
  // head_dim absent -> hidden / heads; v5 rope_parameters; num_local_experts alias; null = absent.
  Result<ModelConfig> r = parse_model_config(R"({"hidden_size": 256, "num_attention_heads": 8,
      "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "num_local_experts": 16, "num_experts_per_tok": 4, "head_dim": null, "vocab_size": 512,
      "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 2})");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().head_dim, 32);
  EXPECT_EQ(r.value().rope_theta, 5e5);
  EXPECT_EQ(r.value().num_experts, 16);
  // Other absent fields take the HF class defaults.
  EXPECT_FALSE(r.value().norm_topk_prob);
  EXPECT_EQ(r.value().rms_norm_eps, 1e-6);
  EXPECT_EQ(r.value().max_position_embeddings, 32768);
  // Absent sizes do not: the defaults are a 30B-class shape (issue 26: this partial config was
  // 1.2B parameters and died allocating them).
  EXPECT_EQ(parse_model_config(R"({"vocab_size": 1024, "num_hidden_layers": 2})").status().message(),
            "the config does not give hidden_size, intermediate_size, num_attention_heads, "
            "num_key_value_heads, num_experts, moe_intermediate_size, num_experts_per_tok "
            "(packmoe takes no model size from Qwen3MoeConfig's defaults, the shape of a "
            "30B-class model)");
  EXPECT_NE(parse_model_config("{}").status().message().find("does not give vocab_size"),
            std::string::npos);
  // A dense model (no experts) needs no expert sizes.
  json dense = model_config_to_json(tiny());
  dense["num_experts"] = 0;
  dense.erase("moe_intermediate_size");
  dense.erase("num_experts_per_tok");
  EXPECT_TRUE(model_config_from_json(dense).is_ok());
}

std::string error_of(const std::string& patch_text) {
  json j = model_config_to_json(tiny());
  j.merge_patch(json::parse(patch_text));
  Result<ModelConfig> r = model_config_from_json(j);
  return r.is_ok() ? "(no error)" : r.status().message();
}

// Each value packmoe does not implement is one error naming the field and the value; a value
// with no effect (sliding_window while use_sliding_window is false) is accepted.
TEST(ModelConfig, UnsupportedFieldsAreErrorsNamingFieldAndValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})",
       "rope_scaling.rope_type = \"yarn\" is not supported (packmoe implements rope_type "
       "\"default\" only)"},
      {R"({"rope_scaling": {"type": "linear", "factor": 2.0}})",
       "rope_scaling.type = \"linear\" is not supported"},
      {R"({"rope_scaling": {"rope_type": "default", "factor": 2.0}})",
       "rope_scaling.factor = 2.0 is not supported (the default RoPE takes rope_theta only)"},
      {R"({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})",
       "rope_parameters.rope_type = \"llama3\" is not supported"},
      {R"({"rope_parameters": {"rope_theta": 5e5, "partial_rotary_factor": 0.5}})",
       "rope_parameters.partial_rotary_factor = 0.5 is not supported"},
      {R"({"use_sliding_window": true, "sliding_window": 4096})",
       "use_sliding_window = true is not supported"},
      {R"({"layer_types": ["full_attention", "sliding_attention"]})",
       "layer_types[1] = \"sliding_attention\" is not supported"},
      {R"({"architectures": ["LlamaForCausalLM"]})",
       "architectures[0] = \"LlamaForCausalLM\" is not supported (packmoe trains "
       "Qwen3MoeForCausalLM)"},
      {R"({"model_type": "qwen3"})", "model_type = \"qwen3\" is not supported"},
      {R"({"attention_bias": true})", "attention_bias = true is not supported"},
      {R"({"hidden_act": "gelu"})", "hidden_act = \"gelu\" is not supported"},
      {R"({"attention_dropout": 0.1})", "attention_dropout = 0.1 is not supported"},
      {R"({"quantization_config": {"quant_method": "fp8"}})", "quantization_config = "},
      {R"({"num_experts": 4, "num_experts_per_tok": 5})",
       "num_experts_per_tok = 5 must not exceed num_experts = 4"},
  };
  for (const auto& [patch, needle] : cases) {
    SCOPED_TRACE(patch);
    const std::string e = error_of(patch);
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos);
  }
  EXPECT_EQ(error_of(R"({"sliding_window": 4096, "max_window_layers": 2, "rope_scaling": null,
                         "layer_types": ["full_attention", "full_attention"]})"),
            "(no error)");
  EXPECT_EQ(error_of(R"({"rope_scaling": {"rope_type": "default"}})"), "(no error)");
}

TEST(ModelConfig, UnknownKeysAreReportedInKeyOrder) {
  json j = model_config_to_json(tiny());
  j["frobnicate"] = 1;
  j["auto_map"] = {{"AutoModel", "x.Model"}};
  std::vector<std::string> unknown;
  ASSERT_TRUE(model_config_from_json(j, &unknown).is_ok());
  EXPECT_EQ(unknown, (std::vector<std::string>{"auto_map", "frobnicate"}));  // key order
  unknown.clear();
  ASSERT_TRUE(model_config_from_json(model_config_to_json(tiny()), &unknown).is_ok());
  EXPECT_TRUE(unknown.empty());
}

TEST(ModelConfig, EveryValidationError) {
  EXPECT_EQ(error_of(R"({"num_attention_heads": 32, "num_key_value_heads": 3})"),
            "num_key_value_heads = 3 must divide num_attention_heads = 32");
  EXPECT_EQ(error_of(R"({"model_type": "llama"})"),
            "model_type = \"llama\" is not supported (expected \"qwen3_moe\")");
  EXPECT_EQ(error_of(R"({"vocab_size": -1})"), "vocab_size = -1 must be positive");
  EXPECT_EQ(error_of(R"({"hidden_size": 0})"), "hidden_size = 0 must be positive");
  EXPECT_EQ(error_of(R"({"intermediate_size": -5})"), "intermediate_size = -5 must be positive");
  EXPECT_EQ(error_of(R"({"num_hidden_layers": 0})"), "num_hidden_layers = 0 must be positive");
  EXPECT_EQ(error_of(R"({"num_attention_heads": -4})"),
            "num_attention_heads = -4 must be positive");
  EXPECT_EQ(error_of(R"({"num_key_value_heads": 0})"), "num_key_value_heads = 0 must be positive");
  EXPECT_EQ(error_of(R"({"head_dim": -16})"), "head_dim = -16 must be positive");
  EXPECT_EQ(error_of(R"({"head_dim": 15})"), "head_dim = 15 must be even (RoPE)");
  EXPECT_EQ(error_of(R"({"max_position_embeddings": 0})"),
            "max_position_embeddings = 0 must be positive");
  EXPECT_EQ(error_of(R"({"rms_norm_eps": 0})"), "rms_norm_eps = 0 must be positive");
  EXPECT_EQ(error_of(R"({"rope_theta": -1.5})"), "rope_theta = -1.5 must be positive");
  EXPECT_EQ(error_of(R"({"initializer_range": 0.0})"), "initializer_range = 0 must be positive");
  EXPECT_EQ(error_of(R"({"decoder_sparse_step": 0})"), "decoder_sparse_step = 0 must be positive");
  EXPECT_EQ(error_of(R"({"num_experts": -2})"), "num_experts = -2 must not be negative");
  EXPECT_EQ(error_of(R"({"moe_intermediate_size": 0})"),
            "moe_intermediate_size = 0 must be positive");
  EXPECT_EQ(error_of(R"({"num_experts_per_tok": 0})"), "num_experts_per_tok = 0 must be positive");
  EXPECT_EQ(error_of(R"({"num_experts_per_tok": 5})"),
            "num_experts_per_tok = 5 must not exceed num_experts = 4");
  EXPECT_EQ(error_of(R"({"router_aux_loss_coef": -0.1})"),
            "router_aux_loss_coef = -0.1 must not be negative");
  EXPECT_EQ(error_of(R"({"mlp_only_layers": [0, 2]})"),
            "mlp_only_layers entry 2 is not a layer index in [0, 2)");
  // Wrong JSON types, each naming the field.
  EXPECT_EQ(error_of(R"({"hidden_size": "64"})"),
            "hidden_size must be an integer (got string \"64\")");
  EXPECT_EQ(error_of(R"({"hidden_size": 64.5})"),
            "hidden_size must be an integer (got number 64.5)");
  EXPECT_EQ(error_of(R"({"rope_theta": "1e6"})"),
            "rope_theta must be a number (got string \"1e6\")");
  EXPECT_EQ(error_of(R"({"norm_topk_prob": 1})"),
            "norm_topk_prob must be true or false (got number 1)");
  EXPECT_EQ(error_of(R"({"tie_word_embeddings": "false"})"),
            "tie_word_embeddings must be true or false (got string \"false\")");
  EXPECT_EQ(error_of(R"({"mlp_only_layers": 3})"),
            "mlp_only_layers must be an array of integers (got number 3)");
  EXPECT_EQ(error_of(R"({"mlp_only_layers": ["a"]})"),
            "mlp_only_layers must be an array of integers (got an entry string \"a\")");
  EXPECT_EQ(error_of(R"({"model_type": 7})"), "model_type must be a string (got number 7)");
  EXPECT_EQ(error_of(R"({"rope_parameters": 7})"),
            "rope_parameters must be an object (got number 7)");
  // Every preset is valid; so a patch of nothing is no error.
  EXPECT_EQ(error_of("{}"), "(no error)");

  // Not an object / not JSON / no file, and head_dim absent with an indivisible hidden size.
  EXPECT_EQ(parse_model_config("[1, 2]").status().message(),
            "config.json must be a JSON object (got an array of 2 values)");
  EXPECT_NE(parse_model_config("{\"hidden_size\": ")
                .status()
                .message()
                .find("config.json: not valid JSON: "),
            std::string::npos);
  json no_head_dim = model_config_to_json(tiny());
  no_head_dim.erase("head_dim");
  no_head_dim["hidden_size"] = 100;
  no_head_dim["num_attention_heads"] = 32;
  EXPECT_EQ(
      model_config_from_json(no_head_dim).status().message(),
      "head_dim is absent and hidden_size = 100 is not a multiple of num_attention_heads = 32");
  EXPECT_EQ(load_model_config("/nonexistent/config.json").status().message(),
            "cannot open model config: /nonexistent/config.json: cannot open: No such file or "
            "directory");
  // A file error names the file.
  fs::path path = temp_dir() / "config.json";
  json few = model_config_to_json(tiny());
  few["num_experts"] = 2;
  few["num_experts_per_tok"] = 3;
  std::ofstream(path) << few.dump();
  EXPECT_EQ(load_model_config(path.string()).status().message(),
            path.string() + ": num_experts_per_tok = 3 must not exceed num_experts = 2");
  // Saving refuses an invalid config and leaves no file.
  ModelConfig bad = tiny();
  bad.num_key_value_heads = 3;
  fs::path out = path.parent_path() / "bad.json";
  EXPECT_FALSE(save_model_config(bad, out.string()).is_ok());
  EXPECT_FALSE(fs::exists(out));
}

TEST(ModelConfig, IsMoeLayerFollowsHfRule) {
  ModelConfig c = tiny();
  c.num_hidden_layers = 6;
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(c.is_moe_layer(i));
  c.decoder_sparse_step = 2;  // (i + 1) % 2 == 0: layers 1, 3, 5
  c.mlp_only_layers = {3};
  std::vector<bool> moe;
  for (int i = 0; i < 6; ++i) moe.push_back(c.is_moe_layer(i));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
  c.num_experts = 0;  // a dense model
  for (int i = 0; i < 6; ++i) EXPECT_FALSE(c.is_moe_layer(i));
}

TEST(ModelConfig, ParameterCountOfTinyByHand) {
  // V=256, H=64, 2 layers, 4 heads / 2 kv heads, head_dim 16, E=4, k=2, F=32, untied.
  const int64_t embed = 256 * 64, lm_head = 256 * 64, final_norm = 64;
  const int64_t attn =
      64 * (4 * 16) + 2 * 64 * (2 * 16) + (4 * 16) * 64 + 2 * 16;  // q,k,v,o,qk-norm
  const int64_t norms = 2 * 64;
  const int64_t router = 4 * 64;
  const int64_t expert = 3 * 32 * 64;  // gate, up, down
  const int64_t layer_total = attn + norms + router + 4 * expert;
  const int64_t layer_active = attn + norms + router + 2 * expert;
  ParameterCount n = parameter_count(tiny());
  EXPECT_EQ(n.total, embed + lm_head + final_norm + 2 * layer_total);
  EXPECT_EQ(n.total, 107392);
  EXPECT_EQ(n.active, embed + lm_head + final_norm + 2 * layer_active);

  ModelConfig tied = tiny();
  tied.tie_word_embeddings = true;
  EXPECT_EQ(parameter_count(tied).total, n.total - lm_head);
  ModelConfig dense_layer0 = tiny();
  dense_layer0.mlp_only_layers = {0};
  EXPECT_EQ(parameter_count(dense_layer0).total,
            n.total - router - 4 * expert + 3 * dense_layer0.intermediate_size * 64);
}

TEST(ModelConfig, SmallIsAbout100M) {
  ParameterCount n = parameter_count(model_config_preset("small").value());
  EXPECT_EQ(n.total, 101787136);  // stated in the preset's comment
  EXPECT_EQ(n.active, 54601216);
  EXPECT_NEAR(static_cast<double>(n.total), 100e6, 5e6);
}

}  // namespace
}  // namespace packmoe::train
