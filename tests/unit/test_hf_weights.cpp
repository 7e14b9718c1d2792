// Tests of io/hf_weights: our model.safetensors is read back by a strict safetensors parser written
// here from the format text (not io/safetensors), its names and shapes are checked against a list
// typed out by hand for a 2-layer model, values round-trip bitwise (F32) or equal f32_to_bf16 byte
// for byte (BF16), and every bad file gives one error naming the file and the tensor.
// Files go to $PACKMOE_TEST_TMP (else the system temp dir), one fresh directory per test.
#include "io/hf_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/test_files.h"
#include "core/codecs.h"
#include "io/safetensors.h"
#include "train/model_config.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using test::read_raw;
using test::write_raw;
using Json = nlohmann::json;

// ---- an independent strict safetensors parser ---------------------------------------------------

struct StrictTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
struct StrictFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, StrictTensor> tensors;
};

// Bits per element of every dtype string of the format (huggingface/safetensors Dtype Display).
int strict_dtype_bits(const std::string& d) {
  static const std::map<std::string, int> kBits = {
      {"BOOL", 8},    {"U8", 8},          {"I8", 8},          {"I16", 16},    {"U16", 16},
      {"F16", 16},    {"BF16", 16},       {"I32", 32},        {"U32", 32},    {"F32", 32},
      {"F64", 64},    {"I64", 64},        {"U64", 64},        {"C64", 64},    {"F8_E5M2", 8},
      {"F8_E4M3", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"F8_E8M0", 8}, {"F4", 4},
      {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  auto it = kBits.find(d);
  return it == kBits.end() ? 0 : it->second;
}

// Parses a whole file, failing the test (and returning false) at the first rule it breaks.
bool strict_parse(const std::vector<uint8_t>& f, StrictFile* out) {
  EXPECT_GE(f.size(), 8u);
  if (f.size() < 8) return false;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{f[i]} << (8 * i);
  EXPECT_LE(n, f.size() - 8) << "header runs past the file";
  if (n > f.size() - 8) return false;
  EXPECT_EQ(n % 8, 0u) << "the reference writer pads the header to a multiple of 8";
  const std::string header(f.begin() + 8, f.begin() + 8 + static_cast<int64_t>(n));
  EXPECT_EQ(header.front(), '{');
  const size_t close = header.find_last_of('}');
  EXPECT_NE(close, std::string::npos);
  if (close == std::string::npos) return false;
  for (size_t i = close + 1; i < header.size(); ++i) {
    EXPECT_EQ(header[i], ' ') << "header padding must be spaces";
  }
  const Json j = Json::parse(header.substr(0, close + 1), nullptr, false);
  EXPECT_TRUE(j.is_object());
  if (!j.is_object()) return false;
  const uint64_t buffer = f.size() - 8 - n;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      EXPECT_TRUE(v.is_object());
      for (const auto& [k, s] : v.items()) {
        EXPECT_TRUE(s.is_string()) << "metadata values are strings";
        if (s.is_string()) out->metadata[k] = s.get<std::string>();
      }
      continue;
    }
    EXPECT_TRUE(v.is_object() && v.size() == 3 && v.contains("dtype") && v.contains("shape") &&
                v.contains("data_offsets"))
        << name << ": exactly dtype, shape, data_offsets";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return false;
    }
    StrictTensor t;
    t.dtype = v["dtype"].get<std::string>();
    const int bits = strict_dtype_bits(t.dtype);
    EXPECT_GT(bits, 0) << name << ": dtype " << t.dtype << " is not in the spec";
    uint64_t numel = 1;
    for (const Json& d : v["shape"]) {
      EXPECT_TRUE(d.is_number_unsigned()) << name;
      t.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
    }
    const Json& off = v["data_offsets"];
    EXPECT_TRUE(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                off[1].is_number_unsigned())
        << name;
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    EXPECT_LE(b, e) << name;
    EXPECT_LE(e, buffer) << name;
    if (b > e || e > buffer || bits == 0) return false;
    EXPECT_EQ(e - b, numel * static_cast<uint64_t>(bits) / 8) << name << ": shape x dtype size";
    EXPECT_EQ(b % (static_cast<uint64_t>(bits) / 8), 0u) << name << ": aligned to its element size";
    const auto* data = f.data() + 8 + n;
    t.bytes.assign(data + b, data + e);
    spans.push_back({b, e, name});
    out->tensors[name] = std::move(t);
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.begin < y.begin; });
  uint64_t pos = 0;
  for (const Span& s : spans) {
    EXPECT_EQ(s.begin, pos) << s.name << ": a gap or an overlap before it";
    pos = s.end;
  }
  EXPECT_EQ(pos, buffer) << "tensors must cover the data buffer exactly";
  return !::testing::Test::HasFailure();
}

