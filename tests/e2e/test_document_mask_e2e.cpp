// `packmoe train --attention-mask document` as a user runs it on the CPU: the tiny preset trains
// with attention restricted to each document (the text corpus's own boundaries, or an
// end-of-document token), its loss falls, and the mask changes the run; bad combinations of the
// masking flags are one error line.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "train/metrics.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

fs::path temp_dir() { return packmoe::test::make_test_dir("document_mask_"); }

// 400 short fortune-format documents, so every 64-token row crosses document boundaries.
std::string corpus_flag(const fs::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  for (int d = 0; d < 400; ++d)
    f << "Fortune " << d << " says: " << (d * 7919) % 1000 << " lazy dogs.\n%\n";
  return " --data text:" + (dir / "corpus.txt").string();
}

std::vector<double> train_losses(const fs::path& out) {
  std::vector<double> losses;
  const auto records = train::read_metrics((out / "metrics.jsonl").string());
  EXPECT_TRUE(records.is_ok()) << records.status().message();
  if (!records.is_ok()) return losses;
  for (const train::MetricsRecord& rec : records.value())
    if (rec.split == train::Split::kTrain) losses.push_back(rec.loss);
  return losses;
}

const std::string kRun =
    "train --preset tiny --device cpu --steps 60 --micro-batch 4 --seq-len 64 --eval-interval 0 "
    "--log-interval 20";

TEST(DocumentMask, TinyPresetTrainsAndTheMaskChangesTheRun) {
  const fs::path dir = temp_dir();
  const std::string data = corpus_flag(dir);
  RunResult r = run_cli(kRun + data + " --attention-mask document --reset-position-ids --out " +
                        (dir / "document").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> doc = train_losses(dir / "document");
  ASSERT_EQ(doc.size(), 60u);
  // From ln 256 = 5.55; the causal run of this length ends near 3 (measured 2.9-3.2).
  EXPECT_GT(doc.front(), 5.0);
  EXPECT_LT(doc.back(), doc.front() - 1.5) << "the loss does not fall";

  // An end-of-document token (the separator '\n' = 10 here) is another way to cut documents.
  r = run_cli(kRun + data + " --attention-mask document --eod-token 10 --out " +
              (dir / "eod").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(train_losses(dir / "eod").back(), doc.front() - 1.5);

  r = run_cli(kRun + data + " --out " + (dir / "causal").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> causal = train_losses(dir / "causal");
  ASSERT_EQ(causal.size(), 60u);
  EXPECT_NE(causal.front(), doc.front()) << "the mask must change the forward";
  fs::remove_all(dir);
}

void expect_one_error_line(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ASSERT_FALSE(r.output.empty());
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "missing '" << needle << "' in "
                                                      << r.output;
}

TEST(DocumentMask, BadFlagsAreOneErrorLine) {
  const fs::path dir = temp_dir();
  const std::string out = " --out " + (dir / "never").string();
  expect_one_error_line(run_cli(kRun + " --attention-mask sliding" + out), "causal or document");
  expect_one_error_line(run_cli(kRun + " --eod-token 10" + out), "need --attention-mask document");
  expect_one_error_line(run_cli(kRun + " --reset-position-ids" + out),
                        "need --attention-mask document");
  expect_one_error_line(run_cli(kRun + " --attention-mask document --eod-token -3" + out),
                        "--eod-token -3");
  EXPECT_FALSE(fs::exists(dir / "never")) << "nothing written on bad input";
  fs::remove_all(dir);
}

}  // namespace
