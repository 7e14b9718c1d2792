// `packmoe train` as a user runs it: a short run writes config.json, metrics.jsonl (every record
// parses with read_metrics) and loss.svg; flags win over the config file; every bad input
// (unknown flag, bad value, bad config file, missing or bad data file, bad checkpoint) is ONE
// error line and exit 1, and leaves no output directory behind. Checkpoints through the binary:
// --save-dir + --resume auto continue like the uninterrupted run (metrics compared), export-hf
// writes BF16 safetensors that a strict parser written here accepts with every HF name, and
// --init-from-hf starts from exactly those weights.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "backend/backend.h"
#include "common/run_cli.h"
#include "core/codecs.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/text_corpus.h"
#include "io/token_data.h"
#include "train/metrics.h"
#include "train/model_config.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace packmoe;

namespace {

using packmoe::test::RunResult;
using packmoe::test::run_cli;

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

// Tests that train on the default corpus (the fortunes package, which scripts/install-deps.sh
// installs) skip, with the loader's message, on a machine without it.
#define SKIP_WITHOUT_DEFAULT_CORPUS()                                          \
  do {                                                                         \
    const Result<io::TextCorpus> corpus_probe = io::load_text_corpus();        \
    if (!corpus_probe.is_ok()) GTEST_SKIP() << corpus_probe.status().message(); \
  } while (0)

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
  // Model configs: the tiny preset's config.json with one field patched.
  auto model_file = [&](const std::string& name, const std::string& patch) {
    nlohmann::json j = train::model_config_to_json(train::model_config_preset("tiny").value());
    j.merge_patch(nlohmann::json::parse(patch));
    write_text(dir / name, j.dump());
    return (dir / name).string();
  };
  model_file("model.json", R"({"num_key_value_heads": 3})");
  write_text(dir / "partial.json", R"({"vocab_size": 1024, "num_hidden_layers": 2})");
  fs::create_directories(dir / "yarn-hf");
  model_file("yarn-hf/config.json", R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})");
  write_text(dir / "array.json", "[1, 2]");
  write_text(dir / "bad.shard", std::string(1024 + 10, '\0'));  // llm.c header of zeros
  io::TokenDataset big;
  big.tokens = {1, 2, 3, 300, 4, 5};  // 300 is outside the tiny model's 256 bytes
  ASSERT_TRUE(io::write_megatron((dir / "big").string(), big).is_ok());
  io::TokenDataset few;
  few.tokens = {1, 2, 3, 4, 5, 6};  // one document: 5 train / 1 validation tokens by position
  ASSERT_TRUE(io::write_megatron((dir / "few").string(), few).is_ok());
  const std::string few_src = "megatron:" + (dir / "few").string();
  io::TokenDataset many;
  for (uint32_t i = 0; i < 100; ++i) many.tokens.push_back(i);
  ASSERT_TRUE(io::write_megatron((dir / "many").string(), many).is_ok());
  const std::vector<Case> cases = {
      {"train --frobnicate 3", "--frobnicate"},
      {"train --steps", "--steps"},
      {"train --steps abc", "abc"},
      {"train --steps 0", "steps = 0 must be >= 1"},
      {"train --recipe fp8", "recipe must be bf16, mxfp8 or nvfp4 (got 'fp8')"},
      {"train --layout packed", "layout must be single or discrete"},
      {"train --primary mid", "primary must be low or high"},
      {"train --recompute some", "recompute must be none, selective or full (got 'some')"},
      {"train --preset huge", "unknown model preset 'huge'"},
      {"train --device tpu", "--device must be auto, cpu or cuda"},
      {"train --lr -1", "lr = -1"},
      {"train --seq-len 4096", "max_position_embeddings"},
      {"train --config " + (dir / "missing.json").string(), "missing.json: cannot open"},
      {"train --config " + (dir / "broken.json").string(), "broken.json: not valid JSON"},
      {"train --config " + (dir / "unknown.json").string(), "unknown key train.warmup"},
      {"train --config " + (dir / "model.json").string(), "num_key_value_heads"},
      {"train --config " + (dir / "array.json").string(), "must be a JSON object"},
      {"train --data books", "--data 'books' must be fortunes, text:PATH, megatron:PREFIX, llmc:SHARD or sft:FILE.jsonl"},
      {"train --data megatron:" + (dir / "nope").string(), (dir / "nope").string()},
      {"train --data llmc:" + (dir / "nope.bin").string(), (dir / "nope.bin").string()},
      {"train --data llmc:" + (dir / "bad.shard").string(), "bad.shard"},
      {"train --data text:" + (dir / "none").string(), (dir / "none").string()},
      {"train --data megatron:" + (dir / "big").string() + " --eval-interval 0",
       "token 300 at index 3 is not below the model's vocab_size 256"},
      {"train --data " + few_src,
       (dir / "few").string() + ": the training side of the data has 5 tokens, fewer than the "
                                "seq_len + 1 = 65 one row needs"},
      {"train --data megatron:" + (dir / "many").string() + " --valid-data " + few_src +
           " --seq-len 8",
       (dir / "few").string() + ": the validation side of the data has 6 tokens, fewer than the "
                                "seq_len + 1 = 9 one row needs (raise --valid-fraction, lower "
                                "--seq-len or give --valid-data)"},
      {"train --data '0.7 " + few_src + " " + few_src + "'", "a weighted list is pairs"},
      {"train --data '" + few_src + " 0.3 " + few_src + "'",
       "'0.3' is a weight, but the first source has none"},
      {"train --data '-1 " + few_src + "'", "'-1' is not a positive weight"},
      {"train --data '0.5 " + few_src + ",0.5 books'", "--data 'books' must be fortunes"},
      {"train --valid-fraction 1", "valid_fraction = 1 must be in [0, 1)"},
      // Token data of its own, so the case needs no fortunes package (the GPU machine has none).
      {"train --data megatron:" + (dir / "many").string() + " --valid-fraction 0",
       "--valid-fraction 0 holds no validation data back"},
      {"train --config " + (dir / "partial.json").string(),
       "partial.json: the config does not give hidden_size, intermediate_size, "
       "num_attention_heads, num_key_value_heads, num_experts, moe_intermediate_size, "
       "num_experts_per_tok"},
      {"train --init-from-hf " + (dir / "yarn-hf").string(),
       "--init-from-hf: " + (dir / "yarn-hf" / "config.json").string() +
           ": rope_scaling.rope_type = \"yarn\" is not supported"},
      {"train --config " + model_file("window.json", R"({"use_sliding_window": true})"),
       "window.json: use_sliding_window = true is not supported"},
      {"train --config " + model_file("arch.json", R"({"architectures": ["MixtralForCausalLM"]})"),
       "arch.json: architectures[0] = \"MixtralForCausalLM\" is not supported"},
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
       {"--config",       "--preset",      "--recipe",        "--layout",        "--primary",
        "--steps",        "--micro-batch", "--seq-len",       "--grad-accum",    "--lr",
        "--min-lr",       "--warmup",      "--decay-steps",   "--weight-decay",  "--beta1",
        "--beta2",        "--eps",         "--grad-clip",     "--eval-interval", "--eval-batches",
        "--log-interval", "--seed",        "--device",        "--data",          "--valid-data",
        "--out",          "--save-dir",    "--save-interval", "--keep-last",     "--save-primary",
        "--resume",       "--init-from-hf", "--shuffle",     "--no-shuffle",    "--valid-fraction",
        "--recompute",    "selective:",    "full:"})
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  EXPECT_NE(r.output.find("(default: 1000)"), std::string::npos) << r.output;
  const RunResult e = run_cli("export-hf --help");
  EXPECT_EQ(e.exit_code, 0);
  for (const char* word : {"checkpoint", "out", "--dtype", "from_pretrained", "config.json"})
    EXPECT_NE(e.output.find(word), std::string::npos) << word;
}

