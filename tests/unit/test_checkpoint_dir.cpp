// Tests of io/checkpoint_dir: CRC-32C against its check value and a bit-at-a-time reference, the
// commit protocol (marker contents, keep-last-N, replacing a step, clean-up of temporary
// directories of dead writers), detection of damaged checkpoints by verify and latest, that every
// failure leaves the earlier checkpoints verifiable, and a trainer-style checkpoint (HF weights,
// optimizer state, JSON) read back bitwise. Files go to $PACKMOE_TEST_TMP.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/status_checks.h"
#include "common/test_files.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/state_file.h"
#include "train/model_config.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::read_raw;
using test::write_raw;
using Json = nlohmann::json;

// Bit at a time, straight from the definition (reflected polynomial 0x82F63B78).
uint32_t crc32c_bitwise(const std::vector<uint8_t>& bytes) {
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
  }
  return ~c;
}

// A pid that ran and exited (so no process has it until the kernel reuses it).
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

// A child that has exited but is not reaped (a zombie): kill(pid, 0) still succeeds for it.
// Reaped by reap() once the test is done with it.
pid_t zombie_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  for (int i = 0; i < 1000; ++i) {  // until the child has exited (state Z), at most ~1 s
    siginfo_t info{};
    if (::waitid(P_PID, child, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == child)
      break;
    ::usleep(1000);
  }
  return child;
}

void reap(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
}

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("checkpoint_dir_");
    root_ = (dir_ / "ckpt").string();
    seed_ = test::recorded_random_seed();
    rng_.seed(seed_);
  }
  void TearDown() override { test::remove_test_dir(dir_); }

  std::vector<uint8_t> random_bytes(size_t n) {
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(byte(rng_));
    return v;
  }

  // Commits a checkpoint of `step` with two random files; returns their contents by name.
  std::map<std::string, std::vector<uint8_t>> save(int64_t step, int keep_last = 3) {
    auto w = CheckpointWriter::begin(root_, step, keep_last);
    EXPECT_TRUE(w.is_ok()) << w.status().message();
    std::map<std::string, std::vector<uint8_t>> files = {
        {"model.safetensors", random_bytes(1000 + rng_() % 5000)},
        {"trainer_state.json", random_bytes(rng_() % 300)}};
    for (const auto& [name, bytes] : files) write_raw(w.value().path(name), bytes);
    auto c = w.value().commit();
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    if (c && !c.value().warnings.empty()) ADD_FAILURE() << c.value().warnings.front();
    return files;
  }

  fs::path step_dir(int64_t step) const { return fs::path(root_) / checkpoint_dir_name(step); }

  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(root_)) names.insert(e.path().filename().string());
    return names;
  }

  fs::path dir_;
  std::string root_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// ---- CRC-32C and names
// ----------------------------------------------------------------------------

TEST_F(CheckpointDirTest, Crc32cMatchesDefinition) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(check.data()), 9)),
            0xE3069283u);
  EXPECT_EQ(crc32c({}), 0u);
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<uint8_t> b = random_bytes(rng_() % 300);
    const uint32_t want = crc32c_bitwise(b);
    EXPECT_EQ(crc32c(b), want) << b.size();
    const size_t cut = b.empty() ? 0 : rng_() % (b.size() + 1);  // chained at any split
    const std::span<const uint8_t> s(b);
    EXPECT_EQ(crc32c(s.subspan(cut), crc32c(s.first(cut))), want) << cut;
  }
}

TEST_F(CheckpointDirTest, DirectoryNames) {
  EXPECT_EQ(checkpoint_dir_name(0), "step-00000000");
  EXPECT_EQ(checkpoint_dir_name(123), "step-00000123");
  EXPECT_EQ(checkpoint_dir_name(123456789012), "step-123456789012");
}

// ---- commit -------------------------------------------------------------------------------------

