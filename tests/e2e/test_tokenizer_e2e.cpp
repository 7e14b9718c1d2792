// A real tokenizer through the whole path as a user runs it on the CPU: `packmoe train --tokenizer`
// on text (tokenized on the fly, vocab_size from the tokenizer, its files copied into --out),
// `packmoe tokenize` -> `train --data megatron:`, and `export-hf` copying the
// tokenizer files beside the weights; a model config whose vocab_size is too small is one error
// line. The tokenizer is the hand-written one of tests/common/test_tokenizer_json.h (V = 276).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "train/metrics.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

std::vector<double> train_losses(const fs::path& out) {
  std::vector<double> losses;
  const auto records = train::read_metrics((out / "metrics.jsonl").string());
  EXPECT_TRUE(records.is_ok()) << records.status().message();
  if (!records.is_ok()) return losses;
  for (const train::MetricsRecord& rec : records.value())
    if (rec.split == train::Split::kTrain) losses.push_back(rec.loss);
  return losses;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

class TokenizerE2e : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("tokenizer_e2e_");
    fs::create_directories(dir_ / "tok");
    std::ofstream(dir_ / "tok" / "tokenizer.json") << test::test_tokenizer_json().dump();
    std::ofstream(dir_ / "tok" / "tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
    std::ofstream f(dir_ / "corpus.txt");  // 300 fortune-format documents
    const char* words[] = {"hello", " world", " ell", " 123", " it's", " sa"};
    for (int d = 0; d < 300; ++d) {
      for (int w = 0; w < 12; ++w) f << words[(d * 7 + w * w) % 6];
      f << "\n%\n";
    }
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  std::string tok() const { return " --tokenizer " + (dir_ / "tok").string(); }
  fs::path dir_;
};

const std::string kRun =
    "train --device cpu --steps 30 --warmup 3 --micro-batch 4 --seq-len 32 --log-interval 10 "
    "--eval-interval 0";

TEST_F(TokenizerE2e, TrainOnTextExportCopiesTheTokenizer) {
  RunResult r = run_cli(kRun + tok() + " --data text:" + (dir_ / "corpus.txt").string() +
                        " --out " + (dir_ / "run").string() + " --save-dir " +
                        (dir_ / "ckpt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hf-bpe tokenizer"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(dir_ / "run" / "config.json")["vocab_size"], 276);
  const std::vector<double> losses = train_losses(dir_ / "run");
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_NEAR(losses.front(), std::log(276.0), 0.3);  // uniform over the tokenizer's vocabulary
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "the loss does not fall";
  EXPECT_EQ(test::read_raw(dir_ / "run" / "tokenizer.json"),
            test::read_raw(dir_ / "tok" / "tokenizer.json"));

  r = run_cli("export-hf " + (dir_ / "ckpt").string() + " " + (dir_ / "hf").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(test::read_raw(dir_ / "hf" / f), test::read_raw(dir_ / "tok" / f)) << f;
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "model.safetensors"));

  // A resumed run without --tokenizer keeps the checkpoint's (the same token stream, or resume
  // would refuse data of another length).
  r = run_cli(kRun.substr(0, kRun.find("--steps")) + "--steps 35 --warmup 3 --micro-batch 4 " +
              "--seq-len 32 --eval-interval 0 --data text:" + (dir_ / "corpus.txt").string() +
              " --out " + (dir_ / "run").string() + " --save-dir " + (dir_ / "ckpt").string() +
              " --resume auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hf-bpe tokenizer"), std::string::npos) << r.output;

  // The recorded tokenizer is gone: export says where a copy is, and writes nothing.
  fs::rename(dir_ / "tok", dir_ / "tok-moved");
  r = run_cli("export-hf " + (dir_ / "ckpt").string() + " " + (dir_ / "hf2").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("--tokenizer PATH"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "hf2"));
  r = run_cli("export-hf " + (dir_ / "ckpt").string() + " " + (dir_ / "hf2").string() +
              " --tokenizer " + (dir_ / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_raw(dir_ / "hf2" / "tokenizer.json"),
            test::read_raw(dir_ / "tok-moved" / "tokenizer.json"));
}

// packmoe tokenize, then train on the .bin/.idx (its ids are checked in tests/unit/
// test_tokenize_cli.cpp): vocab_size from the tokenizer, the loss falls.
TEST_F(TokenizerE2e, TokenizeThenTrainOnTheMegatronFiles) {
  fs::create_directories(dir_ / "data");
  RunResult r = run_cli("tokenize --quiet" + tok() + " --separator-line % --input " +
                        (dir_ / "corpus.txt").string() + " --output " +
                        (dir_ / "data" / "corpus").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli(kRun + tok() + " --data megatron:" + (dir_ / "data" / "corpus").string() +
              " --out " + (dir_ / "from_bin").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(dir_ / "from_bin" / "config.json")["vocab_size"], 276);
  const std::vector<double> losses = train_losses(dir_ / "from_bin");
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "the loss does not fall";
}

TEST_F(TokenizerE2e, ModelVocabSmallerThanTheTokenizerIsAnError) {
  std::ofstream(dir_ / "model.json") << R"({"vocab_size": 200, "hidden_size": 32,
      "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 2,
      "num_experts_per_tok": 1, "max_position_embeddings": 128})";
  const RunResult r = run_cli(kRun + tok() + " --config " + (dir_ / "model.json").string() +
                              " --out " + (dir_ / "never").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
  EXPECT_NE(r.output.find("vocab_size = 200 is smaller than the tokenizer's 276"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "never"));
}

}  // namespace
