// Trainer checkpoints across world sizes (docs/checkpoints.md "Data-parallel checkpoints"), shared
// by tests/dist/test_dist_checkpoint.cpp (Local / MPI, host memory) and
// test_nccl_dist_checkpoint.cpp (NCCL, one GPU per rank; 2 ranks at most).
// `--save DIR` (mpirun -np 2): per recipe (bf16, mxfp8, nvfp4) an uninterrupted 2-rank run of 4
// steps (its losses, grad norms and final optimizer shards are the reference, written
// by this test, not by the checkpoint code), and a 2-rank run that saves at step 2 through
// Trainer::save_checkpoint (read back: bitwise its own snapshot) and continues bitwise; rank 0
// also saves a single-process MXFP8 checkpoint. `--load DIR` (CTest: 1, 2 and 3 ranks) reads the
// checkpoint; right after the load every rank's state equals the checkpoint's masters and moments
// byte for byte (the re-split is exact); it continues to step 4 with the same rows per step and
// compares with the reference:
//   2 ranks (B = 3): bitwise everything, every recipe.
//   1 process, no data parallelism (B = 3, A = 2): the same sums (losses, masters, moments
//     bitwise; the grad norm within kSumOrderNorm: its FP64 all-reduce order, docs/dist.md).
//   3 ranks (B = 2): other partial sums of the same rows: the kRegroup bounds; against one
//     process with A = 3 continuing the same checkpoint: the same sums.
//   NVFP4 gradients are stochastically rounded from an offset keyed by the step and the
//   micro-batch's place in it (nvfp4_grad_sr_offset), not by the rank: with 1 process the same
//   sums; with 3 ranks other micro-batches, so other draws: the kSr bounds.
// The single-process checkpoint loads into 2 and 3 ranks (the same sums as one process with 2
// or 3 micro-batches continuing it). Bad checkpoints (a missing shard file, a corrupted
// shard, a shard plan of another model or shape, a shard of another save) give one error line on
// every rank and leave the trainer as it was; the ranks agree on the lowest failing rank's error.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/dist_main.h"
#include "io/checkpoint_dir.h"
#include "train/checkpoint.h"
#include "train/model_config.h"
#include "train/rank_agreement.h"
#include "train/trainer.h"

namespace packmoe::dist_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kSavedRanks = 2;
constexpr int64_t kSaveAt = 2, kSteps = 4;
constexpr int64_t kRowsPerStep = 6;  // 2 ranks x 3 rows = 3 ranks x 2 rows = 1 process x 2 x 3
constexpr const char* kEmbedding = "model.embed_tokens.weight";
// Bounds: absolute on masters and moments after step 4 (a tiny run at lr 1e-3), relative on
// losses and grad norms. The test prints the measured values; docs/checkpoints.md has a summary.
// 3 ranks of 2 rows vs 2 ranks of 3 rows: the same rows per step, other partial sums. Losses and
// grad norms stay close; an element whose gradient is near zero may flip the sign of its AdamW
// update, so masters are bounded by what two steps of updates can differ: 2 x 2 lr.
constexpr double kLr = 1e-3;
constexpr double kRegroupLoss = 5e-4, kRegroupNorm = 1e-2, kRegroupMaster = 4 * kLr,
                 kRegroupMoment = 1e-3;
// One process vs N ranks over the same micro-batches (docs/dist.md): every gradient reaches the
// buffer as one sum per micro-batch, so losses, masters and moments are bitwise; the grad norm is
// an all-reduce of per-rank FP64 sums of squares: within kSumOrderNorm relative.
constexpr double kSumOrderNorm = 1e-12;
// NVFP4 with another rank count: other stochastic-rounding draws (each rank draws its own).
constexpr double kSrLoss = 1e-3, kSrNorm = 1e-2, kSrMaster = 4 * kLr, kSrMoment = 5e-3;

std::string g_mode;  // "save" or "load"
fs::path g_dir;

const Recipe kRecipes[] = {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4};

