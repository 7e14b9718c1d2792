// The small pieces a resume relies on: the TrainConfig JSON round trip (every field, doubles
// exact), truncate_metrics_after (later steps and a torn last line go, a complete record missing
// only its newline stays, a malformed middle line is an error, an untouched file is not
// rewritten), the sampler position saved at an epoch end,
// check_same_model naming the first different field, and the HF fields of config.json.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "train/batch_sampler.h"
#include "train/metrics.h"
#include "train/model_config.h"
#include "train/train_config.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_file(const std::string& name) {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  const fs::path dir = (env && *env ? fs::path(env) : fs::temp_directory_path()) /
                       ("resume_state_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(ResumeState, TrainConfigJsonRoundTripsEveryField) {
  TrainConfig c;
  c.steps = 77;
  c.micro_batch_size = 3;
  c.seq_len = 40;
  c.grad_accum_steps = 5;
  c.lr = 0.1 + 0.2;  // not a short decimal
  c.min_lr = 1e-7 / 3;
  c.warmup_steps = 9;
  c.decay_steps = 70;
  c.weight_decay = 0.05;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.eps = 3e-9;
  c.grad_clip = 0;
  c.eval_interval = 0;
  c.eval_batches = 4;
  c.log_interval = 2;
  c.seed = 18446744073709551557ull;  // above 2^63
  c.precision.recipe.recipe = Recipe::kNvfp4;
  c.precision.layout = Layout::kDiscrete;
  c.precision.primary = PrimaryWeight::kHighPrecision;
  const nlohmann::json j = nlohmann::json::parse(train_config_to_json(c).dump());
  TrainConfig back;
  ASSERT_TRUE(apply_train_json(j, &back).is_ok());
  EXPECT_EQ(train_config_to_json(back), train_config_to_json(c));
  EXPECT_EQ(back.lr, c.lr);
  EXPECT_EQ(back.min_lr, c.min_lr);
  EXPECT_EQ(back.seed, c.seed);
  EXPECT_EQ(back.decay_steps, c.decay_steps);
  EXPECT_EQ(back.precision.recipe.recipe, Recipe::kNvfp4);
  EXPECT_EQ(back.precision.layout, Layout::kDiscrete);
  EXPECT_EQ(back.precision.primary, PrimaryWeight::kHighPrecision);
  EXPECT_FALSE(train_config_to_json(TrainConfig{}).contains("decay_steps"));
}

const char* kLine1 =
    R"({"step":1,"split":"train","loss":5.5,"lr":0.1,"tokens_per_s":1,"elapsed_s":1})";
const char* kLine2 =
    R"({"step":2,"split":"eval","loss":5.4,"lr":0.1,"tokens_per_s":1,"elapsed_s":2})";
const char* kLine3 =
    R"({"step":3,"split":"train","loss":5.3,"lr":0.1,"tokens_per_s":1,"elapsed_s":3})";

TEST(ResumeState, TruncateMetricsDropsLaterStepsAndATornLine) {
  const fs::path p = temp_file("metrics.jsonl");
  const std::string head = std::string(kLine1) + "\n" + kLine2 + "\n";
  std::ofstream(p, std::ios::trunc) << head << kLine3 << "\n{\"step\": 4, \"spl";
  ASSERT_TRUE(truncate_metrics_after(p.string(), 2).is_ok());
  EXPECT_EQ(read_text(p), head);

  // A last record that lost only its newline is kept, newline added, so appends stay lines.
  std::ofstream(p, std::ios::trunc) << kLine1 << "\n" << kLine2;
  ASSERT_TRUE(truncate_metrics_after(p.string(), 2).is_ok());
  EXPECT_EQ(read_text(p), head);

  // Nothing to drop: the file is left as it is (no rewrite, blank lines kept).
  std::ofstream(p, std::ios::trunc) << head << "\n";
  const auto before = fs::last_write_time(p);
  ASSERT_TRUE(truncate_metrics_after(p.string(), 5).is_ok());
  EXPECT_EQ(read_text(p), head + "\n");
  EXPECT_EQ(fs::last_write_time(p), before);

  // A bad line that is not the torn last one is an error naming the line.
  std::ofstream(p, std::ios::trunc) << kLine1 << "\nnot json\n" << kLine3 << "\n";
  const Status s = truncate_metrics_after(p.string(), 1);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("metrics.jsonl:2: malformed metrics line"), std::string::npos)
      << s.message();
  EXPECT_TRUE(truncate_metrics_after((p.parent_path() / "absent.jsonl").string(), 1).is_ok());
  fs::remove_all(p.parent_path());
}

TEST(ResumeState, SamplerStateAtAnEpochEndContinuesInTheNextEpoch) {
  io::TokenDataset d;
  for (uint32_t i = 0; i < 100; ++i) d.tokens.push_back(i % 50);
  StreamOptions shuffled;
  shuffled.shuffle = true;
  shuffled.seed = 7;
  for (const StreamOptions& o : {StreamOptions{}, shuffled}) {
    BatchSampler s = BatchSampler::create(single_source(d), 50, 1, 16, o).value();  // 6 windows
    for (int i = 0; i < 6; ++i) s.next();
    EXPECT_EQ(s.state().consumed, std::vector<int64_t>{6});  // the next row starts epoch 1
    BatchSampler t = BatchSampler::create(single_source(d), 50, 1, 16, o).value();
    ASSERT_TRUE(t.set_state(s.state()).is_ok());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(s.next().inputs, t.next().inputs);
    EXPECT_EQ(s.state().consumed, t.state().consumed);
    EXPECT_FALSE(t.set_state({{-1}}).is_ok());
    EXPECT_FALSE(t.set_state({{1, 2}}).is_ok());  // another number of sources
  }
}

TEST(ResumeState, SameModelCheckNamesTheFirstDifference) {
  const ModelConfig tiny = model_config_preset("tiny").value();
  EXPECT_TRUE(check_same_model(tiny, tiny, "x/config.json").is_ok());
  ModelConfig other = tiny;
  other.num_experts = 8;
  EXPECT_EQ(check_same_model(tiny, other, "x/config.json").message(),
            "x/config.json is another model: num_experts = 8 there, 4 here");
}

TEST(ResumeState, ConfigJsonHasTheFieldsTransformersReads) {
  const ModelConfig tiny = model_config_preset("tiny").value();
  const nlohmann::json f32 = model_config_to_json(tiny);
  const nlohmann::json bf16 = model_config_to_json(tiny, DType::kBF16);
  EXPECT_EQ(f32.at("torch_dtype"), "float32");
  EXPECT_EQ(f32.at("dtype"), "float32");
  EXPECT_EQ(bf16.at("torch_dtype"), "bfloat16");
  EXPECT_EQ(bf16.at("dtype"), "bfloat16");
  EXPECT_EQ(f32.at("architectures"), nlohmann::json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(f32.at("model_type"), "qwen3_moe");
  EXPECT_EQ(f32.at("rope_parameters"),
            (nlohmann::json{{"rope_type", "default"}, {"rope_theta", tiny.rope_theta}}));
  for (const char* key : {"hidden_act", "attention_bias", "attention_dropout", "use_sliding_window",
                          "sliding_window", "use_cache", "output_router_logits", "head_dim"})
    EXPECT_TRUE(f32.contains(key)) << key;
  // Our own reader takes it back unchanged.
  EXPECT_EQ(model_config_to_json(model_config_from_json(bf16).value()), f32);
}

}  // namespace
}  // namespace packmoe::train
