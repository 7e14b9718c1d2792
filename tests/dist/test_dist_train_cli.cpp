// `mpirun -np 2 packmoe train --device cpu` end to end: the CLI's data-parallel job (MPI, the
// gather mode flag, rank 0 alone printing and writing) against the same command as one process
// with --grad-accum 2: the losses in metrics.jsonl are bitwise equal (JSON keeps every double
// exactly), the grad norms within 1e-12 relative; with --expert-parallel 2 the same bits again;
// with --dispatch-dtype recipe too the first loss bitwise and the later ones within 1e-3.
// Runs the binaries CTest names in
// PACKMOE_MPIEXEC and PACKMOE_CLI.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/run_cli.h"
#include "common/test_files.h"

namespace packmoe::test {
namespace {

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) records.push_back(nlohmann::json::parse(line));
  return records;
}

TEST(DistTrainCli, TwoRanksEqualOneProcessWithTwoMicroBatches) {
  const std::filesystem::path dir = make_test_dir("dist_train_cli_");
  const std::string corpus = (dir / "corpus.txt").string();
  {
    std::ofstream out(corpus);
    for (int doc = 0; doc < 60; ++doc) {
      for (int line = 0; line < 5; ++line)
        out << "document " << doc << " line " << (doc * 7919 + line * 104729) % 1013
            << " of the data-parallel cli corpus\n";
      out << "%\n";
    }
  }
  const uint64_t seed = recorded_random_seed() % 100000;
  const std::string common = " train --device cpu --steps 3 --micro-batch 2 --seq-len 16 --warmup 1 "
                             "--grad-clip 0 --eval-interval 0 --log-interval 1 --recipe mxfp8 "
                             "--seed " + std::to_string(seed) + " --data text:" + corpus;
  const std::string cli = ctest_env("PACKMOE_CLI");
  const RunResult dp = run_shell(ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + cli +
                                 common + " --gather-mode lowp --out " + (dir / "dp").string());
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_EQ(count_of(dp.output, "packmoe train:"), 1u) << "rank 0 alone prints:\n" << dp.output;
  EXPECT_NE(dp.output.find("data parallel: 2 ranks (mpi)"), std::string::npos) << dp.output;
  EXPECT_NE(dp.output.find("gather mode lowp"), std::string::npos) << dp.output;
  const RunResult one = run_shell(cli + common + " --grad-accum 2 --out " + (dir / "one").string());
  ASSERT_EQ(one.exit_code, 0) << one.output;
  // Expert parallelism over the 2 ranks: bitwise the data-parallel run (docs/dist.md).
  const RunResult ep = run_shell(ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + cli +
                                 common + " --expert-parallel 2 --out " + (dir / "ep").string());
  ASSERT_EQ(ep.exit_code, 0) << ep.output;
  EXPECT_NE(ep.output.find("expert parallel: EP 2"), std::string::npos) << ep.output;
  // The forward's rows as MXFP8 codes and scales: 64 + 2 bytes per row of the tiny preset.
  const RunResult rc =
      run_shell(ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + cli + common +
                " --expert-parallel 2 --dispatch-dtype recipe --out " + (dir / "rc").string());
  ASSERT_EQ(rc.exit_code, 0) << rc.output;
  EXPECT_NE(rc.output.find("(dispatch recipe: 66 B per row)"), std::string::npos) << rc.output;

  const std::vector<nlohmann::json> a = read_metrics((dir / "dp" / "metrics.jsonl").string());
  const std::vector<nlohmann::json> b = read_metrics((dir / "one" / "metrics.jsonl").string());
  const std::vector<nlohmann::json> e = read_metrics((dir / "ep" / "metrics.jsonl").string());
  const std::vector<nlohmann::json> q = read_metrics((dir / "rc" / "metrics.jsonl").string());
  ASSERT_EQ(q.size(), 3u);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  ASSERT_EQ(e.size(), 3u);
  for (size_t s = 0; s < a.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    EXPECT_EQ(a[s]["loss"].get<double>(), b[s]["loss"].get<double>());
    EXPECT_EQ(e[s]["loss"].get<double>(), a[s]["loss"].get<double>());
    const double na = a[s]["grad_norm"].get<double>(), nb = b[s]["grad_norm"].get<double>();
    EXPECT_LE(std::fabs(na - nb) / nb, 1e-12);
    EXPECT_LE(std::fabs(e[s]["grad_norm"].get<double>() - na) / na, 1e-12);
    const double lq = q[s]["loss"].get<double>(), le = e[s]["loss"].get<double>();
    if (s == 0)
      EXPECT_EQ(lq, le);
    else
      EXPECT_LE(std::fabs(lq - le), 1e-3 * le);
  }
  remove_test_dir(dir);
}

TEST(DistTrainCli, ExpertParallelThatDoesNotDivideIsOneErrorLine) {
  // A corpus of its own: the default one (the fortunes package) may be absent on the machine.
  const std::filesystem::path dir = make_test_dir("dist_train_cli_ep_bad_");
  const std::string corpus = (dir / "corpus.txt").string();
  {
    std::ofstream out(corpus);
    for (int line = 0; line < 400; ++line) out << "line " << line * 7919 % 1013 << " of text\n";
  }
  const std::string cli = ctest_env("PACKMOE_CLI");
  const RunResult r = run_shell(ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + cli +
                                " train --device cpu --steps 1 --expert-parallel 3 --data text:" +
                                corpus + " --out " + (dir / "out").string());
  remove_test_dir(dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_of(r.output, "packmoe: error:"), 1u) << r.output;
  EXPECT_NE(r.output.find("--expert-parallel 3 does not divide the 2 ranks"), std::string::npos)
      << r.output;
}

TEST(DistTrainCli, DispatchDtypeRecipeWithBf16IsOneErrorLine) {
  const std::filesystem::path dir = make_test_dir("dist_train_cli_dispatch_bad_");
  const std::string corpus = (dir / "corpus.txt").string();
  {
    std::ofstream out(corpus);
    for (int line = 0; line < 400; ++line) out << "line " << line * 7919 % 1013 << " of text\n";
  }
  const std::string cli = ctest_env("PACKMOE_CLI");
  const RunResult r = run_shell(ctest_env("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 " + cli +
                                " train --device cpu --steps 1 --expert-parallel 2 "
                                "--dispatch-dtype recipe --data text:" +
                                corpus + " --out " + (dir / "out").string());
  EXPECT_FALSE(std::filesystem::exists(dir / "out")) << "nothing is written before the check";
  remove_test_dir(dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_of(r.output, "packmoe: error:"), 1u) << r.output;
  EXPECT_NE(r.output.find("dispatch_dtype = recipe needs the mxfp8 or nvfp4 recipe"),
            std::string::npos)
      << r.output;
}

TEST(DistTrainCli, BadGatherModeIsOneErrorLine) {
  const RunResult r = run_cli("train --device cpu --steps 1 --gather-mode fp8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_of(r.output, "\n"), 1u) << r.output;
  EXPECT_NE(r.output.find("--gather-mode: unknown parameter gather mode 'fp8' (bf16, lowp, "
                          "reuse-grad-buffer)"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace packmoe::test