train::TrainData corpus() {
  train::TrainData d;
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "row " + std::to_string(i * 7919 % 1013) + " of the packmoe checkpoint corpus\n";
  io::TokenDataset tokens;
  for (unsigned char c : text) tokens.tokens.push_back(c);
  d.train = train::single_source(std::move(tokens));
  return d;
}

// The tiny preset without the load-balancing loss: that loss is a product of per-micro-batch
// means, so 3 ranks of 2 rows would optimise another objective than 2 ranks of 3 rows; without
// it every token's loss and gradient is independent of how the rows are grouped.
ModelConfig tiny() {
  ModelConfig m = train::model_config_preset("tiny").value();
  m.router_aux_loss_coef = 0;
  return m;
}

train::TrainConfig config(Recipe recipe, uint64_t seed, int64_t rows, int64_t accum) {
  train::TrainConfig c;
  c.steps = kSteps;
  c.micro_batch_size = rows;
  c.seq_len = 16;
  c.grad_accum_steps = accum;
  c.lr = kLr;
  c.warmup_steps = 1;
  c.eval_interval = 0;
  c.grad_clip = 0;  // bitwise needs unclipped steps (docs/dist.md)
  c.seed = seed;
  c.precision.recipe.recipe = recipe;
  return c;
}

// A trainer over `comm()` when `data_parallel`, else a single process.
std::unique_ptr<train::Trainer> make(const train::TrainConfig& c, bool data_parallel) {
  train::TrainerParallelism parallel;
  if (data_parallel) parallel.comm = &comm();
  return train::Trainer::create(comm().backend(), tiny(), c, corpus(), nullptr, parallel).value();
}

struct History {
  std::vector<double> losses, grad_norms;
};

void train_steps(train::Trainer& t, int64_t steps, History* h) {
  for (int64_t i = 0; i < steps; ++i) {
    Result<train::StepResult> r = t.train_step();
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    h->losses.push_back(r.value().loss);
    h->grad_norms.push_back(r.value().grad_norm);
  }
}

// Masters and moments per parameter (params() order) of any trainer; collective over its ranks.
FullOptimizerState state_of(train::Trainer& t) { return t.optimizer().gather_state(); }

// ---- files of the save job
// ------------------------------------------------------------------------

fs::path root_of(Recipe r) { return g_dir / (std::string("ckpt_") + recipe_name(r)); }
fs::path reference_shard(Recipe r, int rank) {
  return g_dir /
         (std::string("reference_") + recipe_name(r) + "_rank" + std::to_string(rank) + ".bin");
}
fs::path reference_json(Recipe r) {
  return g_dir / (std::string("reference_") + recipe_name(r) + ".json");
}

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p << " is missing: run the save job (mpirun -np 2 ... --save) first";
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Doubles as their bits, so the JSON round trip is exact.
json bits(const std::vector<double>& v) {
  json a = json::array();
  for (double d : v) {
    uint64_t u;
    std::memcpy(&u, &d, 8);
    a.push_back(u);
  }
  return a;
}
std::vector<double> doubles(const json& a) {
  std::vector<double> v;
  for (const json& e : a) {
    const uint64_t u = e.get<uint64_t>();
    double d;
    std::memcpy(&d, &u, 8);
    v.push_back(d);
  }
  return v;
}

struct Reference {
  History history;
  std::vector<int64_t> consumed;  // the train sampler's counts at the end
  FullOptimizerState state;
};

Reference load_reference(Recipe r) {
  Reference ref;
  const json j = json::parse(read_bytes(reference_json(r)));
  ref.history.losses = doubles(j["losses"]);
  ref.history.grad_norms = doubles(j["grad_norms"]);
  ref.consumed = j["consumed"].get<std::vector<int64_t>>();
  std::vector<OptimizerShard> shards;
  for (int rank = 0; rank < kSavedRanks; ++rank)
    shards.push_back(decode_optimizer_shard(read_bytes(reference_shard(r, rank))).value());
  ref.state = assemble_optimizer_state(shards).value();
  return ref;
}

// ---- comparisons
// ----------------------------------------------------------------------------------

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

double rel_diff(double a, double b) { return std::fabs(a - b) / std::fabs(b); }

