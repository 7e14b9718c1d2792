// Supervised fine-tuning end to end on the CPU: JSONL conversations rendered with a chat template
// of the test tokenizer (tests/common/test_tokenizer_json.h), packed with document masking.
// Checked: a prompt-only token gets exactly zero gradient when it cannot reach a trained target
// (the model's own backward, against what the attention structure implies), the loss is the mean
// over every trained target whatever the micro-batch split, a resumed SFT run continues bitwise,
// `packmoe eval` on the checkpoint prints the validation loss the run printed, and bad input is
// one error line before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "nn/model.h"
#include "tokenize/tokenizer.h"
#include "train/batch_sampler.h"
#include "train/data_sources.h"
#include "train/metrics.h"
#include "train/model_config.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::run_cli;
using packmoe::test::RunResult;

namespace {

const char* const kTemplate =
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + "
    "'\\n' }}{%- endfor %}";
constexpr uint32_t kTrailing = '~';  // only in a user turn after the last answer

// tokenizer.json + tokenizer_config.json (the template) in dir/tok.
fs::path write_tokenizer(const fs::path& dir) {
  fs::create_directories(dir / "tok");
  std::ofstream(dir / "tok" / "tokenizer.json") << test::test_tokenizer_json().dump();
  std::ofstream(dir / "tok" / "tokenizer_config.json")
      << nlohmann::json{{"chat_template", kTemplate}, {"eos_token", "<|im_end|>"}}.dump();
  return dir / "tok";
}

// `n` conversations of random lowercase words (10-30 tokens each), half of them as prompt /
// response pairs; with `trailing` every messages-form one ends with a user turn of '~'.
fs::path write_sft(const fs::path& dir, int n, uint64_t seed, bool trailing) {
  std::mt19937_64 rng(seed);
  auto word = [&](int len) {
    std::string w;
    for (int i = 0; i < len; ++i) w += static_cast<char>('a' + rng() % 20);
    return w;
  };
  const fs::path p = dir / "chat.jsonl";
  std::ofstream f(p);
  for (int i = 0; i < n; ++i) {
    nlohmann::json j;
    if (i % 2 == 0 && !trailing) {
      j = {{"prompt", word(3 + rng() % 4)}, {"response", word(2 + rng() % 6)}};
    } else {
      nlohmann::json m =
          nlohmann::json::array({{{"role", "user"}, {"content", word(2 + rng() % 3)}},
                                 {{"role", "assistant"}, {"content", word(1 + rng() % 4)}}});
      if (trailing) m.push_back({{"role", "user"}, {"content", "~~"}});
      j = {{"messages", m}};
    }
    f << j.dump() << "\n";
  }
  return p;
}

std::vector<train::MetricsRecord> records(const fs::path& out) {
  auto r = train::read_metrics((out / "metrics.jsonl").string());
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.is_ok() ? r.value() : std::vector<train::MetricsRecord>{};
}

// The embedding gradient row of `token` after one forward + backward of the first batch.
std::vector<float> embedding_grad(const std::string& data, const tokenize::Tokenizer& tok,
                                  train::DocumentMask mask, uint32_t token, int64_t* targets) {
  Result<train::LoadedData> loaded = train::load_data(data, "--data", 0.0, &tok);
  EXPECT_TRUE(loaded) << loaded.status().message();
  train::StreamOptions o;
  o.document_mask = mask;
  Result<ModelConfig> config = train::model_config_preset("tiny");
  config.value().vocab_size = tok.vocab_size();
  config.value().tie_word_embeddings = false;  // the row's gradient is the input side's alone
  Result<train::BatchSampler> sampler = train::BatchSampler::create(
      std::move(loaded.value().train), config.value().vocab_size, 4, 128, o);
  EXPECT_TRUE(sampler) << sampler.status().message();
  const Batch batch = sampler.value().next();
  Model model(cpu_backend(), config.value(), ModelPrecision{},
              random_model_weights(config.value(), 7));
  model.zero_grad();
  // The lm loss's gradient alone: the router's load-balancing loss sees every token, masked or
  // not, by design.
  Result<ForwardLosses> l = model.forward(batch, 1.0f, /*aux_scale=*/0.0f);
  EXPECT_TRUE(l) << l.status().message();
  model.backward();
  *targets = l.value().target_tokens;
  for (const NamedParam& p : model.params())
    if (p.name.find("embed_tokens") != std::string::npos) {
      const std::vector<uint8_t> bytes = p.param->main_grad().download();
      const float* g = reinterpret_cast<const float*>(bytes.data());
      const int64_t H = config.value().hidden_size;
      return std::vector<float>(g + token * H, g + (token + 1) * H);
    }
  ADD_FAILURE() << "no embedding parameter";
  return {};
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

TEST(SftE2E, TokensThatReachNoTrainedTargetGetZeroGradient) {
  const fs::path dir = test::make_test_dir("sft_e2e_");
  Result<std::unique_ptr<tokenize::Tokenizer>> tok =
      tokenize::load_tokenizer(write_tokenizer(dir).string());
  ASSERT_TRUE(tok) << tok.status().message();
  const std::string data =
      "sft:" + write_sft(dir, 40, test::recorded_random_seed(), /*trailing=*/true).string();
  int64_t targets = 0;
  // '~' follows each conversation's last trained target: with document masking nothing that has
  // a loss attends to it, so its embedding row gets exactly zero. (Rows of 128 tokens hold about
  // three conversations.)
  const std::vector<float> masked =
      embedding_grad(data, *tok.value(), train::DocumentMask::kIndex, kTrailing, &targets);
  EXPECT_GT(targets, 0);
  EXPECT_EQ(max_abs(masked), 0.0) << "a masked token that reaches no target got a gradient";
  // A prompt token ('a' .. 't' are the prompts' and answers' letters) does reach the answers.
  const std::vector<float> prompt =
      embedding_grad(data, *tok.value(), train::DocumentMask::kIndex, '\n', &targets);
  EXPECT_GT(max_abs(prompt), 0.0);
  // Without the mask the next conversation of the row attends to '~', which then has a gradient.
  const std::vector<float> causal =
      embedding_grad(data, *tok.value(), train::DocumentMask::kNone, kTrailing, &targets);
  EXPECT_GT(max_abs(causal), 0.0);
  test::remove_test_dir(dir);
}

const std::string kSft =
    "train --preset tiny --device cpu --seq-len 64 --log-interval 1 --attention-mask document "
    "--lr 3e-3 --warmup 2";

TEST(SftE2E, LossIsTheMeanOverTrainedTargetsForAnySplit) {
  // Step 1's loss and grad norm (the same weights, the same 4 rows) with one micro-batch of 4 rows
  // or two of 2: the mean over all trained targets of the step either way, though the two
  // micro-batches hold different numbers of them.
  const fs::path dir = test::make_test_dir("sft_e2e_");
  const std::string flags = " --tokenizer " + write_tokenizer(dir).string() + " --data sft:" +
                            write_sft(dir, 200, test::recorded_random_seed(), false).string() +
                            " --steps 1 --eval-interval 0";
  RunResult r = run_cli(kSft + flags + " --micro-batch 4 --out " + (dir / "a1").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli(kSft + flags + " --micro-batch 2 --grad-accum 2 --out " + (dir / "a2").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto one = records(dir / "a1"), two = records(dir / "a2");
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_NEAR(two[0].loss, one[0].loss, 1e-5 * one[0].loss);
  ASSERT_TRUE(one[0].grad_norm && two[0].grad_norm);
  EXPECT_NEAR(*two[0].grad_norm, *one[0].grad_norm, 1e-3 * *one[0].grad_norm);
  test::remove_test_dir(dir);
}

TEST(SftE2E, TrainsResumesBitwiseAndEvalMatchesTheValidationLoss) {
  const fs::path dir = test::make_test_dir("sft_e2e_");
  const std::string data = " --tokenizer " + write_tokenizer(dir).string() + " --data sft:" +
                           write_sft(dir, 600, test::recorded_random_seed(), false).string();
  const std::string run =
      kSft + data + " --micro-batch 4 --eval-interval 4 --eval-batches 3 --decay-steps 8";
  RunResult r = run_cli(run + " --steps 8 --out " + (dir / "full").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("conversations, chat template"), std::string::npos) << r.output;
  const auto full = records(dir / "full");
  ASSERT_FALSE(full.empty());
  EXPECT_LT(full.back().loss, full.front().loss) << "the SFT loss does not fall";

  // Interrupted at step 4 and resumed: the same records, bit for bit.
  const std::string save = " --save-dir " + (dir / "ckpt").string();
  r = run_cli(run + " --steps 4 --save-interval 4" + save + " --out " + (dir / "first").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli(run + " --steps 8 --resume auto" + save + " --out " + (dir / "second").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumed = records(dir / "first");
  for (const auto& rec : records(dir / "second")) resumed.push_back(rec);
  ASSERT_EQ(resumed.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_EQ(resumed[i].step, full[i].step);
    EXPECT_EQ(resumed[i].loss, full[i].loss) << "record " << i;
    EXPECT_EQ(resumed[i].grad_norm, full[i].grad_norm) << "record " << i;
  }

  // eval on each checkpoint (the save root: its newest, step 8): the run's validation loss at
  // that step, exactly.
  const auto validation_at = [&](const fs::path& out, int64_t step) {
    for (const auto& rec : records(out))
      if (rec.split == train::Split::kEval && rec.step == step) return rec.loss;
    return -1.0;
  };
  for (const auto& [path, step, valid] :
       {std::tuple{dir / "ckpt" / "step-00000004", int64_t{4}, validation_at(dir / "first", 4)},
        std::tuple{dir / "ckpt", int64_t{8}, validation_at(dir / "second", 8)}}) {
    ASSERT_GT(valid, 0);
    r = run_cli("eval " + path.string() + " --device cpu --attention-mask document" + data);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const size_t brace = r.output.rfind("\n{");
    ASSERT_NE(brace, std::string::npos) << r.output;
    const nlohmann::json j = nlohmann::json::parse(r.output.substr(brace + 1));
    EXPECT_EQ(j["loss"].get<double>(), valid) << r.output;
    EXPECT_EQ(j["step"].get<int64_t>(), step);
    EXPECT_DOUBLE_EQ(j["perplexity"].get<double>(), std::exp(valid));
    EXPECT_EQ(j["batches"].get<int64_t>(), 3);
    EXPECT_EQ(r.output.rfind("eval " + (dir / "ckpt").string(), 0), 0u) << r.output;
    EXPECT_NE(r.output.find(": loss "), std::string::npos) << r.output;
  }
  test::remove_test_dir(dir);
}

void expect_one_error_line(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ASSERT_FALSE(r.output.empty());
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos)
      << "missing '" << needle << "' in " << r.output;
}

TEST(SftE2E, BadInputIsOneErrorLineBeforeAnythingIsWritten) {
  const fs::path dir = test::make_test_dir("sft_e2e_");
  const std::string tok = " --tokenizer " + write_tokenizer(dir).string();
  const std::string out = " --out " + (dir / "never").string();
  const auto with_line2 = [&](const std::string& line) {
    const fs::path p = dir / "bad.jsonl";
    std::ofstream(p) << R"({"prompt": "ab", "response": "cd"})"
                     << "\n"
                     << line << "\n";
    return " --data sft:" + p.string();
  };
  const std::string where = (dir / "bad.jsonl").string() + ":2: ";
  expect_one_error_line(run_cli(kSft + tok + with_line2("{\"prompt\": ") + out),
                        where + "not valid JSON");
  expect_one_error_line(
      run_cli(kSft + tok + with_line2(R"({"messages": [{"role": "bot", "content": "x"}]})") + out),
      where + "message 0: unknown role 'bot'");
  expect_one_error_line(run_cli(kSft + tok +
                                with_line2(R"({"messages": [{"role": "user", "content": "x"}, )"
                                           R"({"role": "assistant", "content": ""}]})") +
                                out),
                        where + "message 1: an empty assistant message");
  expect_one_error_line(
      run_cli(kSft + tok +
              with_line2(R"({"prompt": "x", "response": ")" + std::string(80, 'z') + "\"}") + out),
      where + "the conversation has");
  expect_one_error_line(run_cli(kSft + with_line2(R"({"prompt": "x", "response": "y"})") + out),
                        "needs --tokenizer");
  expect_one_error_line(run_cli("eval " + (dir / "none").string() + " --data fortunes"), "none");
  EXPECT_FALSE(fs::exists(dir / "never")) << "nothing written on bad input";
  test::remove_test_dir(dir);
}

}  // namespace
