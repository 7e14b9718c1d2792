// The abort path: each scenario of comm_abort_helper.cpp runs as a child `mpirun -np 2` under a
// 60 s timeout and must end on its own, quickly and non-zero, with a line naming the rank and the
// call. Exit 124 (the timeout) means the job hung: the failure this machinery exists to prevent.
// Then `packmoe train` under mpirun: a set-up error on one rank, or on every rank, is printed once
// and ends the job within seconds; a stopped rank is caught by the --comm-timeout watchdog.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

struct Outcome {
  int status = -1;  // exit code, or 128 + signal
  std::string output;
  double seconds = 0;
};

std::string env_or_die(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    std::fprintf(stderr, "%s is not set (CTest sets it)\n", name);
    std::exit(2);
  }
  return v;
}

Outcome run_command(const std::string& cmd);

Outcome run(const std::string& scenario, bool under_mpirun) {
  std::string cmd = "timeout -k 5 60 env PACKMOE_COMM_TIMEOUT_S=2 ";
  if (under_mpirun) cmd += env_or_die("PACKMOE_MPIEXEC") + " --oversubscribe -np 2 ";
  cmd += env_or_die("PACKMOE_COMM_HELPER") + " " + scenario + " 2>&1";
  return run_command(cmd);
}

Outcome run_command(const std::string& cmd) {
  const auto start = std::chrono::steady_clock::now();
  Outcome o;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return o;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) o.output.append(buf, n);
  const int st = pclose(p);
  o.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

void expect_aborted(const Outcome& o, std::initializer_list<const char*> lines) {
  EXPECT_NE(o.status, 0) << "the misuse went unnoticed:\n" << o.output;
  EXPECT_NE(o.status, 124) << "the job hung until the timeout:\n" << o.output;
  EXPECT_LT(o.seconds, 30) << o.output;
  for (const char* l : lines) EXPECT_NE(o.output.find(l), std::string::npos) << "no '" << l << "' in:\n" << o.output;
}

TEST(CommFailures, MismatchedSizesNameTheOddRank) {
  expect_aborted(run("mismatched-size", true),
                 {"packmoe: mpi all_gather (call #2) failed: the ranks made different calls",
                  "rank 0: all_gather(16 bytes", "rank 1: all_gather(18 bytes", "aborting the job"});
}

TEST(CommFailures, DifferentCallsNameBoth) {
  expect_aborted(run("mismatched-call", true),
                 {"(call #2) failed: the ranks made different calls",
                  "rank 0: all_reduce(i64 sum, 1 elements) as call #2",
                  "rank 1: broadcast(8 bytes, root 0) as call #2"});
}

TEST(CommFailures, BadRootFailsOnItsRank) {
  expect_aborted(run("bad-root", true),
                 {"[rank 1/2] packmoe: mpi broadcast (call #2) failed: root 7 is not a rank of 2"});
}

TEST(CommFailures, MissingCallTimesOutInsteadOfHanging) {
  const Outcome o = run("missing-call", true);
  expect_aborted(o, {"[rank 0/2] packmoe: mpi barrier (call #2) failed: not complete after 2 s"});
  EXPECT_LT(o.seconds, 20) << "rank 1 sleeps 60 s: it must have been terminated";
}

TEST(CommFailures, ProgrammerErrorOnOneRankEndsTheJob) {
  expect_aborted(run("check-failure", true),
                 {"[rank 1] packmoe: check failed at", "planted programmer error"});
}

TEST(CommFailures, OverMpiIntLimitIsRefused) {
  expect_aborted(run("over-int-limit", true),
                 {"mpi all_gather (call #2) failed: size 3221225472 exceeds MPI's int limit 2147483647"});
}

TEST(CommFailures, MismatchedAllToAllNamesBothRanks) {
  expect_aborted(run("mismatched-all-to-all", true),
                 {"[rank 1/2] packmoe: mpi all_to_allv (call #2) failed: rank 1 expects 6 bytes "
                  "from rank 0, which sends 5 bytes to rank 1; aborting the job"});
}

TEST(CommFailures, SplitCommunicatorFailureEndsTheJob) {
  expect_aborted(run("split-failure", true),
                 {"[rank 0/1, job rank 1] packmoe: mpi broadcast (call #1) failed: root 3 is not a rank of 1"});
}