enum class Expect {
  kBitwise,        // everything
  kSameSums,       // bitwise but the grad norms (within kSumOrderNorm)
  kRegrouped,      // within the kRegroup bounds
  kOtherSrDraws,   // within the kSr bounds
};

const char* expect_name(Expect e) {
  switch (e) {
    case Expect::kBitwise:
      return "bitwise";
    case Expect::kSameSums:
      return "same sums";
    case Expect::kRegrouped:
      return "regrouped sums";
    case Expect::kOtherSrDraws:
      return "other SR draws";
  }
  return "?";
}

void compare(const std::string& what, const std::vector<std::string>& names, const History& got,
             const FullOptimizerState& got_state, const History& want,
             const FullOptimizerState& want_state, Expect e) {
  SCOPED_TRACE(what + " (" + expect_name(e) + ")");
  ASSERT_EQ(got.losses.size(), want.losses.size());
  double loss_diff = 0, norm_diff = 0;
  for (size_t s = 0; s < got.losses.size(); ++s) {
    loss_diff = std::max(loss_diff, rel_diff(got.losses[s], want.losses[s]));
    norm_diff = std::max(norm_diff, rel_diff(got.grad_norms[s], want.grad_norms[s]));
  }
  EXPECT_EQ(got_state.steps, want_state.steps);
  ASSERT_EQ(got_state.master.size(), names.size());
  double master_diff = 0, moment_diff = 0, embedding_diff = 0;
  bool other_bitwise = true;
  std::string differ;
  for (size_t p = 0; p < names.size(); ++p) {
    const double m = max_abs_diff(got_state.master[p], want_state.master[p]);
    const double v = std::max(max_abs_diff(got_state.exp_avg[p], want_state.exp_avg[p]),
                              max_abs_diff(got_state.exp_avg_sq[p], want_state.exp_avg_sq[p]));
    const bool same = got_state.master[p] == want_state.master[p] &&
                      got_state.exp_avg[p] == want_state.exp_avg[p] &&
                      got_state.exp_avg_sq[p] == want_state.exp_avg_sq[p];
    if (names[p] == kEmbedding) {
      embedding_diff = std::max(m, v);
    } else {
      other_bitwise = other_bitwise && same;
      if (!same) differ += " " + names[p];
    }
    if (e == Expect::kBitwise || e == Expect::kSameSums) {
      EXPECT_TRUE(same) << names[p];
    }
    master_diff = std::max(master_diff, m);
    moment_diff = std::max(moment_diff, v);
  }
  switch (e) {
    case Expect::kBitwise:
      EXPECT_EQ(got.losses, want.losses);
      EXPECT_EQ(got.grad_norms, want.grad_norms);
      break;
    case Expect::kSameSums:
      EXPECT_EQ(got.losses, want.losses);
      EXPECT_LE(norm_diff, kSumOrderNorm);
      break;
    case Expect::kRegrouped:
      EXPECT_LE(loss_diff, kRegroupLoss);
      EXPECT_LE(norm_diff, kRegroupNorm);
      EXPECT_LE(master_diff, kRegroupMaster);
      EXPECT_LE(moment_diff, kRegroupMoment);
      break;
    case Expect::kOtherSrDraws:
      EXPECT_LE(loss_diff, kSrLoss);
      EXPECT_LE(norm_diff, kSrNorm);
      EXPECT_LE(master_diff, kSrMaster);
      EXPECT_LE(moment_diff, kSrMoment);
      break;
  }
  if (comm().rank() == 0)
    std::printf(
        "[dist ckpt] %-40s %-20s loss %.2e  grad norm %.2e  masters %.2e  moments %.2e  "
        "embedding %.2e  others bitwise: %s\n",
        what.c_str(), expect_name(e), loss_diff, norm_diff, master_diff, moment_diff,
        embedding_diff, other_bitwise ? "yes" : ("no:" + differ).c_str());
}

std::vector<std::string> param_names(const train::Trainer& t) {
  std::vector<std::string> names;
  for (const NamedParam& p : t.model().params()) names.push_back(p.name);
  return names;
}