TEST_F(CheckpointDirTest, CommitWritesMarkerAndRenames) {
  auto w = CheckpointWriter::begin(root_, 123, 2);
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  const std::string tmp = w.value().dir();
  EXPECT_EQ(fs::path(tmp).filename().string(), ".tmp-step-00000123-" + std::to_string(::getpid()));
  EXPECT_TRUE(fs::is_directory(tmp));
  const std::vector<uint8_t> a = random_bytes(10000), b = random_bytes(7);
  write_raw(w.value().path("b.bin"), b);
  write_raw(w.value().path("a.safetensors"), a);
  write_raw(w.value().path("empty"), {});
  EXPECT_FALSE(latest_checkpoint(root_).value().found) << "uncommitted work is invisible";

  auto c = w.value().commit();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(c.value().info.dir, step_dir(123).string());
  EXPECT_EQ(c.value().info.step, 123);
  EXPECT_TRUE(c.value().removed.empty());
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000123"});

  const Json m = Json::parse(read_raw(step_dir(123) / kCheckpointMarker));
  EXPECT_EQ(m["format"], "packmoe-checkpoint");
  EXPECT_EQ(m["version"], 1);
  EXPECT_EQ(m["step"], 123);
  const auto hex = [](uint32_t v) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", v);
    return std::string(buf);
  };
  const Json want_files = Json::array(
      {{{"name", "a.safetensors"}, {"bytes", a.size()}, {"crc32c", hex(crc32c_bitwise(a))}},
       {{"name", "b.bin"}, {"bytes", b.size()}, {"crc32c", hex(crc32c_bitwise(b))}},
       {{"name", "empty"}, {"bytes", 0}, {"crc32c", "00000000"}}});
  EXPECT_EQ(m["files"], want_files);

  auto v = verify_checkpoint(step_dir(123).string());
  ASSERT_TRUE(v.is_ok()) << v.status().message();
  ASSERT_EQ(v.value().files.size(), 3u);
  EXPECT_EQ(v.value().files[0].name, "a.safetensors");
  EXPECT_EQ(v.value().files[0].bytes, a.size());
  EXPECT_EQ(v.value().files[0].crc32c, crc32c_bitwise(a));
  EXPECT_EQ(read_raw(step_dir(123) / "a.safetensors"), a);

  auto latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.is_ok());
  ASSERT_TRUE(latest.value().found);
  EXPECT_EQ(latest.value().found->step, 123);
  EXPECT_TRUE(latest.value().skipped.empty());
}

TEST_F(CheckpointDirTest, KeepsTheLastN) {
  for (int64_t step : {10, 20, 30, 40}) save(step, 2);
  EXPECT_EQ(listing(), (std::set<std::string>{"step-00000030", "step-00000040"}));
  auto w = CheckpointWriter::begin(root_, 50, 1);
  ASSERT_TRUE(w.is_ok());
  auto c = w.value().commit();  // an empty checkpoint is a valid one
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c.value().removed,
            (std::vector<std::string>{step_dir(40).string(), step_dir(30).string()}));
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000050"});
  EXPECT_EQ(latest_checkpoint(root_).value().found->step, 50);
}

// After resuming from an older step, commits never delete the newer checkpoints of the other run.
TEST_F(CheckpointDirTest, NewerCheckpointsAreNeverDeleted) {
  save(100, 1);
  save(60, 1);
  save(70, 1);
  EXPECT_EQ(listing(), (std::set<std::string>{"step-00000070", "step-00000100"}));
}

TEST_F(CheckpointDirTest, SameStepIsReplaced) {
  save(5);
  const auto second = save(5);
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000005"});
  auto v = verify_checkpoint(step_dir(5).string());
  ASSERT_TRUE(v.is_ok()) << v.status().message();
  for (const auto& [name, bytes] : second) EXPECT_EQ(read_raw(step_dir(5) / name), bytes);
}

