// `packmoe train` as a user runs it: a short run writes config.json, metrics.jsonl (every record
// parses with read_metrics) and loss.svg; flags win over the config file; every bad input
// (unknown flag, bad value, bad config file, missing or bad data file) is ONE error line and exit
// 1, and leaves no output directory behind.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/token_data.h"
#include "train/metrics.h"
#include "train/model_config.h"

namespace fs = std::filesystem;
using namespace packmoe;

namespace {

struct RunResult {
  int exit_code;
  std::string output;  // stdout + stderr
};

RunResult run_cli(const std::string& args) {
  const char* cli = std::getenv("PACKMOE_CLI");
  EXPECT_NE(cli, nullptr) << "PACKMOE_CLI is set by CTest";
  const std::string cmd = std::string(cli ? cli : "packmoe") + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

fs::path temp_dir() {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  const fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  const fs::path dir = base / ("train_cli_" + std::to_string(::getpid()) + "_" +
                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

// A run small enough for a unit test: 2 rows of 16 tokens, one eval batch.
const std::string kSmall = " --device cpu --micro-batch 2 --seq-len 16 --eval-batches 1";

// A fortune-format corpus of 300 short documents in `dir` (the tests must not depend on the
// system's fortunes package, which e.g. the GPU machine lacks); returns " --data text:PATH".
std::string corpus_flag(const fs::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  for (int d = 0; d < 300; ++d)
    f << "Document " << d << ": the quick brown fox " << (d * 7919) % 1000
      << " jumps over the lazy dog.\n%\n";
  return " --data text:" + (dir / "corpus.txt").string();
}

// The output is exactly one line: "packmoe: error: ...needle...".
void expect_one_error_line(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ASSERT_FALSE(r.output.empty());
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "missing '" << needle << "' in " << r.output;
}

TEST(TrainCli, ShortRunWritesParsableMetricsConfigAndPlot) {
  const fs::path dir = temp_dir();
  const fs::path out = dir / "run";
  const RunResult r = run_cli("train --steps 3 --eval-interval 2 --log-interval 1" + kSmall +
                              corpus_flag(dir) + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" iteration        3/       3 |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" validation loss at iteration        2 |"), std::string::npos);
  EXPECT_NE(r.output.find((out / "metrics.jsonl").string()), std::string::npos);
  EXPECT_NE(r.output.find((out / "loss.svg").string()), std::string::npos);
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << "no progress bar when stdout is a pipe";

  const auto records = train::read_metrics((out / "metrics.jsonl").string());
  ASSERT_TRUE(records.is_ok()) << records.status().message();
  std::vector<int64_t> train_steps, eval_steps;
  for (const train::MetricsRecord& rec : records.value()) {
    (rec.split == train::Split::kTrain ? train_steps : eval_steps).push_back(rec.step);
    EXPECT_TRUE(std::isfinite(rec.loss));
    EXPECT_GT(rec.tokens_per_s, 0);
    EXPECT_FALSE(rec.mfu.has_value()) << "MFU is reported on CUDA only";
    if (rec.split == train::Split::kTrain) {
      EXPECT_TRUE(rec.grad_norm.has_value());
    }
  }
  EXPECT_EQ(train_steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{2, 3}));  // every 2 steps and after the last
  EXPECT_NEAR(records.value().front().loss, std::log(256.0), 0.1);

  const auto config = train::load_model_config((out / "config.json").string());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_EQ(train::model_config_to_json(config.value()),
            train::model_config_to_json(train::model_config_preset("tiny").value()));
  std::ifstream svg_file(out / "loss.svg");
  const std::string svg((std::istreambuf_iterator<char>(svg_file)), {});
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  fs::remove_all(dir);
}

TEST(TrainCli, FlagsWinOverTheConfigFile) {
  const fs::path dir = temp_dir();
  nlohmann::json file = train::model_config_to_json(train::model_config_preset("tiny").value());
  file["num_experts"] = 8;  // the model comes from the file
  file["train"] = {{"steps", 5}, {"seq_len", 8}, {"eval_interval", 0}, {"recipe", "mxfp8"}};
  write_text(dir / "run.json", file.dump());
  const RunResult r = run_cli("train --config " + (dir / "run.json").string() +
                              " --steps 2 --device cpu --micro-batch 2" + corpus_flag(dir) +
                              " --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("recipe mxfp8"), std::string::npos) << r.output;
  const auto records = train::read_metrics((dir / "out" / "metrics.jsonl").string());
  ASSERT_TRUE(records.is_ok());
  EXPECT_EQ(records.value().size(), 2u);  // --steps 2 beat "steps": 5; eval_interval 0: no eval
  EXPECT_EQ(train::load_model_config((dir / "out" / "config.json").string()).value().num_experts, 8);

  // The model defined twice is an error.
  expect_one_error_line(run_cli("train --preset small --config " + (dir / "run.json").string() +
                                " --out " + (dir / "never").string()),
                        "both define the model");
  EXPECT_FALSE(fs::exists(dir / "never"));
  fs::remove_all(dir);
}

TEST(TrainCli, BadInputIsOneErrorLineAndNoOutput) {
  const fs::path dir = temp_dir();
  const std::string out = " --out " + (dir / "out").string();
  struct Case {
    std::string args, needle;
  };
  write_text(dir / "broken.json", "{\"train\": {\"steps\": 3,");
  write_text(dir / "unknown.json", R"({"train": {"warmup": 3}})");
  write_text(dir / "model.json", R"({"num_attention_heads": 4, "num_key_value_heads": 3})");
  write_text(dir / "array.json", "[1, 2]");
  write_text(dir / "bad.shard", std::string(1024 + 10, '\0'));  // llm.c header of zeros
  io::TokenDataset big;
  big.tokens = {1, 2, 3, 300, 4, 5};  // 300 is outside the tiny model's 256 bytes
  ASSERT_TRUE(io::write_megatron((dir / "big").string(), big).is_ok());
  const std::vector<Case> cases = {
      {"train --frobnicate 3", "--frobnicate"},
      {"train --steps", "--steps"},
      {"train --steps abc", "abc"},
      {"train --steps 0", "steps = 0 must be >= 1"},
      {"train --recipe fp8", "recipe must be bf16, mxfp8 or nvfp4 (got 'fp8')"},
      {"train --layout packed", "layout must be single or discrete"},
      {"train --primary mid", "primary must be low or high"},
      {"train --preset huge", "unknown model preset 'huge'"},
      {"train --device tpu", "--device must be auto, cpu or cuda"},
      {"train --lr -1", "lr = -1"},
      {"train --seq-len 4096", "max_position_embeddings"},
      {"train --config " + (dir / "missing.json").string(), "missing.json: cannot open"},
      {"train --config " + (dir / "broken.json").string(), "broken.json: not valid JSON"},
      {"train --config " + (dir / "unknown.json").string(), "unknown key train.warmup"},
      {"train --config " + (dir / "model.json").string(), "num_key_value_heads"},
      {"train --config " + (dir / "array.json").string(), "must be a JSON object"},
      {"train --data books", "--data 'books' must be fortunes, text:PATH, megatron:PREFIX or llmc:SHARD"},
      {"train --data megatron:" + (dir / "nope").string(), (dir / "nope").string()},
      {"train --data llmc:" + (dir / "nope.bin").string(), (dir / "nope.bin").string()},
      {"train --data llmc:" + (dir / "bad.shard").string(), "bad.shard"},
      {"train --data text:" + (dir / "none").string(), (dir / "none").string()},
      {"train --data megatron:" + (dir / "big").string() + " --eval-interval 0",
       "token 300 at index 3 is not below the model's vocab_size 256"},
      {"train --data megatron:" + (dir / "big").string(), "give --valid-data or --eval-interval 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(run_cli(c.args + out), c.needle);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
  fs::remove_all(dir);
}

TEST(TrainCli, HelpExplainsEveryOption) {
  const RunResult r = run_cli("train --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag :
       {"--config", "--preset", "--recipe", "--layout", "--primary", "--steps", "--micro-batch",
        "--seq-len", "--grad-accum", "--lr", "--min-lr", "--warmup", "--decay-steps",
        "--weight-decay", "--beta1", "--beta2", "--eps", "--grad-clip", "--eval-interval",
        "--eval-batches", "--log-interval", "--seed", "--device", "--data", "--valid-data", "--out"})
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  EXPECT_NE(r.output.find("(default: 1000)"), std::string::npos) << r.output;
}

}  // namespace
