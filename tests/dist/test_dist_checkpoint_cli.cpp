// `mpirun -np N packmoe train` with checkpoints, the real binary: an uninterrupted 2-rank run of 4
// steps saving every 2 steps; a crash after the step-2 save (its save root without step 4, a
// leftover temporary directory of a save in progress, metrics.jsonl with records past step 2 and
// a torn last line); `--resume auto` with 1, 2 and 3 ranks at the same rows per step continues
// it, and the metrics equal the uninterrupted run's: 2 ranks bitwise, 1 and 3 ranks within the
// bounds of tests/dist/test_dist_checkpoint.cpp (the same model: the tiny preset without the
// load-balancing loss, which would make rows grouped otherwise another objective); `packmoe
// export-hf` reads the checkpoints of
// every rank count. A rank killed at a random moment (often mid-save) leaves only complete
// checkpoints, and 3 ranks resume the newest. A damaged checkpoint ends a 2- or 3-rank resume
// non-zero with one error line.
// Needs $PACKMOE_CLI, $PACKMOE_MPIEXEC, $PACKMOE_TEST_TMP (set by CTest).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "train/checkpoint.h"
#include "train/model_config.h"

namespace packmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::ctest_env;
using test::RunResult;
using test::run_shell;

// `mpirun -np N packmoe train ARGS` (N = 0: no mpirun), bounded by `timeout` so a hang fails.
RunResult run(int ranks, const std::string& args) {
  std::string cmd = "timeout 240 ";
  if (ranks > 0)
    cmd += ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np " + std::to_string(ranks) + " ";
  return run_shell(cmd + ctest_env("PACKMOE_CLI") + " " + args);
}

struct Record {
  int64_t step;
  double loss, grad_norm;
};

std::vector<Record> train_records(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<Record> out;
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    if (j["split"] == "train")
      out.push_back(
          {j["step"].get<int64_t>(), j["loss"].get<double>(), j["grad_norm"].get<double>()});
  }
  return out;
}

class DistCheckpointCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(ctest_env("PACKMOE_TEST_TMP")) / ("dist_ckpt_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ModelConfig model = train::model_config_preset("tiny").value();
    model.router_aux_loss_coef = 0;
    ASSERT_TRUE(train::save_model_config(model, (dir_ / "model.json").string()).is_ok());
    // A fresh corpus: documents of random words, '%' lines between them.
    std::mt19937_64 rng(std::random_device{}());
    std::ofstream text(dir_ / "corpus.txt");
    const char* words[] = {"expert", "packed", "shard", "rank", "weight", "gather", "step", "moe"};
    for (int d = 0; d < 300; ++d) {
      for (int w = 0; w < 12; ++w) text << words[rng() % 8] << (w == 11 ? "\n" : " ");
      text << "%\n";
    }
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string common(int64_t rows, int64_t accum, int64_t steps = 4) const {
    return "train --device cpu --config " + (dir_ / "model.json").string() +
           " --data text:" + (dir_ / "corpus.txt").string() + " --steps " + std::to_string(steps) +
           " --seq-len 16 --micro-batch " + std::to_string(rows) + " --grad-accum " +
           std::to_string(accum) +
           " --lr 1e-3 --warmup 1 --grad-clip 0 --eval-interval 0 --log-interval 1 --seed 11";
  }
  fs::path dir_;
};

TEST_F(DistCheckpointCli, CrashThenResumeWithAnotherRankCountContinuesTheRun) {
  const fs::path straight = dir_ / "straight";
  const RunResult s = run(2, common(3, 1) + " --save-interval 2 --keep-last 5 --save-dir " +
                               (straight / "ckpt").string() + " --out " + straight.string());
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const std::vector<Record> want = train_records(straight / "metrics.jsonl");
  ASSERT_EQ(want.size(), 4u) << s.output;
  const std::string step4 = io::checkpoint_dir_name(4);

  // Bounds of tests/dist/test_dist_checkpoint.cpp: relative on loss and grad norm; one process
  // has the first resumed step's loss bitwise and its grad norm within 1e-7.
  struct Resume {
    int ranks;  // 0: no mpirun
    int64_t rows, accum;
    bool bitwise, same_first_step;
  };
  constexpr double kLossBound = 5e-4, kNormBound = 1e-2, kFirstStepNormBound = 1e-7;
  const Resume resumes[] = {{2, 3, 1, true, true}, {3, 2, 1, false, false}, {0, 3, 2, false, true}};
  for (const Resume& r : resumes) {
    SCOPED_TRACE("resumed by " + std::to_string(std::max(r.ranks, 1)) + " rank(s)");
    // The crash: after the step-2 save, during the step-4 save.
    const fs::path crashed = dir_ / ("crashed_np" + std::to_string(r.ranks));
    fs::copy(straight, crashed, fs::copy_options::recursive);
    fs::remove_all(crashed / "ckpt" / step4);
    fs::create_directories(crashed / "ckpt" / (".tmp-" + step4 + "-999999999"));
    std::ofstream(crashed / "ckpt" / (".tmp-" + step4 + "-999999999") /
                  train::optimizer_shard_file(0, 2))
        << "half a shard";
    std::ofstream(crashed / "metrics.jsonl", std::ios::app) << "{\"step\": 5, \"spl";

    const RunResult resumed =
        run(r.ranks, common(r.rows, r.accum) + " --resume auto --save-interval 2 --save-dir " +
                         (crashed / "ckpt").string() + " --out " + crashed.string());
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("at step 2 (saved by 2 rank(s), continued by " +
                                  std::to_string(std::max(r.ranks, 1)) + ")"),
              std::string::npos)
        << resumed.output;
    const std::vector<Record> got = train_records(crashed / "metrics.jsonl");
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, want[i].step);
      const double loss_diff = std::fabs(got[i].loss - want[i].loss) / want[i].loss;
      const double norm_diff = std::fabs(got[i].grad_norm - want[i].grad_norm) / want[i].grad_norm;
      if (r.bitwise || i < 2) {  // steps 1 and 2 are the crashed run's own records
        EXPECT_EQ(got[i].loss, want[i].loss) << "step " << got[i].step;
        EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << "step " << got[i].step;
      } else if (r.same_first_step && i == 2) {
        EXPECT_EQ(got[i].loss, want[i].loss) << "step " << got[i].step;
        EXPECT_LE(norm_diff, kFirstStepNormBound) << "step " << got[i].step;
      } else {
        EXPECT_LE(loss_diff, kLossBound) << "step " << got[i].step;
        EXPECT_LE(norm_diff, kNormBound) << "step " << got[i].step;
      }
      std::printf("[dist ckpt cli] %d rank(s) step %lld: loss %.17g (uninterrupted %.17g)\n",
                  std::max(r.ranks, 1), static_cast<long long>(got[i].step), got[i].loss,
                  want[i].loss);
    }
    // The new step-4 checkpoint, written by this rank count, exports.
    EXPECT_FALSE(fs::exists(crashed / "ckpt" / (".tmp-" + step4 + "-999999999")));
    const RunResult exported =
        run(0, "export-hf " + (crashed / "ckpt").string() + " " + (crashed / "hf").string());
    ASSERT_EQ(exported.exit_code, 0) << exported.output;
    EXPECT_TRUE(
        io::load_hf_weights((crashed / "hf").string(), train::model_config_preset("tiny").value())
            .is_ok());
  }
}