TEST_F(CheckpointDirTest, TemporaryDirectoriesAreIgnoredAndCleaned) {
  save(1);
  // A writer that died mid-save, one that died while replacing, and a live one (this process).
  const std::string dead = ".tmp-step-00000002-" + std::to_string(dead_pid());
  const std::string dead_old = ".tmp-step-00000001-" + std::to_string(dead_pid()) + "-old";
  const std::string live = ".tmp-step-00000009-" + std::to_string(::getpid()) + "-other";
  for (const std::string& d : {dead, dead_old, live}) {
    fs::create_directories(fs::path(root_) / d);
    write_raw(fs::path(root_) / d / "model.safetensors", random_bytes(100));
  }
  auto latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.is_ok());
  EXPECT_EQ(latest.value().found->step, 1);
  EXPECT_TRUE(latest.value().skipped.empty());

  auto w = CheckpointWriter::begin(root_, 3, 3);
  ASSERT_TRUE(w.is_ok());
  auto c = w.value().commit();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(std::set<std::string>(c.value().removed.begin(), c.value().removed.end()),
            (std::set<std::string>{(fs::path(root_) / dead).string(),
                                   (fs::path(root_) / dead_old).string()}));
  EXPECT_EQ(listing(), (std::set<std::string>{"step-00000001", "step-00000003", live}));
}

TEST_F(CheckpointDirTest, TemporaryDirectoryOfAnUnreapedDeadWriterIsCleaned) {
  const pid_t zombie = zombie_pid();
  ASSERT_EQ(::kill(zombie, 0), 0) << "an unreaped child still answers kill(pid, 0)";
  const std::string dead = ".tmp-step-00000002-" + std::to_string(zombie);
  fs::create_directories(fs::path(root_) / dead);
  write_raw(fs::path(root_) / dead / "optimizer-00000-of-00002.bin", random_bytes(100));
  auto w = CheckpointWriter::begin(root_, 3, 3);
  ASSERT_TRUE(w.is_ok());
  auto c = w.value().commit();
  reap(zombie);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c.value().removed, std::vector<std::string>{(fs::path(root_) / dead).string()});
  EXPECT_EQ(listing(), (std::set<std::string>{"step-00000003"}));
}

TEST_F(CheckpointDirTest, AbandonedWriterLeavesNothing) {
  save(1);
  {
    auto w = CheckpointWriter::begin(root_, 2, 3);
    ASSERT_TRUE(w.is_ok());
    write_raw(w.value().path("model.safetensors"), random_bytes(100));
  }  // destroyed uncommitted
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000001"});
  auto w = CheckpointWriter::begin(root_, 2, 3);
  ASSERT_TRUE(w.is_ok());
  w.value().abort();
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000001"});
  // Moving a writer hands the directory over; only the new owner removes it.
  auto a = CheckpointWriter::begin(root_, 4, 3);
  ASSERT_TRUE(a.is_ok());
  CheckpointWriter b = std::move(a.value());
  write_raw(b.path("x"), random_bytes(5));
  ASSERT_TRUE(b.commit().is_ok());
  EXPECT_TRUE(verify_checkpoint(step_dir(4).string()).is_ok());
}

// ---- damage
// ---------------------------------------------------------------------------------------

TEST_F(CheckpointDirTest, DamageIsDetectedAndLatestFallsBack) {
  struct Damage {
    const char* what;
    std::function<void(const fs::path&)> apply;
    std::vector<std::string> message;
  };
  const std::vector<Damage> cases = {
      {"corrupted byte",
       [&](const fs::path& d) {
         auto b = read_raw(d / "model.safetensors");
         b[rng_() % b.size()] ^= static_cast<uint8_t>(1 + rng_() % 255);
         write_raw(d / "model.safetensors", b);
       },
       {"model.safetensors", "CRC-32C", "corrupted"}},
      {"truncated file",
       [&](const fs::path& d) {
         fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") - 1);
       },
       {"model.safetensors", "truncated"}},
      {"grown file",
       [&](const fs::path& d) {
         auto b = read_raw(d / "trainer_state.json");
         b.push_back(0);
         write_raw(d / "trainer_state.json", b);
       },
       {"trainer_state.json", "appended"}},
      {"missing file",
       [&](const fs::path& d) { fs::remove(d / "trainer_state.json"); },
       {"trainer_state.json", "missing"}},
      {"missing marker",
       [&](const fs::path& d) { fs::remove(d / kCheckpointMarker); },
       {"step-00000002", kCheckpointMarker}},
      {"garbled marker",
       [&](const fs::path& d) {
         write_raw(d / kCheckpointMarker, {'{', '"', 's'});
       },
       {kCheckpointMarker, "JSON"}},
      {"marker of another step",
       [&](const fs::path& d) {
         Json m = Json::parse(read_raw(d / kCheckpointMarker));
         m["step"] = 7;
         const std::string t = m.dump();
         write_raw(d / kCheckpointMarker, std::vector<uint8_t>(t.begin(), t.end()));
       },
       {"step-00000002", "step 7"}},
      {"unlisted file",
       [&](const fs::path& d) {
         write_raw(d / "extra.bin", {1, 2, 3});
       },
       {"extra.bin", "not listed"}},
  };
  for (const Damage& c : cases) {
    SCOPED_TRACE(c.what);
    fs::remove_all(root_);
    save(1);
    save(2);
    c.apply(step_dir(2));
    auto v = verify_checkpoint(step_dir(2).string());
    expect_error(v.status(), c.message);
    auto latest = latest_checkpoint(root_);
    ASSERT_TRUE(latest.is_ok()) << latest.status().message();
    ASSERT_TRUE(latest.value().found);
    EXPECT_EQ(latest.value().found->step, 1);
    ASSERT_EQ(latest.value().skipped.size(), 1u);
    EXPECT_EQ(latest.value().skipped[0], v.status().message());
    EXPECT_TRUE(verify_checkpoint(step_dir(1).string()).is_ok());
  }
}

