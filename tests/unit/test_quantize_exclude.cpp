// `packmoe quantize` on a model's tensor names: ModelOpt's default exclusions (embedding, LM head,
// router, norms stay in their dtype, byte for byte), --exclude replacing them, and --2d on a
// tensor whose rows are no multiple of the tile (1-D blocks, the bytes of a 1-D run, named in the
// metadata) while the others take 2-D tiles. Fresh random weights.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "core/codecs.h"
#include "io/safetensors.h"

namespace packmoe {
namespace {

namespace fs = std::filesystem;
using test::run_cli;

std::vector<uint8_t> random_bf16(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<uint8_t> b(n * 2);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = f32_to_bf16(d(rng));
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

std::vector<uint8_t> bytes(const io::SafetensorsFile& f, const std::string& name) {
  const io::SafetensorsEntry* e = f.find(name);
  EXPECT_NE(e, nullptr) << name;
  return e ? std::vector<uint8_t>(e->bytes.begin(), e->bytes.end()) : std::vector<uint8_t>{};
}

class QuantizeExclude : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("quantize_exclude_");
    std::mt19937_64 rng(test::recorded_random_seed());
    io::SafetensorsWriter w;
    for (const auto& [name, rows] : std::vector<std::pair<std::string, int64_t>>{
             {"model.embed_tokens.weight", 256},
             {"lm_head.weight", 256},
             {"model.layers.0.mlp.gate.weight", 4},            // the router: 4 experts
             {"model.layers.0.self_attn.q_proj.weight", 64},
             {"model.layers.0.self_attn.k_proj.weight", 16}})  // 16 rows: no 32-row tile
      w.add(name, "BF16", {rows, 64}, random_bf16(rows * 64, rng));
    w.add("model.layers.0.input_layernorm.weight", "BF16", {64}, random_bf16(64, rng));
    ASSERT_TRUE(w.write(in().string()).is_ok());
    input_.emplace(io::SafetensorsFile::read(in().string()).value());
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  fs::path in() const { return dir_ / "in.safetensors"; }
  // Runs quantize with `flags`; the output file read back.
  io::SafetensorsFile quantize(const std::string& flags, const std::string& out) {
    const fs::path p = dir_ / out;
    test::RunResult r = run_cli("quantize --format mxfp8 --device cpu " + flags + " --in " +
                                in().string() + " --out " + p.string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    last_output_ = r.output;
    return io::SafetensorsFile::read(p.string()).value();
  }
  bool kept(const io::SafetensorsFile& f, const std::string& name) {
    return f.find(name)->dtype == "BF16" && !f.find(name + "_scale") &&
           bytes(f, name) == bytes(*input_, name);
  }
  fs::path dir_;
  std::optional<io::SafetensorsFile> input_;
  std::string last_output_;
};

TEST_F(QuantizeExclude, DefaultKeepsEmbeddingHeadRouterAndNorms) {
  const io::SafetensorsFile q = quantize("", "q.safetensors");
  EXPECT_TRUE(kept(q, "model.embed_tokens.weight"));
  EXPECT_TRUE(kept(q, "lm_head.weight"));
  EXPECT_TRUE(kept(q, "model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(kept(q, "model.layers.0.input_layernorm.weight"));
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}) {
    EXPECT_EQ(q.find(n)->dtype, "F8_E4M3") << n;
    EXPECT_NE(q.find(std::string(n) + "_scale"), nullptr) << n;
  }
  EXPECT_NE(last_output_.find("kept in its dtype (--exclude): lm_head.weight"), std::string::npos)
      << last_output_;
}

TEST_F(QuantizeExclude, ExcludeReplacesTheDefault) {
  const io::SafetensorsFile all = quantize("--exclude ''", "all.safetensors");
  EXPECT_EQ(all.find("model.embed_tokens.weight")->dtype, "F8_E4M3");
  EXPECT_EQ(all.find("model.layers.0.mlp.gate.weight")->dtype, "F8_E4M3");
  const io::SafetensorsFile some = quantize("--exclude 'q_proj' --exclude '^lm_head'", "some.safetensors");
  EXPECT_TRUE(kept(some, "model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(kept(some, "lm_head.weight"));
  EXPECT_EQ(some.find("model.embed_tokens.weight")->dtype, "F8_E4M3");
  test::RunResult bad = run_cli("quantize --format mxfp8 --device cpu --exclude '(' --in " +
                                in().string() + " --out " + (dir_ / "bad.safetensors").string());
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_EQ(bad.output.rfind("packmoe: error: --exclude '(': not a regular expression", 0), 0u)
      << bad.output;
  EXPECT_EQ(bad.output.find('\n'), bad.output.size() - 1);
  EXPECT_FALSE(fs::exists(dir_ / "bad.safetensors"));
}

TEST_F(QuantizeExclude, TwoDFallsBackPerTensorWhenRowsDoNotTile) {
  const io::SafetensorsFile one = quantize("", "1d.safetensors");
  const io::SafetensorsFile two = quantize("--2d", "2d.safetensors");
  const std::string k = "model.layers.0.self_attn.k_proj.weight";
  const std::string qp = "model.layers.0.self_attn.q_proj.weight";
  EXPECT_EQ(two.metadata().at("packmoe.block"), "32x32");
  EXPECT_EQ(two.metadata().at("packmoe.block_1d"), k);
  EXPECT_EQ(bytes(two, k), bytes(one, k));  // 1-D blocks: the 1-D run's bytes
  EXPECT_EQ(bytes(two, k + "_scale"), bytes(one, k + "_scale"));
  // 64 rows: two 32x32 tiles per 32 columns share one scale over 32 rows, unlike 1-D blocks.
  EXPECT_NE(bytes(two, qp + "_scale"), bytes(one, qp + "_scale"));
  EXPECT_NE(last_output_.find("1-D blocks (rows no multiple of the 2-D tile): " + k),
            std::string::npos)
      << last_output_;
}

}  // namespace
}  // namespace packmoe