TEST(CommFailures, LocalAbortsToo) {
  expect_aborted(run("local-bad-root", false),
                 {"[rank 0/1] packmoe: local broadcast (call #2) failed: root 1 is not a rank of 1"});
}

// ---- packmoe train under mpirun -np 2 ----------------------------------------------------------

namespace fs = std::filesystem;

// A scratch directory with a small fortune-format corpus.
fs::path train_dir() {
  const fs::path dir = fs::path(env_or_die("PACKMOE_TEST_TMP")) /
                       ("comm_failures_" + std::to_string(::getpid()) + "_" +
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream f(dir / "corpus.txt");
  for (int d = 0; d < 200; ++d) f << "Document " << d << ": the quick brown fox.\n%\n";
  return dir;
}

// `mpirun -np 2 sh -c SCRIPT`; the script sees $CLI, $DIR and $OMPI_COMM_WORLD_RANK.
Outcome run_train_job(const fs::path& dir, const std::string& script) {
  return run_command("timeout -k 5 90 env CLI=" + env_or_die("PACKMOE_CLI") + " DIR=" +
                     dir.string() + " " + env_or_die("PACKMOE_MPIEXEC") +
                     " --oversubscribe -np 2 sh -c '" + script + "' 2>&1");
}

const char* kTrainFlags =
    " --device cpu --micro-batch 2 --seq-len 16 --eval-interval 0 --log-interval 1";

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(TrainJob, OneRanksSetUpErrorIsPrintedOnceByItAndEndsTheJob) {
  const fs::path dir = train_dir();
  // Rank 1's --data is missing; rank 0's is fine.
  const Outcome o = run_train_job(
      dir, std::string("D=$DIR/corpus.txt; ") +
               "[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && D=$DIR/missing.txt; " +
               "exec $CLI train --steps 2 --data text:$D --out $DIR/out" + kTrainFlags);
  EXPECT_NE(o.status, 0) << o.output;
  EXPECT_NE(o.status, 124) << "the job hung:\n" << o.output;
  EXPECT_LT(o.seconds, 30) << o.output;
  EXPECT_EQ(count(o.output, "packmoe: error:"), 1u) << o.output;
  EXPECT_NE(o.output.find("packmoe: error: rank 1: " + (dir / "missing.txt").string() +
                          ": corpus path not found"),
            std::string::npos)
      << o.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
  fs::remove_all(dir);
}

TEST(TrainJob, AnErrorEveryRankHitsIsPrintedOnce) {
  const fs::path dir = train_dir();
  for (const std::string bad : {" --micro-batch 0", " --seed -1", " --frobnicate"}) {
    SCOPED_TRACE(bad);
    const Outcome o = run_train_job(dir, "exec $CLI train --steps 2 --data text:$DIR/corpus.txt "
                                         "--out $DIR/out" + std::string(kTrainFlags) + bad);
    EXPECT_NE(o.status, 0) << o.output;
    EXPECT_NE(o.status, 124) << "the job hung:\n" << o.output;
    EXPECT_LT(o.seconds, 30) << o.output;
    EXPECT_EQ(count(o.output, "packmoe: error:"), 1u) << o.output;
    EXPECT_EQ(o.output.find("rank 1"), std::string::npos) << o.output;
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
  fs::remove_all(dir);
}

TEST(TrainJob, AStoppedRankIsCaughtByTheWatchdog) {
  const fs::path dir = train_dir();
  // Rank 1 stops itself (SIGSTOP) a few seconds into a long run; rank 0 then waits in a
  // collective until --comm-timeout.
  const Outcome o = run_train_job(
      dir, std::string("[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && (sleep 4; kill -STOP $$) & ") +
               "exec $CLI train --steps 1000000 --comm-timeout 3 --data text:$DIR/corpus.txt "
               "--out $DIR/out" + kTrainFlags);
  EXPECT_NE(o.status, 0) << o.output;
  EXPECT_NE(o.status, 124) << "the job hung:\n" << o.output;
  EXPECT_LT(o.seconds, 40) << o.output;
  EXPECT_NE(o.output.find("[rank 0/2] packmoe: mpi "), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("not complete after 3 s"), std::string::npos) << o.output;
  fs::remove_all(dir);
}

}  // namespace
