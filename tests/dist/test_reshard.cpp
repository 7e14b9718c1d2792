// Re-sharding the optimizer state: `--save DIR` (mpirun -np 2) trains two steps and writes one
// shard file per rank; `--load DIR` (any rank count: CTest runs 3 and 1) assembles the files, loads
// the state into a block built from another init, trains two more steps and must equal the
// reference (one process, two micro-batches per step, then a fresh process continuing from its
// masters and moments with N micro-batches per step): bitwise masters, primaries and outputs,
// the grad norm within 1e-12 relative. Every recipe and gather mode.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/dist_optimizer_harness.h"

namespace packmoe::dist_checks {
namespace {

constexpr int kSavedRanks = 2;
constexpr int kStepsBefore = 2, kStepsAfter = 2;
std::string g_mode;  // "save" or "load"
std::filesystem::path g_dir;

std::filesystem::path shard_file(const Case& c, GatherMode m, int rank) {
  return g_dir / (std::string(c.name) + "_" + std::string(gather_mode_name(m)) + "_rank" +
                  std::to_string(rank) + "_of_" + std::to_string(kSavedRanks) + ".bin");
}

std::vector<uint8_t> read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p << " is missing: run the save job (mpirun -np 2 ... --save) first";
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Reshard, SaveWithTwoRanks) {
  if (g_mode != "save") GTEST_SKIP() << "load job";
  ASSERT_EQ(comm().size(), kSavedRanks) << "the save job runs with mpirun -np 2";
  std::filesystem::create_directories(g_dir);
  if (comm().rank() == 0) std::ofstream(g_dir / "seed") << g_seed;
  for (const Case& c : kCases)
    for (GatherMode mode : kModes) {
      DistRun run(c, make_init(g_seed), mode);
      for (int s = 0; s < kStepsBefore; ++s) ASSERT_TRUE(run.train_step(g_seed, s, 0.0).r.applied);
      const std::vector<uint8_t> bytes = encode_optimizer_shard(run.opt().shard_state());
      std::ofstream(shard_file(c, mode, comm().rank()), std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()),
                 static_cast<std::streamsize>(bytes.size()));
      run.opt().prepare_forward();
    }
}

TEST(Reshard, LoadWithAnyRankCountAndContinue) {
  if (g_mode != "load") GTEST_SKIP() << "save job";
  uint64_t seed = 0;
  std::ifstream(g_dir / "seed") >> seed;
  ASSERT_NE(seed, 0u) << "no seed file in " << g_dir;
  for (const Case& c : kCases)
    for (GatherMode mode : kModes) {
      SCOPED_TRACE(label(c, mode) + ", saved by 2 ranks, loaded by " +
                   std::to_string(comm().size()));
      std::vector<OptimizerShard> shards;
      for (int r = 0; r < kSavedRanks; ++r) {
        Result<OptimizerShard> s = decode_optimizer_shard(read_file(shard_file(c, mode, r)));
        ASSERT_TRUE(s.is_ok()) << s.status().message();
        shards.push_back(std::move(s).value());
      }
      Result<FullOptimizerState> full = assemble_optimizer_state(shards);
      ASSERT_TRUE(full.is_ok()) << full.status().message();

      // The reference: two steps of two micro-batches, then fresh blocks (as the loading job's
      // are) continue from its masters and moments with comm().size() micro-batches per step.
      Reference before(comm().backend(), c, make_init(seed), kSavedRanks);
      for (int s = 0; s < kStepsBefore; ++s) before.step(seed, s, 0.0);
      for (int p = 0; p < 3; ++p)
        EXPECT_TRUE(full.value().master[p] == before.master(p)) << "saved master " << p;
      Reference after(comm().backend(), c, before.masters_as_init(), comm().size());
      after.take_optimizer_state(before);

      DistRun run(c, make_init(seed + 77), mode);  // another init: the load replaces it
      ASSERT_TRUE(run.opt().load_state(full.value()).is_ok());
      for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) {
        SCOPED_TRACE("step " + std::to_string(s));
        const RefStep rs = after.step(seed, s, 0.0);
        const DistStep ds = run.train_step(seed, s, 0.0);
        EXPECT_TRUE(ds.y == rs.y[comm().rank()]);
        EXPECT_LE(std::fabs(ds.r.grad_norm - rs.norm) / rs.norm, 1e-12);
        compare_shard(
            run.opt(), run.opt().master_shard(), [&](int p) { return after.master(p); }, true,
            "master");
        run.opt().prepare_forward();
        EXPECT_TRUE(primaries(run.block()) == primaries(after.block()));
      }
      EXPECT_EQ(run.opt().steps(), kStepsBefore + kStepsAfter);
    }
}

}  // namespace
}  // namespace packmoe::dist_checks

// After gtest's flags: --save DIR or --load DIR.
int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--save" || a == "--load") {
      packmoe::dist_checks::g_mode = a.substr(2);
      packmoe::dist_checks::g_dir = argv[i + 1];
    }
  }
  if (packmoe::dist_checks::g_mode.empty()) {
    std::fprintf(stderr, "usage: dist_test_reshard (--save | --load) DIR [gtest flags]\n");
    return 2;
  }
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