bool same_bytes(const Tensor& t, const std::vector<float>& v) {
  return t.nbytes() == v.size() * sizeof(float) && std::memcmp(t.data(), v.data(), t.nbytes()) == 0;
}

// Right after a load the trainer holds exactly the checkpoint's masters and moments (every rank
// its part, re-split by this job's plan). Collective with data parallelism.
void expect_loaded_exactly(train::Trainer& t, const train::TrainerCheckpoint& c) {
  const FullOptimizerState s = state_of(t);
  EXPECT_EQ(s.steps, c.optimizer_steps);
  const std::vector<std::string> names = param_names(t);
  ASSERT_EQ(s.master.size(), names.size());
  for (size_t p = 0; p < names.size(); ++p) {
    EXPECT_TRUE(same_bytes(c.masters.at(names[p]), s.master[p])) << names[p];
    EXPECT_TRUE(same_bytes(c.moments.at(train::exp_avg_name(names[p])), s.exp_avg[p])) << names[p];
    EXPECT_TRUE(same_bytes(c.moments.at(train::exp_avg_sq_name(names[p])), s.exp_avg_sq[p]))
        << names[p];
  }
}

// ---- the save job
// ---------------------------------------------------------------------------------

TEST(DistCheckpoint, SaveWithTwoRanks) {
  if (g_mode != "save") GTEST_SKIP() << "load job";
  ASSERT_EQ(comm().size(), kSavedRanks) << "the save job runs with mpirun -np 2";
  fs::create_directories(g_dir);
  if (comm().rank() == 0) std::ofstream(g_dir / "seed") << g_seed;
  const uint64_t seed = g_seed % 1000003;
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(recipe_name(recipe));
    const train::TrainConfig c = config(recipe, seed, kRowsPerStep / kSavedRanks, 1);
    // The reference: 4 steps uninterrupted; its final shards written here, not by the trainer.
    auto straight = make(c, true);
    History reference;
    train_steps(*straight, kSteps, &reference);
    write_bytes(reference_shard(recipe, comm().rank()),
                encode_optimizer_shard(straight->optimizer().shard_state()));
    if (comm().rank() == 0) {
      json j;
      j["losses"] = bits(reference.losses);
      j["grad_norms"] = bits(reference.grad_norms);
      j["consumed"] = straight->train_sampler().state().consumed;
      std::ofstream(reference_json(recipe)) << j.dump();
    }

    // The run that saves at step 2, then continues: saving changes nothing.
    auto saving = make(c, true);
    History resumed;
    train_steps(*saving, kSaveAt, &resumed);
    Result<io::CheckpointWriter::Committed> saved =
        saving->save_checkpoint(root_of(recipe).string(), 1, /*save_primary=*/true);
    ASSERT_TRUE(saved.is_ok()) << saved.status().message();
    comm().barrier();
    const train::TrainerCheckpoint snap = saving->snapshot();
    Result<train::TrainerCheckpoint> read = train::read_trainer_checkpoint(saved.value().info.dir);
    ASSERT_TRUE(read.is_ok()) << read.status().message();
    const train::TrainerCheckpoint& back = read.value();
    EXPECT_EQ(back.world_size, kSavedRanks);
    ASSERT_TRUE(back.shard_plan.has_value());
    EXPECT_EQ(back.shard_plan->params, saving->optimizer().plan().geometries());
    EXPECT_EQ(back.optimizer_steps, kSaveAt);
    EXPECT_EQ(back.sampler.consumed, snap.sampler.consumed);
    for (const auto& [name, t] : snap.masters)
      EXPECT_EQ(std::memcmp(t.data(), back.masters.at(name).data(), t.nbytes()), 0) << name;
    for (const auto& [name, t] : snap.moments)
      EXPECT_EQ(std::memcmp(t.data(), back.moments.at(name).data(), t.nbytes()), 0) << name;
    train_steps(*saving, kSteps - kSaveAt, &resumed);
    EXPECT_EQ(resumed.losses, reference.losses);
    EXPECT_EQ(resumed.grad_norms, reference.grad_norms);
  }
}