// ---- checkpoints ----------------------------------------------------------------------------

// The fields of a metrics record that the run's numbers decide (not its timing).
using MetricsKey = std::tuple<int64_t, train::Split, double, double, std::optional<double>>;

std::vector<MetricsKey> metrics_keys(const fs::path& path) {
  const auto records = train::read_metrics(path.string());
  EXPECT_TRUE(records.is_ok()) << records.status().message();
  std::vector<MetricsKey> keys;
  if (!records.is_ok()) return keys;
  for (const train::MetricsRecord& r : records.value())
    keys.emplace_back(r.step, r.split, r.loss, r.lr, r.grad_norm);
  return keys;
}

// --recompute selective and full train the run of none: the same losses and grad norms in
// metrics.jsonl (JSON keeps every double exactly); the start-up summary names the mode.
TEST(TrainCli, RecomputeGivesTheSameRun) {
  const fs::path dir = temp_dir();
  const std::string common = "train --steps 3 --eval-interval 0 --log-interval 1 --grad-accum 2" +
                             kSmall + corpus_flag(dir);
  std::vector<std::vector<MetricsKey>> runs;
  for (const char* mode : {"none", "selective", "full"}) {
    const fs::path out = dir / mode;
    const RunResult r = run_cli(common + " --recompute " + mode + " --out " + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(std::string("| recompute ") + mode + " |"), std::string::npos)
        << r.output;
    runs.push_back(metrics_keys(out / "metrics.jsonl"));
    ASSERT_EQ(runs.back().size(), 3u);
  }
  EXPECT_EQ(runs[1], runs[0]);
  EXPECT_EQ(runs[2], runs[0]);
  fs::remove_all(dir);
}

