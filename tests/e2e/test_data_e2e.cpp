// `packmoe train` on the data forms of issue 26, as a user runs it on the CPU: one plain text file
// trains (split by position), a folder of 30 small files evaluates on what its validation split
// holds, "megatron:a,megatron:b" is a list, and a weighted blend with shuffling (the default)
// resumed from a checkpoint continues bitwise like the uninterrupted run; --no-shuffle is
// another run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "io/token_data.h"
#include "train/metrics.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

const std::string kTiny = "train --preset tiny --device cpu --log-interval 1";

// Every record's step, split, loss, lr and grad norm (not its timing).
using Key = std::tuple<int64_t, train::Split, double, double, std::optional<double>>;
std::vector<Key> metrics(const fs::path& out) {
  std::vector<Key> keys;
  const auto records = train::read_metrics((out / "metrics.jsonl").string());
  EXPECT_TRUE(records.is_ok()) << records.status().message();
  if (!records.is_ok()) return keys;
  for (const train::MetricsRecord& r : records.value())
    keys.emplace_back(r.step, r.split, r.loss, r.lr, r.grad_norm);
  return keys;
}

std::string words(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  const char* vocab[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
                         "and", "runs", "far", "away"};
  std::string text;
  for (int i = 0; i < n; ++i) {
    text += vocab[rng() % 13];
    text += (i % 12 == 11) ? ".\n" : " ";
  }
  return text;
}

TEST(DataE2E, OnePlainTextFileTrainsSplitByPosition) {
  const fs::path dir = test::make_test_dir("data_e2e_");
  std::ofstream(dir / "my.txt") << words(2000, 1);  // no '%' lines: one document
  const RunResult r = run_cli(kTiny + " --steps 2 --eval-interval 2 --data text:" +
                              (dir / "my.txt").string() + " --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("split by position"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("validation loss at iteration        2"), std::string::npos) << r.output;
  test::remove_test_dir(dir);
}

TEST(DataE2E, FolderOfThirtySmallFilesEvaluatesWhatItsSplitHolds) {
  const fs::path dir = test::make_test_dir("data_e2e_");
  fs::create_directories(dir / "docs");
  for (int f = 0; f < 30; ++f)
    std::ofstream(dir / "docs" / ("file" + std::to_string(f) + ".txt")) << words(220, 100 + f);
  const RunResult r = run_cli(kTiny + " --steps 2 --eval-interval 2 --data text:" +
                              (dir / "docs").string() + " --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("30 files"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("validation loss at iteration        2"), std::string::npos) << r.output;
  // Fewer than the 8 x 8 rows of --eval-batches 8: the run says how many batches it reads.
  EXPECT_NE(r.output.find("of the 8 --eval-batches"), std::string::npos) << r.output;
  test::remove_test_dir(dir);
}

// Two Megatron files of byte tokens (documents of a few hundred bytes).
std::pair<std::string, std::string> two_sources(const fs::path& dir) {
  for (const auto& [name, seed] : {std::pair{"a", 1u}, std::pair{"b", 2u}}) {
    io::TokenDataset d;
    d.doc_offsets = {0};
    for (int doc = 0; doc < 60; ++doc) {
      for (unsigned char c : words(40 + doc % 7, seed * 1000 + doc)) d.tokens.push_back(c);
      d.doc_offsets.push_back(d.tokens.size());
    }
    EXPECT_TRUE(io::write_megatron((dir / name).string(), d).is_ok());
  }
  return {"megatron:" + (dir / "a").string(), "megatron:" + (dir / "b").string()};
}

TEST(DataE2E, CommaSeparatedSourcesAreAList) {
  const fs::path dir = test::make_test_dir("data_e2e_");
  const auto [a, b] = two_sources(dir);
  const RunResult r = run_cli(kTiny + " --steps 2 --eval-interval 2 --micro-batch 4 --data '" + a +
                              "," + b + "' --out " + (dir / "out").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("data: " + a + ", " + b + ", shuffled"), std::string::npos) << r.output;
  test::remove_test_dir(dir);
}

TEST(DataE2E, ShuffledBlendResumesBitwise) {
  const fs::path dir = test::make_test_dir("data_e2e_");
  const auto [a, b] = two_sources(dir);
  const std::string run = kTiny + " --micro-batch 4 --seq-len 32 --eval-interval 3 " +
                          "--eval-batches 2 --warmup 2 --decay-steps 8 --data '0.7 " + a +
                          " 0.3 " + b + "'";
  RunResult r = run_cli(run + " --steps 8 --out " + (dir / "straight").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("shuffled"), std::string::npos) << r.output;
  const std::string save = " --save-dir " + (dir / "ckpt").string();
  r = run_cli(run + " --steps 5" + save + " --out " + (dir / "resumed").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli(run + " --steps 8 --resume auto" + save + " --out " + (dir / "resumed").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("at step 5"), std::string::npos) << r.output;
  const std::vector<Key> straight = metrics(dir / "straight");
  EXPECT_EQ(straight.size(), 8u + 3u);  // eval after 3, 6, 8
  std::vector<Key> resumed = metrics(dir / "resumed");
  std::erase_if(resumed, [](const Key& k) {  // the first run's evaluation after its last step
    return std::get<0>(k) == 5 && std::get<1>(k) == train::Split::kEval;
  });
  EXPECT_EQ(resumed, straight);
  // Another order is another run.
  r = run_cli(run + " --steps 8 --no-shuffle --out " + (dir / "unshuffled").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("in file order"), std::string::npos) << r.output;
  EXPECT_NE(metrics(dir / "unshuffled"), straight);
  test::remove_test_dir(dir);
}

}  // namespace