// ---- the load jobs
// --------------------------------------------------------------------------------

uint64_t saved_seed() {
  uint64_t seed = 0;
  std::ifstream(g_dir / "seed") >> seed;
  EXPECT_NE(seed, 0u) << "no seed file in " << g_dir;
  return seed % 1000003;
}

std::string checkpoint_dir(Recipe r) {
  return (root_of(r) / io::checkpoint_dir_name(kSaveAt)).string();
}

TEST(DistCheckpoint, LoadWithAnyRankCountAndContinue) {
  if (g_mode != "load") GTEST_SKIP() << "save job";
  const int world = comm().size();
  const uint64_t seed = saved_seed();
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(std::string(recipe_name(recipe)) + ", saved by 2 ranks, loaded by " +
                 std::to_string(world));
    const Reference ref = load_reference(recipe);
    History want;
    want.losses.assign(ref.history.losses.begin() + kSaveAt, ref.history.losses.end());
    want.grad_norms.assign(ref.history.grad_norms.begin() + kSaveAt, ref.history.grad_norms.end());
    Result<train::TrainerCheckpoint> c = train::read_trainer_checkpoint(checkpoint_dir(recipe));
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    const bool nvfp4 = recipe == Recipe::kNvfp4;

    // This job's world size, the same rows per step.
    const bool dp = world > 1;
    const train::TrainConfig mine = config(
        recipe, seed, dp ? kRowsPerStep / world : kRowsPerStep / kSavedRanks, dp ? 1 : kSavedRanks);
    std::unique_ptr<train::Trainer> t;
    {
      train::TrainerParallelism parallel;
      if (dp) parallel.comm = &comm();
      Result<std::unique_ptr<train::Trainer>> r =
          train::Trainer::resume(comm().backend(), c.value(), mine, corpus(), parallel);
      ASSERT_TRUE(r.is_ok()) << r.status().message();
      t = std::move(r.value());
    }
    EXPECT_EQ(t->step(), kSaveAt);
    expect_loaded_exactly(*t, c.value());
    History got;
    train_steps(*t, kSteps - kSaveAt, &got);
    const FullOptimizerState got_state = state_of(*t);
    EXPECT_EQ(t->train_sampler().state().consumed, ref.consumed);
    const Expect e = world == kSavedRanks ? Expect::kBitwise
                     : world == 1         ? Expect::kSameSums
                     : nvfp4              ? Expect::kOtherSrDraws
                                          : Expect::kRegrouped;
    compare(std::string(recipe_name(recipe)) + " 2 -> " + std::to_string(world) + " vs 2 ranks",
            param_names(*t), got, got_state, want, ref.state, e);

    // The re-split state is exact: N ranks == one process with N micro-batches per step, both
    // continuing the same checkpoint (NVFP4 too: micro-batch r of the one process draws what
    // rank r draws).
    if (world > 1) {
      auto one = train::Trainer::resume(comm().backend(), c.value(),
                                        config(recipe, seed, kRowsPerStep / world, world), corpus())
                     .value();
      History one_history;
      train_steps(*one, kSteps - kSaveAt, &one_history);
      compare(std::string(recipe_name(recipe)) + " 2 -> " + std::to_string(world) +
                  " vs 1 process, A = " + std::to_string(world),
              param_names(*t), got, got_state, one_history, state_of(*one), Expect::kSameSums);
    }
  }
}

// A single-process checkpoint (written by rank 0 of the save job, no data parallelism) loads into
// N ranks exactly, and they continue as one process with N micro-batches per step continuing it
// does (the same sums), MXFP8 (32-row shard units).
fs::path single_process_root() { return g_dir / "ckpt_one_process"; }

TEST(DistCheckpoint, SaveWithOneProcess) {
  if (g_mode != "save") GTEST_SKIP() << "load job";
  if (comm().rank() == 0) {
    auto t = make(config(Recipe::kMxfp8, g_seed % 1000003, 2, 1), false);
    History h;
    train_steps(*t, kSaveAt, &h);
    Result<io::CheckpointWriter::Committed> saved =
        t->save_checkpoint(single_process_root().string(), 1);
    ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  }
  comm().barrier();
}