TEST_F(CheckpointDirTest, LatestIgnoresOtherNamesAndEmptyRoots) {
  auto none = latest_checkpoint(root_);  // root does not exist yet
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none.value().found);
  fs::create_directories(root_);
  EXPECT_FALSE(latest_checkpoint(root_).value().found);
  save(3);
  fs::create_directories(fs::path(root_) / "step-9");  // not canonical
  fs::create_directories(fs::path(root_) / "step-0000000x");
  write_raw(fs::path(root_) / "step-00000009", {1});  // a file, not a directory
  auto latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.is_ok());
  EXPECT_EQ(latest.value().found->step, 3);
  EXPECT_TRUE(latest.value().skipped.empty());
  write_raw(dir_ / "plain_file", {1});
  expect_error(latest_checkpoint((dir_ / "plain_file").string()).status(), {"plain_file"});
}

// The way the trainer will use it: HF weights, optimizer tensors and a JSON document in one
// checkpoint, found again by latest_checkpoint and read back bitwise.
TEST_F(CheckpointDirTest, TrainerStyleRoundTrip) {
  auto config = train::model_config_preset("tiny");
  ASSERT_TRUE(config.is_ok());
  const ModelWeights masters = random_model_weights(config.value(), rng_());
  StateTensors moments;
  std::vector<StateTensorSpec> specs;
  for (const auto& [name, t] : masters) {
    for (const char* which : {"adamw.m/", "adamw.v/"}) {
      Tensor m = Tensor::empty(cpu_backend(), DType::kF32, t.shape());
      const std::vector<uint8_t> bytes = random_bytes(m.nbytes());
      std::memcpy(m.data(), bytes.data(), bytes.size());
      moments.emplace(which + name, m);
      specs.push_back({which + name, DType::kF32, t.shape()});
    }
  }
  const Json state = {{"step", 40}, {"rng", {{"seed", rng_()}}}, {"data", {{"position", 12345}}}};

  auto w = CheckpointWriter::begin(root_, 40, 2);
  ASSERT_TRUE(w.is_ok());
  ASSERT_TRUE(save_hf_weights(w.value().path(kHfWeightsFile), config.value(), masters, DType::kF32)
                  .is_ok());
  ASSERT_TRUE(write_state_tensors(w.value().path("optimizer.safetensors"), moments).is_ok());
  ASSERT_TRUE(write_json_file(w.value().path("trainer_state.json"), state).is_ok());
  ASSERT_TRUE(w.value().commit().is_ok());

  auto latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.is_ok() && latest.value().found);
  const fs::path dir = latest.value().found->dir;
  EXPECT_EQ(latest.value().found->files.size(), 3u);
  auto weights = load_hf_weights(dir.string(), config.value());
  ASSERT_TRUE(weights.is_ok()) << weights.status().message();
  for (const auto& [name, t] : masters) {
    EXPECT_EQ(std::memcmp(weights.value().at(name).data(), t.data(), t.nbytes()), 0) << name;
  }
  auto opt = read_state_tensors((dir / "optimizer.safetensors").string(), specs);
  ASSERT_TRUE(opt.is_ok()) << opt.status().message();
  for (const auto& [name, t] : moments) {
    EXPECT_EQ(std::memcmp(opt.value().at(name).data(), t.data(), t.nbytes()), 0) << name;
  }
  auto doc = read_json_file((dir / "trainer_state.json").string());
  ASSERT_TRUE(doc.is_ok());
  EXPECT_EQ(doc.value(), state);
}