// NVFP4, so the resumed run also needs its stochastic-rounding offsets; the schedule does not
// depend on --steps.
const std::string kResumable =
    kSmall + " --recipe nvfp4 --eval-interval 2 --log-interval 1 --warmup 2 --decay-steps 6";

TEST(TrainCli, ResumeAutoContinuesLikeTheUninterruptedRun) {
  SKIP_WITHOUT_DEFAULT_CORPUS();
  const fs::path dir = temp_dir();
  const std::string save = " --save-dir " + (dir / "ckpt").string();
  RunResult r = run_cli("train --steps 4 --save-interval 2 --keep-last 2" + kResumable + save +
                        " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("saved checkpoint " + (dir / "ckpt" / "step-00000002").string()),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000002" / "complete.json"));
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000004" / "complete.json"));
  // A crash after step 5 (no checkpoint) left its record and a torn line behind; the resumed run
  // drops both and redoes step 5.
  {
    std::ofstream m(dir / "run" / "metrics.jsonl", std::ios::app);
    m << R"({"step": 5, "split": "train", "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, )"
      << R"("tokens_per_s": 1.0, "elapsed_s": 1.0})"
      << "\n{\"step\": 6, \"spl";
  }
  r = run_cli("train --steps 6 --resume auto --keep-last 2" + kResumable + save + " --out " +
              (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(
      r.output.find("resumed from " + (dir / "ckpt" / "step-00000004").string() + " at step 4"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find(" iteration        4/"), std::string::npos) << "step 4 is not redone";
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "step-00000002")) << "--keep-last 2";
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000006" / "complete.json"));

  r = run_cli("train --steps 6" + kResumable + " --out " + (dir / "straight").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<MetricsKey> straight = metrics_keys(dir / "straight" / "metrics.jsonl");
  EXPECT_EQ(straight.size(), 9u);  // 6 train + eval after 2, 4, 6
  EXPECT_EQ(metrics_keys(dir / "run" / "metrics.jsonl"), straight);

  // --resume auto with nothing saved yet starts at step 0.
  r = run_cli("train --steps 1 --resume auto --save-dir " + (dir / "empty").string() + kSmall +
              " --out " + (dir / "fresh").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no complete checkpoint under"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// ---- an independent strict safetensors reader for the export ----

struct StrictEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// Every rule the export must follow: an 8-byte little-endian header size, a JSON object padded
// with spaces to a multiple of 8, metadata {"format": "pt"}, entries of exactly dtype / shape /
// data_offsets, offsets tiling the buffer from 0 in order with no gap, overlap or trailing byte,
// sizes = numel x 2 for "BF16" (the only dtype allowed here).
std::map<std::string, StrictEntry> read_strict_bf16(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<uint8_t> b(std::istreambuf_iterator<char>(f), {});
  std::map<std::string, StrictEntry> out;
  if (b.size() < 8) {
    ADD_FAILURE() << "shorter than the header size";
    return out;
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{b[i]} << (8 * i);
  if (n % 8 != 0 || n > b.size() - 8) {
    ADD_FAILURE() << "header size " << n;
    return out;
  }
  std::string header(b.begin() + 8, b.begin() + 8 + static_cast<int64_t>(n));
  while (!header.empty() && header.back() == ' ') header.pop_back();
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, false);
  if (!j.is_object()) {
    ADD_FAILURE() << "header is not a JSON object";
    return out;
  }
  EXPECT_EQ(j.value("__metadata__", nlohmann::json()), (nlohmann::json{{"format", "pt"}}));
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  const uint64_t buffer = b.size() - 8 - n;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    SCOPED_TRACE(name);
    EXPECT_EQ(v.size(), 3u);
    EXPECT_EQ(v.at("dtype"), "BF16");
    StrictEntry e{v.at("dtype"), {}, {}};
    uint64_t numel = 1;
    for (const nlohmann::json& d : v.at("shape")) {
      EXPECT_TRUE(d.is_number_unsigned());
      e.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
    }
    const uint64_t begin = v.at("data_offsets").at(0), end = v.at("data_offsets").at(1);
    EXPECT_TRUE(begin <= end && end <= buffer);
    EXPECT_EQ(end - begin, numel * 2);
    if (begin > end || end > buffer) continue;
    e.bytes.assign(b.begin() + 8 + n + begin, b.begin() + 8 + n + end);
    spans.emplace_back(begin, end);
    out[name] = std::move(e);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t at = 0;
  for (const auto& [begin, end] : spans) {
    EXPECT_EQ(begin, at) << "gap or overlap";
    at = end;
  }
  EXPECT_EQ(at, buffer) << "bytes after the last tensor";
  return out;
}

// Every tensor of the tiny preset under its Hugging Face name, typed out from the preset's
// numbers: V 256, H 64, 2 layers, 4 query heads and 2 KV heads of 16, 4 experts of F 32.
std::map<std::string, std::vector<int64_t>> tiny_hf_shapes() {
  std::map<std::string, std::vector<int64_t>> s = {{"model.embed_tokens.weight", {256, 64}},
                                                   {"model.norm.weight", {64}},
                                                   {"lm_head.weight", {256, 64}}};
  for (const std::string l : {"0", "1"}) {
    const std::string p = "model.layers." + l + ".";
    s[p + "input_layernorm.weight"] = {64};
    s[p + "post_attention_layernorm.weight"] = {64};
    s[p + "self_attn.q_proj.weight"] = {64, 64};
    s[p + "self_attn.k_proj.weight"] = {32, 64};
    s[p + "self_attn.v_proj.weight"] = {32, 64};
    s[p + "self_attn.o_proj.weight"] = {64, 64};
    s[p + "self_attn.q_norm.weight"] = {16};
    s[p + "self_attn.k_norm.weight"] = {16};
    s[p + "mlp.gate.weight"] = {4, 64};
    for (const std::string e : {"0", "1", "2", "3"}) {
      s[p + "mlp.experts." + e + ".gate_proj.weight"] = {32, 64};
      s[p + "mlp.experts." + e + ".up_proj.weight"] = {32, 64};
      s[p + "mlp.experts." + e + ".down_proj.weight"] = {64, 32};
    }
  }
  return s;
}

TEST(TrainCli, ExportHfWritesStrictBf16WeightsAndAConfigTransformersReads) {
  SKIP_WITHOUT_DEFAULT_CORPUS();
  const fs::path dir = temp_dir();
  RunResult r = run_cli("train --steps 2 --eval-interval 0" + kSmall + " --save-dir " +
                        (dir / "ckpt").string() + " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("export-hf " + (dir / "ckpt").string() + " " + (dir / "hf").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("exported " + (dir / "ckpt" / "step-00000002").string()),
            std::string::npos)
      << r.output;

  const std::map<std::string, StrictEntry> file =
      read_strict_bf16(dir / "hf" / "model.safetensors");
  const std::map<std::string, std::vector<int64_t>> want = tiny_hf_shapes();
  EXPECT_EQ(file.size(), want.size());
  for (const auto& [name, shape] : want) {
    auto it = file.find(name);
    ASSERT_NE(it, file.end()) << name;
    EXPECT_EQ(it->second.shape, shape) << name;
  }

  std::ifstream cf(dir / "hf" / "config.json");
  const nlohmann::json config = nlohmann::json::parse(cf);
  EXPECT_EQ(config.at("architectures"), nlohmann::json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(config.at("model_type"), "qwen3_moe");
  EXPECT_EQ(config.at("torch_dtype"), "bfloat16");
  EXPECT_EQ(config.at("dtype"), "bfloat16");
  EXPECT_EQ(config.at("hidden_act"), "silu");
  EXPECT_EQ(config.at("head_dim"), 16);
  EXPECT_EQ(config.at("num_experts"), 4);
  EXPECT_EQ(config.at("tie_word_embeddings"), false);
  EXPECT_EQ(config.at("rope_parameters").at("rope_type"), "default");

  // The loader reads it back as the checkpoint's masters rounded to BF16, bit for bit.
  const ModelConfig tiny = train::model_config_preset("tiny").value();
  const auto exported = io::load_hf_weights((dir / "hf").string(), tiny);
  ASSERT_TRUE(exported.is_ok()) << exported.status().message();
  const auto masters = io::load_hf_weights((dir / "ckpt" / "step-00000002").string(), tiny);
  ASSERT_TRUE(masters.is_ok()) << masters.status().message();
  for (const auto& [name, t] : masters.value()) {
    const float* m = t.data_as<const float>();
    const float* x = exported.value().at(name).data_as<const float>();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < t.numel(); ++i) mismatches += bf16_to_f32(f32_to_bf16(m[i])) != x[i];
    EXPECT_EQ(mismatches, 0) << name;
  }
  // --dtype f32 gives the masters exactly.
  r = run_cli("export-hf " + (dir / "ckpt" / "step-00000002").string() + " " +
              (dir / "hf32").string() + " --dtype f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto f32 = io::load_hf_weights((dir / "hf32").string(), tiny);
  ASSERT_TRUE(f32.is_ok());
  for (const auto& [name, t] : masters.value())
    EXPECT_EQ(std::memcmp(t.data(), f32.value().at(name).data(), t.nbytes()), 0) << name;
  fs::remove_all(dir);
}

TEST(TrainCli, InitFromHfStartsFromExactlyThoseWeights) {
  SKIP_WITHOUT_DEFAULT_CORPUS();
  const fs::path dir = temp_dir();
  RunResult r = run_cli("train --steps 3 --eval-interval 0" + kSmall + " --save-dir " +
                        (dir / "ckpt").string() + " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("export-hf " + (dir / "ckpt").string() + " " + (dir / "hf").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("train --steps 1 --eval-interval 0 --init-from-hf " + (dir / "hf").string() + kSmall +
              " --out " + (dir / "init").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("initialised from Hugging Face weights"), std::string::npos) << r.output;
  const auto records = train::read_metrics((dir / "init" / "metrics.jsonl").string());
  ASSERT_TRUE(records.is_ok());
  ASSERT_EQ(records.value().size(), 1u);

  // The same first step in process, from the exported weights: the same loss, bit for bit.
  const ModelConfig tiny = train::model_config_preset("tiny").value();
  const auto weights = io::load_hf_weights((dir / "hf").string(), tiny);
  ASSERT_TRUE(weights.is_ok());
  Result<io::TextCorpus> corpus = io::load_text_corpus();
  ASSERT_TRUE(corpus.is_ok());
  train::TrainData data;
  data.train = train::single_source(std::move(corpus.value().train), static_cast<uint32_t>('\n'));
  train::TrainConfig c;
  c.steps = 1;
  c.micro_batch_size = 2;
  c.seq_len = 16;
  c.eval_interval = 0;
  auto trainer = train::Trainer::create(cpu_backend(), tiny, c, std::move(data), &weights.value());
  ASSERT_TRUE(trainer.is_ok()) << trainer.status().message();
  const auto step = trainer.value()->train_step();
  ASSERT_TRUE(step.is_ok());
  EXPECT_EQ(records.value().front().loss, step.value().loss);
  EXPECT_LT(step.value().loss, std::log(256.0) - 0.01) << "trained weights, not a random init";
  fs::remove_all(dir);
}

TEST(TrainCli, BadCheckpointInputIsOneErrorLine) {
  SKIP_WITHOUT_DEFAULT_CORPUS();
  const fs::path dir = temp_dir();
  const std::string ckpt = (dir / "ckpt").string();
  const std::string step2 = (dir / "ckpt" / "step-00000002").string();
  RunResult r = run_cli("train --steps 2 --eval-interval 0" + kSmall + " --save-dir " + ckpt +
                        " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("export-hf " + ckpt + " " + (dir / "hf").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A copy with one flipped byte in its weights.
  fs::create_directories(dir / "bad");
  fs::copy(step2, dir / "bad" / "step-00000002", fs::copy_options::recursive);
  {
    std::fstream f(dir / "bad" / "step-00000002" / "model.safetensors",
                   std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(2000);
    f.put('\x5a');
  }
  fs::create_directories(dir / "empty");
  struct Case {
    std::string args, needle;
  };
  const std::string out = " --out " + (dir / "out").string();
  const std::vector<Case> cases = {
      {"train --steps 4 --resume " + (dir / "bad").string(), "(corrupted)"},
      {"train --steps 4 --resume " + (dir / "nowhere").string(), "no such checkpoint directory"},
      {"train --steps 4 --resume " + (dir / "empty").string(), "no complete checkpoint"},
      {"train --steps 2 --resume " + step2, "nothing left to train (raise --steps)"},
      {"train --steps 4 --resume " + step2 + " --preset small", "is another model"},
      {"train --steps 4 --resume auto", "--resume auto needs --save-dir"},
      {"train --resume " + step2 + " --init-from-hf " + (dir / "hf").string(), "use one"},
      {"train --init-from-hf " + (dir / "nowhere").string(), "cannot open model config"},
      {"train --init-from-hf " + (dir / "hf").string() + " --preset small", "is another model"},
      {"train --keep-last 0 --save-dir " + ckpt, "--keep-last = 0 must be >= 1"},
      {"train --save-interval 2", "need --save-dir"},
      {"export-hf " + (dir / "bad").string() + " " + (dir / "out").string(), "(corrupted)"},
      {"export-hf " + (dir / "nowhere").string() + " " + (dir / "out").string(),
       "no such checkpoint directory"},
      {"export-hf " + ckpt + " " + (dir / "out").string() + " --dtype f16",
       "--dtype must be bf16 or f32"},
      {"export-hf " + ckpt, "out is required"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(run_cli(c.args + (c.args.rfind("train", 0) == 0 ? out : "")), c.needle);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
  fs::remove_all(dir);
}

}  // namespace