TEST(DistCheckpoint, OneProcessCheckpointLoadsIntoAnyRankCount) {
  if (g_mode != "load") GTEST_SKIP() << "save job";
  const int world = comm().size();
  if (world == 1) GTEST_SKIP() << "one process into one process: tests/e2e/test_checkpoint_e2e";
  const uint64_t seed = saved_seed();
  Result<train::TrainerCheckpoint> c = train::read_trainer_checkpoint(
      (single_process_root() / io::checkpoint_dir_name(kSaveAt)).string());
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c.value().world_size, 1);
  EXPECT_FALSE(c.value().shard_plan.has_value());
  auto t = train::Trainer::resume(comm().backend(), c.value(), config(Recipe::kMxfp8, seed, 2, 1),
                                  corpus(), {&comm()})
               .value();
  expect_loaded_exactly(*t, c.value());
  History got;
  train_steps(*t, kSteps - kSaveAt, &got);
  auto one = train::Trainer::resume(comm().backend(), c.value(),
                                    config(Recipe::kMxfp8, seed, 2, world), corpus())
                 .value();
  History want;
  train_steps(*one, kSteps - kSaveAt, &want);
  compare("mxfp8 1 -> " + std::to_string(world) + " vs 1 process, A = " + std::to_string(world),
          param_names(*t), got, state_of(*t), want, state_of(*one), Expect::kSameSums);
}

// The agreement every collective save and load relies on: one status for all ranks, the lowest
// failing rank's message.
TEST(DistCheckpoint, RanksAgreeOnTheLowestFailingRanksError) {
  if (g_mode != "load") GTEST_SKIP() << "save job";
  const int world = comm().size(), rank = comm().rank();
  EXPECT_TRUE(train::agree_on_status(comm(), Status::ok()).is_ok());
  for (int first = 0; first < world; ++first) {
    // Ranks >= first fail, each with its own message.
    const Status mine =
        rank >= first ? Status::error("disk " + std::to_string(rank) + " full") : Status::ok();
    const Status all = train::agree_on_status(comm(), mine);
    ASSERT_FALSE(all.is_ok());
    EXPECT_EQ(all.message(), (first == 0 ? std::string() : "rank " + std::to_string(first) + ": ") +
                                 "disk " + std::to_string(first) + " full");
  }
  const std::string from_last = train::broadcast_string(
      comm(), rank == world - 1 ? "tmp dir of the last rank" : "", world - 1);
  EXPECT_EQ(from_last, "tmp dir of the last rank");
}