// ---- failures keep the old checkpoints
// ------------------------------------------------------------

TEST_F(CheckpointDirTest, FailuresLeaveEarlierCheckpointsIntact) {
  const auto first = save(1);
  save(2);
  auto intact = [&] {
    for (int64_t s : {1, 2}) {
      auto v = verify_checkpoint(step_dir(s).string());
      EXPECT_TRUE(v.is_ok()) << v.status().message();
    }
    for (const auto& [name, bytes] : first) EXPECT_EQ(read_raw(step_dir(1) / name), bytes);
    for (const std::string& n : listing())
      EXPECT_NE(n.rfind(".tmp-", 0), 0u) << n << " left behind";
    EXPECT_EQ(latest_checkpoint(root_).value().found->step, 2);
  };

  expect_error(CheckpointWriter::begin(root_, 3, 0).status(), {"keep_last"});
  expect_error(CheckpointWriter::begin(root_, -1, 1).status(), {"-1"});
  write_raw(dir_ / "not_a_dir", {1});
  expect_error(CheckpointWriter::begin((dir_ / "not_a_dir").string(), 3, 1).status(),
               {"not_a_dir"});
  expect_error(CheckpointWriter::begin((dir_ / "not_a_dir" / "sub").string(), 3, 1).status(),
               {"not_a_dir"});

  {  // a subdirectory in the checkpoint
    auto w = CheckpointWriter::begin(root_, 3, 1);
    ASSERT_TRUE(w.is_ok());
    write_raw(w.value().path("model.safetensors"), random_bytes(10));
    fs::create_directories(w.value().path("sub"));
    expect_error(w.value().commit().status(), {"sub", "regular file"});
  }
  intact();
  {  // a symbolic link
    auto w = CheckpointWriter::begin(root_, 3, 1);
    ASSERT_TRUE(w.is_ok());
    fs::create_symlink(step_dir(1) / "model.safetensors", w.value().path("link"));
    expect_error(w.value().commit().status(), {"link", "regular file"});
  }
  intact();
  {  // the caller wrote the marker's name
    auto w = CheckpointWriter::begin(root_, 3, 1);
    ASSERT_TRUE(w.is_ok());
    write_raw(w.value().path(kCheckpointMarker), {'{', '}'});
    expect_error(w.value().commit().status(), {kCheckpointMarker, "reserved"});
  }
  intact();
  {  // the temporary directory vanished before the commit
    auto w = CheckpointWriter::begin(root_, 3, 1);
    ASSERT_TRUE(w.is_ok());
    fs::remove_all(w.value().dir());
    expect_error(w.value().commit().status(), {".tmp-step-00000003"});
  }
  intact();
  {  // a second writer of the same step in this process
    auto w = CheckpointWriter::begin(root_, 3, 1);
    ASSERT_TRUE(w.is_ok());
    expect_error(CheckpointWriter::begin(root_, 3, 1).status(), {".tmp-step-00000003"});
  }
  intact();
}

TEST_F(CheckpointDirTest, UnwritableRoot) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  save(1);
  fs::permissions(root_, fs::perms::owner_read | fs::perms::owner_exec);
  auto w = CheckpointWriter::begin(root_, 2, 1);
  fs::permissions(root_, fs::perms::owner_all);
  expect_error(w.status(), {".tmp-step-00000002", "cannot create"});
  EXPECT_EQ(listing(), std::set<std::string>{"step-00000001"});
  EXPECT_TRUE(verify_checkpoint(step_dir(1).string()).is_ok());
}

}  // namespace
}  // namespace packmoe::io