// ---- fixtures -----------------------------------------------------------------------------------

// 2 layers, H = 8, 2 query heads and 1 KV head of 4, E = 4 experts of F = 6, V = 48.
ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 48;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.moe_intermediate_size = 6;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.max_position_embeddings = 64;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  return c;
}

// Every HF tensor of tiny_config() (untied), typed out.
const std::vector<std::pair<std::string, std::vector<int64_t>>>& tiny_hf_names() {
  static const std::vector<std::pair<std::string, std::vector<int64_t>>> kNames = {
      {"model.embed_tokens.weight", {48, 8}},
      {"model.layers.0.input_layernorm.weight", {8}},
      {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.0.self_attn.k_proj.weight", {4, 8}},
      {"model.layers.0.self_attn.v_proj.weight", {4, 8}},
      {"model.layers.0.self_attn.o_proj.weight", {8, 8}},
      {"model.layers.0.self_attn.q_norm.weight", {4}},
      {"model.layers.0.self_attn.k_norm.weight", {4}},
      {"model.layers.0.post_attention_layernorm.weight", {8}},
      {"model.layers.0.mlp.gate.weight", {4, 8}},
      {"model.layers.0.mlp.experts.0.gate_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.0.up_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.0.down_proj.weight", {8, 6}},
      {"model.layers.0.mlp.experts.1.gate_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.1.up_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.1.down_proj.weight", {8, 6}},
      {"model.layers.0.mlp.experts.2.gate_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.2.up_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.2.down_proj.weight", {8, 6}},
      {"model.layers.0.mlp.experts.3.gate_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.3.up_proj.weight", {6, 8}},
      {"model.layers.0.mlp.experts.3.down_proj.weight", {8, 6}},
      {"model.layers.1.input_layernorm.weight", {8}},
      {"model.layers.1.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.1.self_attn.k_proj.weight", {4, 8}},
      {"model.layers.1.self_attn.v_proj.weight", {4, 8}},
      {"model.layers.1.self_attn.o_proj.weight", {8, 8}},
      {"model.layers.1.self_attn.q_norm.weight", {4}},
      {"model.layers.1.self_attn.k_norm.weight", {4}},
      {"model.layers.1.post_attention_layernorm.weight", {8}},
      {"model.layers.1.mlp.gate.weight", {4, 8}},
      {"model.layers.1.mlp.experts.0.gate_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.0.up_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.0.down_proj.weight", {8, 6}},
      {"model.layers.1.mlp.experts.1.gate_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.1.up_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.1.down_proj.weight", {8, 6}},
      {"model.layers.1.mlp.experts.2.gate_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.2.up_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.2.down_proj.weight", {8, 6}},
      {"model.layers.1.mlp.experts.3.gate_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.3.up_proj.weight", {6, 8}},
      {"model.layers.1.mlp.experts.3.down_proj.weight", {8, 6}},
      {"model.norm.weight", {8}},
      {"lm_head.weight", {48, 8}},
  };
  return kNames;
}

class HfWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("hf_weights_");
    seed_ = test::recorded_random_seed();
    rng_.seed(seed_);
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Normal values, with every 4th element a random bit pattern (NaN payloads, Inf, subnormals,
  // BF16 rounding ties all occur), so bitwise claims are tested on awkward values too.
  ModelWeights random_weights(const ModelConfig& c) {
    ModelWeights w;
    std::normal_distribution<float> normal(0.f, 0.5f);
    std::uniform_int_distribution<uint32_t> bits;
    for (const ParamSpec& s : model_param_specs(c)) {
      Tensor t = Tensor::empty(cpu_backend(), DType::kF32, s.shape);
      float* p = t.data_as<float>();
      for (int64_t i = 0; i < t.numel(); ++i) {
        p[i] = (i % 4 == 3) ? f32_from_bits(bits(rng_)) : normal(rng_);
      }
      w.emplace(s.name, t);
    }
    return w;
  }

  fs::path dir_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// The F32 values HF tensor `name` must hold, indexed straight from the packed layout:
// experts.gate_up_proj (E, 2F, H) row r of expert j at (j * 2F + r) * H, experts.down_proj
// (E, H, F), dense gate_up_proj (2I, H).
std::vector<float> expected_values(const ModelWeights& w, const std::string& name,
                                   const ModelConfig& c) {
  const std::string experts = ".mlp.experts.";
  const size_t at = name.find(experts);
  const size_t dense = name.find(".mlp.gate_proj.weight") != std::string::npos
                           ? name.find(".mlp.gate_proj.weight")
                           : name.find(".mlp.up_proj.weight");
  if (dense != std::string::npos) {  // gate_up_proj (2I, H): gate rows [0, I), up rows [I, 2I)
    const float* gu = w.at(name.substr(0, dense) + ".mlp.gate_up_proj").data_as<float>();
    const int64_t I = c.intermediate_size, H = c.hidden_size;
    const int64_t row0 = name.find(".mlp.gate_proj.") != std::string::npos ? 0 : I;
    return std::vector<float>(gu + row0 * H, gu + (row0 + I) * H);
  }
  if (at == std::string::npos) {
    const Tensor& t = w.at(name);
    return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
  }
  const std::string layer = name.substr(0, at);               // "model.layers.N"
  const std::string rest = name.substr(at + experts.size());  // "J.up_proj.weight"
  const int64_t j = std::stoll(rest.substr(0, rest.find('.')));
  const std::string which = rest.substr(rest.find('.') + 1);
  const int64_t F = c.moe_intermediate_size, H = c.hidden_size;
  std::vector<float> out;
  if (which == "down_proj.weight") {
    const float* d = w.at(layer + ".mlp.experts.down_proj").data_as<float>();
    for (int64_t r = 0; r < H; ++r)
      for (int64_t k = 0; k < F; ++k) out.push_back(d[(j * H + r) * F + k]);
  } else {
    const float* gu = w.at(layer + ".mlp.experts.gate_up_proj").data_as<float>();
    const int64_t row0 = which == "gate_proj.weight" ? 0 : F;
    for (int64_t r = 0; r < F; ++r)
      for (int64_t k = 0; k < H; ++k) out.push_back(gu[(j * 2 * F + row0 + r) * H + k]);
  }
  return out;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Rewrites safetensors file `in` to `out` with `edit` applied to the list of tensors.
struct RawTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
template <typename Edit>
void rewrite(const std::string& in, const std::string& out, Edit edit) {
  auto file = SafetensorsFile::read(in);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  std::vector<RawTensor> ts;
  for (const auto& e : file.value().entries()) {
    ts.push_back({e.name, e.dtype, e.shape, {e.bytes.begin(), e.bytes.end()}});
  }
  edit(ts);
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (auto& t : ts) w.add(t.name, t.dtype, t.shape, std::move(t.bytes));
  ASSERT_TRUE(w.write(out).is_ok());
}

void expect_error(const Result<ModelWeights>& r, const std::vector<std::string>& parts) {
  ASSERT_FALSE(r.is_ok()) << "expected an error mentioning " << parts.front();
  const std::string& m = r.status().message();
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const std::string& p : parts)
    EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
}

// ---- names and layout
// -----------------------------------------------------------------------------

TEST_F(HfWeightsTest, StrictParserSeesEveryHfNameAndShape) {
  const ModelConfig c = tiny_config();
  const ModelWeights w = random_weights(c);
  const std::string p = path("model.safetensors");
  ASSERT_TRUE(save_hf_weights(p, c, w, DType::kF32).is_ok());
  StrictFile f;
  ASSERT_TRUE(strict_parse(read_raw(p), &f));
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(f.tensors.size(), tiny_hf_names().size());
  for (const auto& [name, shape] : tiny_hf_names()) {
    auto it = f.tensors.find(name);
    ASSERT_NE(it, f.tensors.end()) << name;
    EXPECT_EQ(it->second.shape, shape) << name;
    EXPECT_EQ(it->second.dtype, "F32") << name;
  }
  // hf_tensor_specs lists the same names and shapes.
  std::set<std::string> listed;
  for (const HfTensorSpec& s : hf_tensor_specs(c)) {
    listed.insert(s.hf_name);
    ASSERT_TRUE(f.tensors.count(s.hf_name)) << s.hf_name;
    EXPECT_EQ(f.tensors.at(s.hf_name).shape, std::vector<int64_t>(s.shape.begin(), s.shape.end()));
  }
  EXPECT_EQ(listed.size(), tiny_hf_names().size());
}

TEST_F(HfWeightsTest, TiedEmbeddingsAndDenseLayers) {
  ModelConfig c = tiny_config();
  c.tie_word_embeddings = true;
  c.mlp_only_layers = {1};
  const ModelWeights w = random_weights(c);
  const std::string p = path("model.safetensors");
  ASSERT_TRUE(save_hf_weights(p, c, w, DType::kF32).is_ok());
  StrictFile f;
  ASSERT_TRUE(strict_parse(read_raw(p), &f));
  EXPECT_FALSE(f.tensors.count("lm_head.weight"));
  const std::vector<std::pair<std::string, std::vector<int64_t>>> dense = {
      {"model.layers.1.mlp.gate_proj.weight", {12, 8}},
      {"model.layers.1.mlp.up_proj.weight", {12, 8}},
      {"model.layers.1.mlp.down_proj.weight", {8, 12}}};
  for (const auto& [name, shape] : dense) {
    ASSERT_TRUE(f.tensors.count(name)) << name;
    EXPECT_EQ(f.tensors.at(name).shape, shape);
  }
  for (const auto& [name, t] : f.tensors) {
    EXPECT_EQ(name.find("model.layers.1.mlp.experts"), std::string::npos) << name;
    EXPECT_NE(name, "model.layers.1.mlp.gate.weight");
  }
  // 45 untied names - lm_head - layer 1's router and 12 expert tensors + 3 dense.
  EXPECT_EQ(f.tensors.size(), 45u - 1 - 13 + 3);
  for (const auto& [name, t] : f.tensors) {
    const std::vector<float> want = expected_values(w, name, c);
    ASSERT_EQ(t.bytes.size(), want.size() * 4) << name;
    EXPECT_EQ(std::memcmp(t.bytes.data(), want.data(), t.bytes.size()), 0) << name;
  }
  auto back = load_hf_weights(p, c);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  for (const auto& [name, t] : w) EXPECT_TRUE(same_bytes(t, back.value().at(name))) << name;
}

// ---- round trips
// ----------------------------------------------------------------------------------

TEST_F(HfWeightsTest, F32RoundTripIsBitwise) {
  for (bool tied : {false, true}) {
    ModelConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    const ModelWeights w = random_weights(c);
    const std::string p = path(tied ? "tied.safetensors" : "untied.safetensors");
    ASSERT_TRUE(save_hf_weights(p, c, w, DType::kF32).is_ok());
    StrictFile f;
    ASSERT_TRUE(strict_parse(read_raw(p), &f));
    for (const auto& [name, t] : f.tensors) {
      const std::vector<float> want = expected_values(w, name, c);
      ASSERT_EQ(t.bytes.size(), want.size() * 4) << name;
      EXPECT_EQ(std::memcmp(t.bytes.data(), want.data(), t.bytes.size()), 0) << name;
    }
    auto back = load_hf_weights(p, c);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_TRUE(validate_model_weights(c, back.value()).is_ok());
    ASSERT_EQ(back.value().size(), w.size());
    for (const auto& [name, t] : w) EXPECT_TRUE(same_bytes(t, back.value().at(name))) << name;
  }
}

TEST_F(HfWeightsTest, Bf16IsRoundToNearestEvenAndWidensExactly) {
  for (bool tied : {false, true}) {
    ModelConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    const ModelWeights w = random_weights(c);
    const std::string p = path("model.safetensors");
    ASSERT_TRUE(save_hf_weights(p, c, w, DType::kBF16).is_ok());
    StrictFile f;
    ASSERT_TRUE(strict_parse(read_raw(p), &f));
    EXPECT_EQ(f.tensors.size(), tiny_hf_names().size() - (tied ? 1 : 0));
    for (const auto& [name, t] : f.tensors) {
      EXPECT_EQ(t.dtype, "BF16") << name;
      const std::vector<float> src = expected_values(w, name, c);
      std::vector<uint8_t> want(src.size() * 2);
      for (size_t i = 0; i < src.size(); ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        want[2 * i] = static_cast<uint8_t>(h & 0xFF);
        want[2 * i + 1] = static_cast<uint8_t>(h >> 8);
      }
      EXPECT_EQ(t.bytes, want) << name;
    }
    auto back = load_hf_weights(p, c);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    for (const auto& [name, t] : w) {
      const Tensor& b = back.value().at(name);
      ASSERT_EQ(b.shape(), t.shape());
      for (int64_t i = 0; i < t.numel(); ++i) {
        const uint32_t want = f32_bits(bf16_to_f32(f32_to_bf16(t.data_as<float>()[i])));
        ASSERT_EQ(f32_bits(b.data_as<float>()[i]), want) << name << "[" << i << "]";
      }
    }
    // Saving the widened weights again as BF16 gives the same file.
    const std::string p2 = path("again.safetensors");
    ASSERT_TRUE(save_hf_weights(p2, c, back.value(), DType::kBF16).is_ok());
    EXPECT_EQ(read_raw(p2), read_raw(p));
  }
}

TEST_F(HfWeightsTest, LoadsADirectoryAndMixedDtypes) {
  const ModelConfig c = tiny_config();
  const ModelWeights w = random_weights(c);
  ASSERT_TRUE(save_hf_weights(path(kHfWeightsFile), c, w, DType::kF32).is_ok());
  // One tensor converted to BF16 by hand: per-tensor dtypes are allowed.
  const std::string name = "model.layers.1.mlp.experts.2.up_proj.weight";
  rewrite(path(kHfWeightsFile), path(kHfWeightsFile), [&](std::vector<RawTensor>& ts) {
    for (auto& t : ts) {
      if (t.name != name) continue;
      std::vector<uint8_t> b(t.bytes.size() / 2);
      for (size_t i = 0; i < b.size() / 2; ++i) {
        float x;
        std::memcpy(&x, t.bytes.data() + 4 * i, 4);
        const uint16_t h = f32_to_bf16(x);
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
      t.dtype = "BF16";
      t.bytes = std::move(b);
    }
  });
  auto back = load_hf_weights(dir_.string(), c);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  const float* gu = back.value().at("model.layers.1.mlp.experts.gate_up_proj").data_as<float>();
  const float* src = w.at("model.layers.1.mlp.experts.gate_up_proj").data_as<float>();
  const int64_t F = 6, H = 8;
  for (int64_t i = 0; i < 2 * F * H; ++i) {
    const int64_t at = 2 * 2 * F * H + i;  // expert 2: gate rows exact, up rows through BF16
    const float want = i < F * H ? src[at] : bf16_to_f32(f32_to_bf16(src[at]));
    EXPECT_EQ(f32_bits(gu[at]), f32_bits(want)) << i;
  }
}

// The tiny preset's real initialisation (nn/model random_model_weights), also with a dense layer.
TEST_F(HfWeightsTest, PresetWeightsRoundTrip) {
  for (bool dense : {false, true}) {
    auto c = train::model_config_preset("tiny");
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    if (dense) c.value().mlp_only_layers = {0};
    const ModelWeights w = random_model_weights(c.value(), rng_());
    const std::string p = path("tiny.safetensors");
    ASSERT_TRUE(save_hf_weights(p, c.value(), w, DType::kF32).is_ok());
    auto back = load_hf_weights(p, c.value());
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_TRUE(validate_model_weights(c.value(), back.value()).is_ok());
    for (const auto& [name, t] : w) EXPECT_TRUE(same_bytes(t, back.value().at(name))) << name;
    ASSERT_TRUE(save_hf_weights(p, c.value(), w, DType::kBF16).is_ok());
    EXPECT_TRUE(load_hf_weights(p, c.value()).is_ok());
  }
}

// transformers 5's fused expert tensors: written on request, read per packed tensor.
TEST_F(HfWeightsTest, FusedExpertTensors) {
  const ModelConfig c = tiny_config();
  const ModelWeights w = random_weights(c);
  const std::string fused = path("fused.safetensors");
  ASSERT_TRUE(save_hf_weights(fused, c, w, DType::kF32, HfExpertLayout::kFused).is_ok());
  StrictFile f;
  ASSERT_TRUE(strict_parse(read_raw(fused), &f));
  EXPECT_EQ(f.tensors.size(), 45u - 2 * 12 + 2 * 2);
  for (const char* layer : {"model.layers.0", "model.layers.1"}) {
    const std::string gu = std::string(layer) + ".mlp.experts.gate_up_proj";
    const std::string down = std::string(layer) + ".mlp.experts.down_proj";
    ASSERT_TRUE(f.tensors.count(gu) && f.tensors.count(down)) << layer;
    EXPECT_EQ(f.tensors.at(gu).shape, (std::vector<int64_t>{4, 12, 8}));
    EXPECT_EQ(f.tensors.at(down).shape, (std::vector<int64_t>{4, 8, 6}));
    EXPECT_EQ(std::memcmp(f.tensors.at(gu).bytes.data(), w.at(gu).data(), w.at(gu).nbytes()), 0);
  }
  for (const auto& [name, t] : f.tensors) EXPECT_EQ(name.find(".experts.0."), std::string::npos);
  auto back = load_hf_weights(fused, c);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  for (const auto& [name, t] : w) EXPECT_TRUE(same_bytes(t, back.value().at(name))) << name;

  // Layer 0 fused, layer 1 per expert: each packed tensor is detected on its own.
  const std::string per_expert = path("per_expert.safetensors");
  ASSERT_TRUE(save_hf_weights(per_expert, c, w, DType::kBF16).is_ok());
  const std::string mixed = path("mixed.safetensors");
  auto fused_file = SafetensorsFile::read(fused);
  ASSERT_TRUE(fused_file.is_ok());
  auto add_fused_layer0 = [&](std::vector<RawTensor>& ts) {
    std::erase_if(
        ts, [](const RawTensor& t) { return t.name.starts_with("model.layers.0.mlp.experts."); });
    for (const char* n :
         {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}) {
      const SafetensorsEntry* e = fused_file.value().find(n);
      ts.push_back({e->name, e->dtype, e->shape, {e->bytes.begin(), e->bytes.end()}});
    }
  };
  rewrite(per_expert, mixed, add_fused_layer0);
  auto m = load_hf_weights(mixed, c);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  for (const auto& [name, t] : w) {
    const bool exact = name.starts_with("model.layers.0.mlp.experts.");
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float x = t.data_as<float>()[i];
      const float want = exact ? x : bf16_to_f32(f32_to_bf16(x));
      ASSERT_EQ(f32_bits(m.value().at(name).data_as<float>()[i]), f32_bits(want))
          << name << "[" << i << "]";
    }
  }

  // Both layouts of one packed tensor: the per-expert copies are unexpected.
  rewrite(per_expert, mixed, [&](std::vector<RawTensor>& ts) {
    const SafetensorsEntry* e = fused_file.value().find("model.layers.1.mlp.experts.down_proj");
    ts.push_back({e->name, e->dtype, e->shape, {e->bytes.begin(), e->bytes.end()}});
  });
  expect_error(load_hf_weights(mixed, c),
               {mixed, "model.layers.1.mlp.experts.0.down_proj.weight", "unexpected"});
  // A fused tensor of another expert count.
  rewrite(fused, mixed, [&](std::vector<RawTensor>& ts) {
    for (auto& t : ts)
      if (t.name == "model.layers.1.mlp.experts.down_proj") {
        t.shape = {2, 8, 12};
      }
  });
  expect_error(load_hf_weights(mixed, c),
               {mixed, "model.layers.1.mlp.experts.down_proj", "(2, 8, 12)", "(4, 8, 6)"});
}

// Sharded HF directories: model.safetensors.index.json maps each tensor to a shard.
TEST_F(HfWeightsTest, ReadsShardedDirectories) {
  const ModelConfig c = tiny_config();
  const ModelWeights w = random_weights(c);
  const std::string whole = path("whole.safetensors");
  ASSERT_TRUE(save_hf_weights(whole, c, w, DType::kBF16).is_ok());
  const fs::path shards = dir_ / "sharded";
  fs::create_directories(shards);
  Json weight_map = Json::object();
  auto shard_name = [](const std::string& n) {
    return n.find("layers.1.") != std::string::npos ? "model-00002-of-00002.safetensors"
                                                    : "model-00001-of-00002.safetensors";
  };
  for (int k = 1; k <= 2; ++k) {
    const std::string file =
        k == 1 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    rewrite(whole, (shards / file).string(), [&](std::vector<RawTensor>& ts) {
      std::erase_if(ts, [&](const RawTensor& t) { return shard_name(t.name) != file; });
      for (const auto& t : ts) weight_map[t.name] = file;
    });
  }
  const auto write_index = [&](const Json& map) {
    const std::string text = Json{{"metadata", {{"total_size", 1}}}, {"weight_map", map}}.dump(2);
    write_raw((shards / kHfIndexFile).string(), std::vector<uint8_t>(text.begin(), text.end()));
  };
  write_index(weight_map);
  auto sharded = load_hf_weights(shards.string(), c);
  auto single = load_hf_weights(whole, c);
  ASSERT_TRUE(sharded.is_ok()) << sharded.status().message();
  ASSERT_TRUE(single.is_ok()) << single.status().message();
  for (const auto& [name, t] : single.value())
    EXPECT_TRUE(same_bytes(t, sharded.value().at(name))) << name;

  // The index says shard 1 but the tensor sits in shard 2.
  const std::string moved = "model.layers.1.self_attn.q_proj.weight";
  Json bad = weight_map;
  bad[moved] = "model-00001-of-00002.safetensors";
  write_index(bad);
  expect_error(load_hf_weights(shards.string(), c), {moved, "model-0000", "index"});
  // A tensor the index does not list.
  bad = weight_map;
  bad.erase(moved);
  write_index(bad);
  expect_error(load_hf_weights(shards.string(), c), {moved, kHfIndexFile, "missing"});
  // A shard path outside the directory.
  bad = weight_map;
  bad[moved] = "../whole.safetensors";
  write_index(bad);
  expect_error(load_hf_weights(shards.string(), c), {moved, kHfIndexFile});
  // A missing shard file.
  fs::remove(shards / "model-00002-of-00002.safetensors");
  write_index(weight_map);
  expect_error(load_hf_weights(shards.string(), c), {"model-00002-of-00002.safetensors"});
}

// ---- errors
// ---------------------------------------------------------------------------------------

TEST_F(HfWeightsTest, EveryBadFileIsOneClearError) {
  const ModelConfig c = tiny_config();
  const ModelWeights w = random_weights(c);
  const std::string good = path("good.safetensors");
  ASSERT_TRUE(save_hf_weights(good, c, w, DType::kF32).is_ok());
  const std::string bad = path("bad.safetensors");
  const std::string victim = "model.layers.1.mlp.experts.3.down_proj.weight";

  rewrite(good, bad, [&](std::vector<RawTensor>& ts) {
    std::erase_if(ts, [&](const RawTensor& t) { return t.name == victim; });
  });
  expect_error(load_hf_weights(bad, c), {bad, victim, "missing"});

  rewrite(good, bad, [&](std::vector<RawTensor>& ts) {
    ts.push_back({"model.layers.0.mlp.experts.4.gate_proj.weight",
                  "F32",
                  {6, 8},
                  std::vector<uint8_t>(6 * 8 * 4)});
  });
  expect_error(load_hf_weights(bad, c),
               {bad, "model.layers.0.mlp.experts.4.gate_proj.weight", "unexpected"});

  rewrite(good, bad, [&](std::vector<RawTensor>& ts) {
    for (auto& t : ts)
      if (t.name == victim) t.shape = {6, 8};  // (H, F) stored as (F, H): same byte count
  });
  expect_error(load_hf_weights(bad, c), {bad, victim, "shape (6, 8)", "(8, 6)"});

  rewrite(good, bad, [&](std::vector<RawTensor>& ts) {
    for (auto& t : ts)
      if (t.name == victim) {
        t.dtype = "F16";
        t.bytes.resize(t.bytes.size() / 2);
      }
  });
  expect_error(load_hf_weights(bad, c), {bad, victim, "F16"});

  // Truncated: the header promises more data than the file holds.
  std::vector<uint8_t> bytes = read_raw(good);
  write_raw(bad, std::vector<uint8_t>(bytes.begin(), bytes.end() - 100));
  expect_error(load_hf_weights(bad, c), {bad});
  write_raw(bad, std::vector<uint8_t>(bytes.begin(), bytes.begin() + 5));
  expect_error(load_hf_weights(bad, c), {bad});

  // Corrupted header: one byte of the JSON flipped, and a dtype string made unknown.
  std::vector<uint8_t> flipped = bytes;
  flipped[8] = 'x';
  write_raw(bad, flipped);
  expect_error(load_hf_weights(bad, c), {bad, "JSON"});
  std::string text(bytes.begin(), bytes.end());
  const size_t at = text.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 5, "\"F33\"");
  write_raw(bad, std::vector<uint8_t>(text.begin(), text.end()));
  expect_error(load_hf_weights(bad, c), {bad, "F33"});

  expect_error(load_hf_weights(path("absent.safetensors"), c), {path("absent.safetensors")});
  fs::create_directories(dir_ / "empty");
  expect_error(load_hf_weights((dir_ / "empty").string(), c),
               {(dir_ / "empty").string(), kHfWeightsFile});
}

TEST_F(HfWeightsTest, CheckpointOfAnotherModelIsRejected) {
  const ModelConfig c = tiny_config();
  const std::string p = path("model.safetensors");
  ASSERT_TRUE(save_hf_weights(p, c, random_weights(c), DType::kBF16).is_ok());

  ModelConfig wider = c;
  wider.hidden_size = 16;
  expect_error(load_hf_weights(p, wider), {p, "model.", "shape", "another model"});

  ModelConfig more_experts = c;
  more_experts.num_experts = 8;
  expect_error(load_hf_weights(p, more_experts), {p, "model.layers.", "missing"});

  ModelConfig fewer_experts = c;
  fewer_experts.num_experts = 3;
  expect_error(load_hf_weights(p, fewer_experts), {p, ".mlp.experts.3.", "unexpected"});

  ModelConfig deeper = c;
  deeper.num_hidden_layers = 3;
  expect_error(load_hf_weights(p, deeper), {p, "model.layers.2.", "missing"});

  ModelConfig untied = c;
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  expect_error(load_hf_weights(p, tied), {p, "lm_head.weight", "unexpected"});
  const std::string pt = path("tied.safetensors");
  ASSERT_TRUE(save_hf_weights(pt, tied, random_weights(tied), DType::kF32).is_ok());
  expect_error(load_hf_weights(pt, untied), {pt, "lm_head.weight", "missing"});
}

TEST_F(HfWeightsTest, SaveRefusesBadInputAndLeavesNoFile) {
  const ModelConfig c = tiny_config();
  ModelWeights w = random_weights(c);
  const std::string p = path("model.safetensors");
  Status s = save_hf_weights(p, c, w, DType::kE4M3);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("BF16"), std::string::npos) << s.message();
  w.erase("model.norm.weight");
  s = save_hf_weights(p, c, w, DType::kF32);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(p), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir_));  // no temporary file left behind either
}

}  // namespace
}  // namespace packmoe::io