// Copies the bf16 checkpoint (rank 0), damages the copy, and expects every rank's in-place load
// to fail with `needle` in one line and to leave its trainer as it was.
TEST(DistCheckpoint, BadCheckpointsGiveOneErrorOnEveryRankAndChangeNothing) {
  if (g_mode != "load") GTEST_SKIP() << "save job";
  const uint64_t seed = saved_seed();
  const std::string good = checkpoint_dir(Recipe::kBF16);
  const std::string shard1 = train::optimizer_shard_file(1, kSavedRanks);
  struct Case {
    std::string name, needle;
    std::function<void(const fs::path&)> damage;  // of the copy
    bool recommit;                                // a consistent marker over the damage
  };
  const std::vector<Case> cases = {
      {"missing shard file", shard1 + ": missing",
       [&](const fs::path& d) { fs::remove(d / shard1); }, false},
      {"missing shard file, marker recommitted", shard1 + ": missing (an optimizer shard",
       [&](const fs::path& d) { fs::remove(d / shard1); }, true},
      {"corrupted shard", shard1 + ": CRC-32C",
       [&](const fs::path& d) {
         std::vector<uint8_t> b = read_bytes(d / shard1);
         b[b.size() - 5] ^= 0x04;  // a bit of the last moment
         write_bytes(d / shard1, b);
       },
       false},
      {"shard plan of another model", "a plan of another model",
       [&](const fs::path& d) {
         std::ifstream in(d / train::kTrainerStateFile);
         json j = json::parse(in);
         j["shard_plan"]["params"][1]["name"] = "model.layers.0.mlp.gate.weight";
         std::ofstream(d / train::kTrainerStateFile, std::ios::trunc) << j.dump(2);
       },
       true},
      {"shard plan of another shape", "does not hold model.layers.0.self_attn.q_proj.weight",
       [&](const fs::path& d) {
         std::ifstream in(d / train::kTrainerStateFile);
         json j = json::parse(in);
         j["shard_plan"]["params"][2]["rows"] =
             2 * j["shard_plan"]["params"][2]["rows"].get<int64_t>();
         std::ofstream(d / train::kTrainerStateFile, std::ios::trunc) << j.dump(2);
       },
       true},
      {"shard of another save", "differs from model.safetensors",
       [&](const fs::path& d) {
         // Rank 0's shard with one master element changed, renamed consistently.
         std::vector<uint8_t> b = read_bytes(d / train::optimizer_shard_file(0, kSavedRanks));
         OptimizerShard s = decode_optimizer_shard(b).value();
         s.master[s.master.size() / 2] += 1.0f;
         write_bytes(d / train::optimizer_shard_file(0, kSavedRanks), encode_optimizer_shard(s));
       },
       true},
  };
  auto t = make(config(Recipe::kBF16, seed, kRowsPerStep / std::max(comm().size(), 1), 1),
                comm().size() > 1);
  History before;
  train_steps(*t, 1, &before);
  const FullOptimizerState state_before = state_of(*t);
  int index = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const fs::path copy =
        g_dir / ("bad_" + std::to_string(index++) + "_np" + std::to_string(comm().size()));
    const fs::path dir = copy / io::checkpoint_dir_name(kSaveAt);
    if (comm().rank() == 0) {
      fs::remove_all(copy);
      fs::create_directories(copy);
      if (k.recommit) {
        io::CheckpointWriter w = io::CheckpointWriter::begin(copy.string(), kSaveAt, 1).value();
        const io::CheckpointInfo info = io::verify_checkpoint(good).value();
        for (const io::CheckpointFile& f : info.files)
          fs::copy_file(fs::path(good) / f.name, fs::path(w.dir()) / f.name);
        k.damage(fs::path(w.dir()));
        ASSERT_TRUE(w.commit().is_ok());
      } else {
        fs::copy(good, dir, fs::copy_options::recursive);
        k.damage(dir);
      }
    }
    comm().barrier();
    const Status s = t->load_checkpoint(dir.string());
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find(k.needle), std::string::npos) << s.message();
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
    if (comm().rank() == 0)
      std::printf("[dist ckpt] %s: %s\n", k.name.c_str(), s.message().c_str());
    EXPECT_EQ(t->step(), 1);
    const FullOptimizerState after = state_of(*t);
    EXPECT_TRUE(after.master == state_before.master && after.exp_avg == state_before.exp_avg &&
                after.exp_avg_sq == state_before.exp_avg_sq);
  }
}

}  // namespace
}  // namespace packmoe::dist_test

namespace packmoe::dist_test {

// The binaries' main after their own checks: --save DIR or --load DIR (after gtest's flags),
// then every test on every rank over the communicator of `device`. missing_save_skips: a --load
// without a save in DIR (its save job was skipped, e.g. too few GPUs) exits 77 instead of failing.
inline int run_checkpoint_tests(int argc, char** argv, Device device, bool missing_save_skips) {
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--save" || a == "--load") {
      g_mode = a.substr(2);
      g_dir = argv[i + 1];
    }
  }
  if (g_mode.empty()) {
    std::fprintf(stderr, "usage: %s (--save | --load) DIR [gtest flags]\n", argv[0]);
    return 2;
  }
  if (missing_save_skips && g_mode == "load" && !fs::exists(g_dir / "seed")) {
    std::printf("skipped: no saved checkpoints in %s (the save job did not run)\n",
                g_dir.c_str());
    return 77;
  }
  return run_all(argc, argv, device);
}

}  // namespace packmoe::dist_test
