// `packmoe generate` with a real tokenizer (the hand-written tokenizer.json of
// tests/common/test_tokenizer_json.h, V = 276, eos <|im_end|>): a run trained with --tokenizer on
// text whose documents end in eos, export-hf copying the tokenizer; generate from the checkpoint
// (the run's recorded tokenizer) and from the Hugging Face directory (its copied files) gives the
// same ids, the prompt ids are the tokenizer's, the text is the tokenizer's decode of the ids, eos
// is the stop token (and ends the run when it comes); a recorded tokenizer that is gone is one
// error line naming the flag.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "tokenize/tokenizer.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

class GenerateTokenizerE2e : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("generate_tokenizer_e2e_");
    fs::create_directories(dir_ / "tok");
    std::ofstream(dir_ / "tok" / "tokenizer.json") << test::test_tokenizer_json().dump();
    std::ofstream(dir_ / "tok" / "tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
    std::ofstream f(dir_ / "corpus.txt");  // short fortune-format documents, each ends in eos
    const char* words[] = {"hello", " world", " ell", " 123", " it's", " sa"};
    for (int d = 0; d < 300; ++d) {
      for (int w = 0; w < 4; ++w) f << words[(d * 7 + w * w) % 6];
      f << "\n%\n";
    }
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  fs::path dir_;
};

nlohmann::json generate_json(const std::string& args) {
  const RunResult r = run_cli("generate " + args + " --device cpu --json");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? nlohmann::json::parse(r.output) : nlohmann::json::object();
}

TEST_F(GenerateTokenizerE2e, CheckpointAndHfDirectoryUseTheTokenizer) {
  RunResult r = run_cli("train --device cpu --steps 40 --warmup 3 --micro-batch 4 --seq-len 32 "
                        "--eval-interval 0 --tokenizer " + (dir_ / "tok").string() +
                        " --data text:" + (dir_ / "corpus.txt").string() + " --out " +
                        (dir_ / "run").string() + " --save-dir " + (dir_ / "ckpt").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("export-hf " + (dir_ / "ckpt").string() + " " + (dir_ / "hf").string() +
              " --dtype f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  Result<std::unique_ptr<tokenize::Tokenizer>> tok = tokenize::load_tokenizer((dir_ / "tok").string());
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  const int eos = static_cast<int>(*tok.value()->eos_id());
  const std::string flags = " --prompt 'hello world' --max-new-tokens 24";
  const nlohmann::json a = generate_json((dir_ / "ckpt").string() + flags);
  const nlohmann::json b = generate_json((dir_ / "hf").string() + flags);
  ASSERT_TRUE(a.contains("ids") && b.contains("ids"));
  EXPECT_EQ(a["tokenizer"], "hf-bpe tokenizer");
  EXPECT_EQ(a["ids"], b["ids"]);
  EXPECT_EQ(a["stop_ids"], nlohmann::json::array({eos}));
  const Result<std::vector<uint32_t>> prompt = tok.value()->encode("hello world");
  ASSERT_TRUE(prompt.is_ok());
  EXPECT_EQ(a["prompt_ids"], nlohmann::json(prompt.value()));
  const std::vector<uint32_t> ids = a["ids"].get<std::vector<uint32_t>>();
  EXPECT_EQ(a["text"], tok.value()->decode(ids, /*skip_special=*/true));
  for (size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_NE(static_cast<int>(ids[i]), eos) << i;
  if (a["stop"] == "eos") EXPECT_EQ(static_cast<int>(ids.back()), eos);
  else EXPECT_EQ(ids.size(), 24u);

  // The run's recorded tokenizer is gone: one line saying what to do; --tokenizer fixes it.
  fs::rename(dir_ / "tok", dir_ / "tok-moved");
  r = run_cli("generate " + (dir_ / "ckpt").string() + flags + " --device cpu");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("--tokenizer PATH"), std::string::npos) << r.output;
  const nlohmann::json c =
      generate_json((dir_ / "ckpt").string() + flags + " --tokenizer " + (dir_ / "run").string());
  EXPECT_EQ(c["ids"], a["ids"]);
}

}  // namespace