// A real crash: rank 1 killed (SIGKILL) at a random moment of a run that saves after every step,
// often in the middle of a save. Whatever the moment, every step-* directory left is a complete,
// valid checkpoint, and 3 ranks resume the newest one (removing the dead writer's temporary
// directory at their first commit).
TEST_F(DistCheckpointCli, KilledRankLeavesOnlyCompleteCheckpointsAndTheRunResumes) {
  const fs::path root = dir_ / "ckpt";
  std::mt19937_64 rng(std::random_device{}());
  // The kill lands a random 0-1 s after the first checkpoint exists (a checkpoint is saved every
  // step, so mostly mid-save); waiting for it rather than a fixed time keeps a loaded machine,
  // whose start-up takes longer, from killing the job before it saved anything.
  const int sleep_ms = static_cast<int>(rng() % 1000);
  const std::string script =
      ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + ctest_env("PACKMOE_CLI") + " " +
      common(2, 1, 100000) + " --save-interval 1 --keep-last 3 --save-dir " + root.string() +
      " --out " + (dir_ / "out").string() + " > " + (dir_ / "log").string() +
      " 2>&1 & m=$!; for i in $(seq 900); do ls " + root.string() +
      " 2>/dev/null | grep -q ^step- && break; sleep 0.1; done; sleep " +
      std::to_string(sleep_ms / 1000.0) + "; kill -9 $(pgrep -P $m | tail -1); wait $m";
  const int status = std::system(("timeout 120 bash -c '" + script + "'").c_str());
  EXPECT_NE(status, 0) << "the killed job must fail";
  int64_t newest = 0;
  int tmp_dirs = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0) ++tmp_dirs;
    if (name.rfind("step-", 0) != 0) continue;
    Result<train::TrainerCheckpoint> c = train::read_trainer_checkpoint(e.path().string());
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    if (c.is_ok()) newest = std::max(newest, c.value().step);
  }
  std::printf(
      "[dist ckpt cli] killed %d ms after the first checkpoint: newest checkpoint step %lld, %d temporary "
      "directories left\n",
      sleep_ms, static_cast<long long>(newest), tmp_dirs);
  const RunResult resumed =
      run(3, common(2, 1, newest + 2) + " --resume auto --save-interval 1 --keep-last 3 " +
                 "--save-dir " + root.string() + " --out " + (dir_ / "out").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  for (const fs::directory_entry& e : fs::directory_iterator(root))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
  EXPECT_TRUE(fs::exists(root / io::checkpoint_dir_name(newest + 2)));
}

TEST_F(DistCheckpointCli, DamagedCheckpointEndsEveryRankWithOneErrorLine) {
  const fs::path root = dir_ / "ckpt";
  const RunResult s = run(
      2, common(3, 1, 2) + " --save-dir " + root.string() + " --out " + (dir_ / "out").string());
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const fs::path dir = root / io::checkpoint_dir_name(2);
  const fs::path shard = dir / train::optimizer_shard_file(1, 2);
  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() / 2] ^= 0x01;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  for (int ranks : {2, 3}) {
    const RunResult r = run(
        ranks, common(3, 1) + " --resume " + dir.string() + " --out " + (dir_ / "out").string());
    EXPECT_NE(r.exit_code, 0) << r.output;
    std::istringstream lines(r.output);
    int errors = 0;
    for (std::string line; std::getline(lines, line);)
      if (line.find("packmoe: error:") != std::string::npos) {
        ++errors;
        EXPECT_NE(line.find(train::optimizer_shard_file(1, 2) + ": CRC-32C"), std::string::npos)
            << line;
      }
    EXPECT_EQ(errors, 1) << r.output;
  }
}

}  // namespace
}  // namespace packmoe
