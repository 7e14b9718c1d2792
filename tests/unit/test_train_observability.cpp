// What `packmoe train` reports about a run, through the real binary on the tiny model: the
// aux loss (Hugging Face's value in metrics.jsonl, / top_k on the log line) and the expert load
// per MoE layer at log steps, the summary over the last log interval's mean, the TensorBoard
// event file, and a resumed run extended with a larger --steps keeping its schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"

namespace packmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::run_cli;

const std::string kTiny =
    " --preset tiny --device cpu --micro-batch 2 --seq-len 16 --eval-batches 1 --warmup 1";

// A corpus of its own in `dir` (the default one is an OS package a machine may lack), as the
// --data flag that reads it.
std::string own_corpus(const fs::path& dir) {
  std::ofstream out(dir / "text.txt");
  for (int i = 0; i < 400; ++i)
    out << "line " << i << ": the quick brown fox jumps over the lazy dog " << i * 7 % 13 << "\n";
  return " --data text:" + (dir / "text.txt").string();
}

std::vector<json> records(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TrainObservability, AuxLossExpertLoadSummaryAndTensorBoard) {
  const fs::path dir = test::make_test_dir("train_observability_");
  const test::RunResult r = run_cli(
      "train" + kTiny + own_corpus(dir) + " --steps 4 --log-interval 2 --eval-interval 4 --out " +
      (dir / "run").string() + " --tensorboard " + (dir / "tb").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> recs = records(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(recs.size(), 5u);  // 4 train, 1 eval
  for (const json& j : recs) {
    if (j["split"] != "train") continue;
    // tiny: k = 2, so the load balance is aux / 2 (1.0 = balanced).
    EXPECT_NEAR(j["load_balance"].get<double>(), j["aux_loss"].get<double>() / 2, 1e-7);
    EXPECT_GT(j["aux_loss"].get<double>(), 1.5);  // about k at init
    const bool log_step = j["step"].get<int>() % 2 == 0;
    ASSERT_EQ(j.contains("expert_load"), log_step) << j.dump();
    if (!log_step) continue;
    ASSERT_EQ(j["expert_load"].size(), 2u);  // both decoder layers are MoE
    for (const json& l : j["expert_load"]) {
      EXPECT_LE(l["min"].get<int64_t>(), l["max"].get<int64_t>());
      EXPECT_LE(l["max"].get<int64_t>(), 32 * 2);  // T k pairs of one micro-batch
      EXPECT_GE(l["cv"].get<double>(), 0.0);
    }
  }
  // The summary's last value is the mean of steps 3 and 4 (the last log interval).
  const double mean = (recs[2]["loss"].get<double>() + recs[3]["loss"].get<double>()) / 2;
  char want[128];
  std::snprintf(want, sizeof want, "-> %.4f (mean of steps 3-4)", mean);
  EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("load_balancing_loss: "), std::string::npos);
  // One event file holding the tags (its format: test_tensorboard).
  std::vector<fs::path> events;
  for (const auto& e : fs::directory_iterator(dir / "tb")) events.push_back(e.path());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].filename().string().rfind("events.out.tfevents.", 0), 0u);
  const std::string tb = slurp(events[0]);
  for (const char* tag :
       {"train/loss", "train/lr", "train/grad_norm", "train/aux_loss", "train/tokens_per_s",
        "memory/host_peak_gib", "eval/loss", "expert_load/layer1/cv"})
    EXPECT_NE(tb.find(tag), std::string::npos) << tag;
  // An unwritable --tensorboard is refused before the run.
  const test::RunResult bad = run_cli("train" + kTiny + own_corpus(dir) + " --steps 1 --out " +
                                      (dir / "bad").string() + " --tensorboard /dev/null/tb");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_EQ(bad.output.rfind("packmoe: error: --tensorboard", 0), 0u) << bad.output;
  EXPECT_FALSE(fs::exists(dir / "bad" / "metrics.jsonl"));
  test::remove_test_dir(dir);
}

TEST(TrainObservability, LongerStepsOnResumeKeepTheSchedule) {
  const fs::path dir = test::make_test_dir("train_observability_");
  const std::string common = kTiny + own_corpus(dir) + " --eval-interval 0 --out " +
                             (dir / "run").string() + " --save-dir " + (dir / "ckpt").string();
  ASSERT_EQ(run_cli("train" + common + " --steps 4").exit_code, 0);
  const test::RunResult r = run_cli("train" + common + " --steps 6 --resume auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("schedule: --steps 6 continues a run of 4 steps on its own schedule"),
            std::string::npos)
      << r.output;
  const std::vector<json> recs = records(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(recs.size(), 6u);
  EXPECT_EQ(recs[3]["lr"].get<double>(), 3e-4);  // step 4: the cosine's end, --min-lr
  EXPECT_EQ(recs[4]["lr"].get<double>(), 3e-4);  // steps 5, 6 stay there: no jump
  EXPECT_EQ(recs[5]["lr"].get<double>(), 3e-4);
  // --decay-steps re-stretches the cosine explicitly.
  const test::RunResult s = run_cli(
      "train" + kTiny + own_corpus(dir) + " --eval-interval 0 --out " + (dir / "run2").string() +
      " --save-dir " + (dir / "ckpt").string() + " --steps 8 --decay-steps 8 --resume auto");
  ASSERT_EQ(s.exit_code, 0) << s.output;
  EXPECT_EQ(s.output.find("schedule:"), std::string::npos);
  test::remove_test_dir(dir);
}

}  // namespace
}  // namespace packmoe
