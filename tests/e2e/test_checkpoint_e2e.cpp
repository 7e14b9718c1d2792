// Checkpoint resume of the tiny preset on the CPU, compared by bytes with the uninterrupted run:
// save at step s, load, continue to n gives the same losses, grad norms, masters, moments, data
// position and SR offsets in every recipe (NVFP4 needs its SR offsets: a resume without them
// differs), in the other layout, and through the in-place Trainer::load_checkpoint; a BF16
// checkpoint starts an MXFP8 / NVFP4 run with the saved masters; damaged and mismatched
// checkpoints give one clear error and leave the trainer exactly as it was; --save-primary's
// file holds the bytes the run computes with. Files go to $PACKMOE_TEST_TMP.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "common/trainer_trace.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/quantized_checkpoint.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;
using namespace testing;

const Recipe kRecipes[] = {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4};
constexpr int64_t kSaveAt = 2, kSteps = 4;  // save at step s = 2, continue to n = 4

class CheckpointE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    PACKMOE_SKIP_WITHOUT_CORPUS();
    const char* env = std::getenv("PACKMOE_TEST_TMP");
    const fs::path base = env && *env ? fs::path(env) : fs::temp_directory_path();
    dir_ = base / ("checkpoint_e2e_" +
                   std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
                   "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string root(const std::string& name) const { return (dir_ / name).string(); }

  // Trains `config` for kSaveAt steps and saves; returns the checkpoint directory and the trace
  // up to the save.
  std::string save_after_steps(const TrainConfig& config, const std::string& name, Trace* trace,
                               bool save_primary = false) {
    std::unique_ptr<Trainer> t = make_trainer(config);
    train(*t, kSaveAt, trace);
    Result<io::CheckpointWriter::Committed> saved =
        t->save_checkpoint(root(name), /*keep_last=*/1, save_primary);
    PACKMOE_CHECK(saved.is_ok(), saved.status().message());
    return saved.value().info.dir;
  }

  // A trainer under `config` that continues the checkpoint in `dir`.
  static std::unique_ptr<Trainer> resume(const std::string& dir, const TrainConfig& config) {
    Result<TrainerCheckpoint> c = read_trainer_checkpoint(dir);
    PACKMOE_CHECK(c.is_ok(), c.status().message());
    Result<std::unique_ptr<Trainer>> t =
        Trainer::resume(cpu_backend(), c.value(), config, TrainData(corpus()));
    PACKMOE_CHECK(t.is_ok(), t.status().message());
    return std::move(t.value());
  }

  fs::path dir_;
};

TrainConfig resume_run(Recipe recipe, Layout layout) {
  TrainConfig c = small_run(recipe, layout);
  c.steps = kSteps;
  c.micro_batch_size = 2;
  return c;
}

TEST_F(CheckpointE2E, SaveLoadContinueIsBitwiseTheUninterruptedRunInEveryRecipe) {
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(recipe_name(recipe));
    const TrainConfig c = resume_run(recipe, Layout::kSingle);
    const Trace straight = run(c, kSteps);
    Trace resumed;
    const std::string dir =
        save_after_steps(c, std::string("every_") + recipe_name(recipe), &resumed);
    std::unique_ptr<Trainer> t = resume(dir, c);
    EXPECT_EQ(t->step(), kSaveAt);
    train(*t, kSteps - kSaveAt, &resumed);
    expect_bitwise_equal(straight, resumed);
  }
}

TEST_F(CheckpointE2E, HighPrecisionPrimaryAndGradAccumulationResumeBitwise) {
  TrainConfig c = resume_run(Recipe::kNvfp4, Layout::kSingle);
  c.precision.primary = PrimaryWeight::kHighPrecision;
  c.grad_accum_steps = 2;
  const Trace straight = run(c, kSteps);
  Trace resumed;
  const std::string dir = save_after_steps(c, "high", &resumed);
  train(*resume(dir, c), kSteps - kSaveAt, &resumed);
  expect_bitwise_equal(straight, resumed);
}

TEST_F(CheckpointE2E, EitherLayoutLoadsTheOthersCheckpointBitwise) {
  for (Recipe recipe : {Recipe::kMxfp8, Recipe::kNvfp4}) {
    SCOPED_TRACE(recipe_name(recipe));
    const TrainConfig single = resume_run(recipe, Layout::kSingle);
    const TrainConfig discrete = resume_run(recipe, Layout::kDiscrete);
    const Trace straight = run(single, kSteps);
    for (const auto& [from, to] : {std::pair(single, discrete), std::pair(discrete, single)}) {
      SCOPED_TRACE(std::string("save ") + layout_name(from.precision.layout) + ", load " +
                   layout_name(to.precision.layout));
      Trace resumed;
      const std::string dir = save_after_steps(
          from, std::string("layout_") + recipe_name(recipe) + layout_name(from.precision.layout),
          &resumed);
      std::unique_ptr<Trainer> t = resume(dir, to);
      EXPECT_EQ(t->model().precision().layout, to.precision.layout);
      train(*t, kSteps - kSaveAt, &resumed);
      expect_bitwise_equal(straight, resumed);
    }
  }
}

TEST_F(CheckpointE2E, InPlaceLoadCheckpointContinuesBitwise) {
  const TrainConfig c = resume_run(Recipe::kNvfp4, Layout::kSingle);
  const Trace straight = run(c, kSteps);
  Trace resumed;
  const std::string dir = save_after_steps(c, "in_place", &resumed);
  // Another trainer of the same config, a step further along: load_checkpoint replaces it all.
  std::unique_ptr<Trainer> t = make_trainer(c);
  Trace ignored;
  train(*t, 3, &ignored);
  ASSERT_TRUE(t->load_checkpoint(dir).is_ok());
  EXPECT_EQ(t->step(), kSaveAt);
  train(*t, kSteps - kSaveAt, &resumed);
  expect_bitwise_equal(straight, resumed);
}

TEST_F(CheckpointE2E, Bf16CheckpointStartsQuantizedRunsWithTheSavedMasters) {
  Trace before;
  const std::string dir =
      save_after_steps(resume_run(Recipe::kBF16, Layout::kSingle), "bf16", &before);
  const ModelWeights saved = io::load_hf_weights(dir, tiny()).value();
  for (Recipe recipe : {Recipe::kMxfp8, Recipe::kNvfp4}) {
    SCOPED_TRACE(recipe_name(recipe));
    std::unique_ptr<Trainer> t = resume(dir, resume_run(recipe, Layout::kDiscrete));
    EXPECT_EQ(t->model().precision().recipe.recipe, recipe);
    Trace loaded;
    capture_state(*t, &loaded);
    // Masters: the saved bytes (from the file and from the run that wrote it), not dequantized.
    for (const auto& [name, tensor] : t->snapshot().masters)
      EXPECT_EQ(bytes_of(tensor), bytes_of(saved.at(name))) << name;
    EXPECT_EQ(loaded.masters, before.masters);
    EXPECT_EQ(loaded.exp_avg, before.exp_avg);  // the moments carry over too
    EXPECT_EQ(loaded.exp_avg_sq, before.exp_avg_sq);
    EXPECT_EQ(loaded.optimizer_steps, kSaveAt);
    Trace after;
    train(*t, 1, &after);
    EXPECT_TRUE(std::isfinite(after.losses.front()) && std::isfinite(after.grad_norms.front()));
  }
}

// ---- damaged and mismatched checkpoints ---------------------------------------------------------

std::vector<uint8_t> read_raw(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void write_raw(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A copy of checkpoint `src` as ROOT/step-..., committed through CheckpointWriter after `edit`
// changed its files: a consistent marker (sizes, CRCs) over inconsistent contents.
std::string recommit(const std::string& src, const std::string& root,
                     const std::function<void(const fs::path&)>& edit) {
  const io::CheckpointInfo info = io::verify_checkpoint(src).value();
  io::CheckpointWriter w = io::CheckpointWriter::begin(root, info.step, 1).value();
  for (const io::CheckpointFile& f : info.files)
    fs::copy_file(fs::path(src) / f.name, fs::path(w.dir()) / f.name);
  edit(fs::path(w.dir()));
  return w.commit().value().info.dir;
}

// A copy of checkpoint `src` under `root` with one file changed behind the marker's back.
std::string damaged_copy(const std::string& src, const std::string& root,
                         const std::function<void(const fs::path&)>& damage) {
  const fs::path dst = fs::path(root) / fs::path(src).filename();
  fs::create_directories(root);
  fs::copy(src, dst, fs::copy_options::recursive);
  damage(dst);
  return dst.string();
}

// A JSON file rewritten with `f` applied to its document.
void set_json(const fs::path& file, const std::function<void(nlohmann::json&)>& f) {
  std::ifstream in(file);
  nlohmann::json j = nlohmann::json::parse(in);
  f(j);
  std::ofstream(file, std::ios::trunc) << j.dump(2);
}

// model.safetensors rewritten with `change` applied to its tensor list (name -> keep / replace).
void rewrite_weights(
    const fs::path& dir,
    const std::function<bool(io::SafetensorsWriter&, const io::SafetensorsEntry&)>& change) {
  const fs::path path = dir / io::kHfWeightsFile;
  io::SafetensorsFile file = io::SafetensorsFile::read(path.string()).value();
  io::SafetensorsWriter out;
  out.set_metadata("format", "pt");
  for (const io::SafetensorsEntry& e : file.entries())
    if (!change(out, e)) out.add(e.name, e.dtype, e.shape, e.bytes);
  ASSERT_TRUE(out.write(path.string()).is_ok());
}

// A version-1 trainer state (it also held per-linear NVFP4 SR counters) still loads; the counters
// are ignored, since every micro-batch's SR offset follows from the step, so the run continues
// bitwise like the uninterrupted one.
// Versions 1 and 2 read the data unshuffled, their sampler a stream position: a run without
// shuffling, its state rewritten in the old form (and without the newer train keys), continues
// bitwise.
TEST_F(CheckpointE2E, Version1StateLoadsAndContinuesBitwise) {
  TrainConfig c = resume_run(Recipe::kNvfp4, Layout::kSingle);
  c.shuffle = false;
  const Trace straight = run(c, kSteps);
  Trace resumed;
  const std::string saved = save_after_steps(c, "v3", &resumed);
  for (int version : {1, 2}) {
    SCOPED_TRACE(version);
    Trace continued = resumed;
    const std::string old = recommit(saved, root("v" + std::to_string(version)),
                                     [&](const fs::path& d) {
      set_json(d / kTrainerStateFile, [&](nlohmann::json& j) {
        j["version"] = version;
        if (version == 1)
          j["sr_offsets"] = nlohmann::json::array(
              {{{"linear", "model.layers.0.self_attn.q_proj.weight"}, {"offset", 51200}}});
        const int64_t consumed = j["sampler"]["consumed"][0].get<int64_t>();
        const int64_t tokens = j["sampler"]["sources"][0]["tokens"].get<int64_t>();
        const int64_t windows = j["sampler"]["sources"][0]["windows"].get<int64_t>();
        const int64_t S = j["train"]["seq_len"].get<int64_t>();
        j["sampler"] = {{"offset", consumed % windows * S},
                        {"epoch", consumed / windows},
                        {"stream_tokens", tokens}};
        j["train"].erase("shuffle");
        j["train"].erase("valid_fraction");
      });
    });
    EXPECT_FALSE(read_trainer_checkpoint(old).value().config.shuffle);
    train(*resume(old, c), kSteps - kSaveAt, &continued);
    expect_bitwise_equal(straight, continued);
  }
}

TEST_F(CheckpointE2E, BadCheckpointsGiveOneClearErrorAndChangeNothing) {
  const TrainConfig c = resume_run(Recipe::kNvfp4, Layout::kSingle);
  Trace unused;
  const std::string good = save_after_steps(c, "good", &unused);
  ModelConfig other_model = tiny();
  other_model.num_experts = 8;
  std::string other;
  {
    std::unique_ptr<Trainer> t = make_trainer(c, other_model);
    other = t->save_checkpoint(root("other"), 1).value().info.dir;
  }
  const std::string weights = io::kHfWeightsFile;
  const std::string expert0 = "model.layers.0.mlp.experts.0.gate_proj.weight";

  struct Case {
    std::string name, dir, needle;
  };
  std::vector<Case> cases;
  cases.push_back({"corrupted",
                   damaged_copy(good, root("corrupted"),
                                [&](const fs::path& d) {
                                  std::vector<uint8_t> b = read_raw(d / weights);
                                  b[b.size() / 2] ^= 0x10;  // one bit inside the tensor data
                                  write_raw(d / weights, b);
                                }),
                   weights + ": CRC-32C"});
  cases.push_back({"truncated",
                   damaged_copy(good, root("truncated"),
                                [&](const fs::path& d) {
                                  std::vector<uint8_t> b = read_raw(d / kOptimizerFile);
                                  b.resize(b.size() - 100);
                                  write_raw(d / kOptimizerFile, b);
                                }),
                   "(truncated?)"});
  cases.push_back({"file missing",
                   damaged_copy(good, root("file_missing"),
                                [&](const fs::path& d) { fs::remove(d / kTrainerStateFile); }),
                   "trainer_state.json: missing"});
  cases.push_back({"another model", other, "is another model: num_experts = 8 there, 4 here"});
  cases.push_back({"config of another model",
                   recommit(good, root("config"),
                            [&](const fs::path& d) {
                              set_json(d / kConfigFile,
                                       [](nlohmann::json& j) { j["num_experts"] = 8; });
                            }),
                   "missing tensor \"model.layers.0.mlp.experts.4.gate_proj.weight\""});
  cases.push_back({"missing tensor",
                   recommit(good, root("missing"),
                            [&](const fs::path& d) {
                              rewrite_weights(
                                  d, [&](io::SafetensorsWriter&, const io::SafetensorsEntry& e) {
                                    return e.name == expert0;  // dropped
                                  });
                            }),
                   "missing tensor \"" + expert0 + "\""});
  cases.push_back(
      {"wrong shape",
       recommit(good, root("shape"),
                [&](const fs::path& d) {
                  rewrite_weights(
                      d, [&](io::SafetensorsWriter& out, const io::SafetensorsEntry& e) {
                        if (e.name != expert0) return false;
                        out.add(e.name, e.dtype, {e.shape[1], e.shape[0]}, e.bytes);  // transposed
                        return true;
                      });
                }),
       "tensor \"" + expert0 + "\" has shape (64, 32)"});
  cases.push_back({"wrong dtype",
                   recommit(good, root("dtype"),
                            [&](const fs::path& d) {
                              rewrite_weights(d, [&](io::SafetensorsWriter& out,
                                                     const io::SafetensorsEntry& e) {
                                if (e.name != expert0) return false;
                                out.add(e.name, "I32", e.shape, e.bytes);
                                return true;
                              });
                            }),
                   "has dtype I32"});
  cases.push_back({"missing moment",
                   recommit(good, root("moment"),
                            [&](const fs::path& d) {
                              io::SafetensorsFile f =
                                  io::SafetensorsFile::read((d / kOptimizerFile).string()).value();
                              io::SafetensorsWriter out;
                              for (const auto& [k, v] : f.metadata()) out.set_metadata(k, v);
                              for (const io::SafetensorsEntry& e : f.entries())
                                if (e.name != exp_avg_sq_name("model.norm.weight"))
                                  out.add(e.name, e.dtype, e.shape, e.bytes);
                              ASSERT_TRUE(out.write((d / kOptimizerFile).string()).is_ok());
                            }),
                   "missing tensor \"exp_avg_sq/model.norm.weight\""});
  cases.push_back({"two ranks",
                   recommit(good, root("ranks"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile,
                                       [](nlohmann::json& j) { j["world_size"] = 2; });
                            }),
                   "world_size 2 without a shard_plan"});
  cases.push_back({"step",
                   recommit(good, root("step"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile,
                                       [](nlohmann::json& j) { j["step"] = 7; });
                            }),
                   "step 7 differs from the step 2 of complete.json"});
  cases.push_back({"newer version",
                   recommit(good, root("version"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile,
                                       [](nlohmann::json& j) { j["version"] = 4; });
                            }),
                   "version 4 is not supported (this build reads 1 to 3)"});
  cases.push_back({"other data",
                   recommit(good, root("data"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile, [](nlohmann::json& j) {
                                const int64_t S = j["train"]["seq_len"].get<int64_t>();
                                j["sampler"]["sources"][0] = {{"tokens", 1000},
                                                              {"windows", (999 - S) / S + 1}};
                              });
                            }),
                   "its training source 0 had 1000 tokens"});
  cases.push_back({"bad position",
                   recommit(good, root("position"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile, [](nlohmann::json& j) {
                                j["sampler"]["consumed"][0] = -3;
                              });
                            }),
                   "sampler.consumed[0] must be an integer >= 0 (got -3)"});
  cases.push_back({"another blend",
                   recommit(good, root("blend"),
                            [&](const fs::path& d) {
                              set_json(d / kTrainerStateFile, [](nlohmann::json& j) {
                                j["sampler"]["consumed"].push_back(0);
                                j["sampler"]["sources"].push_back(j["sampler"]["sources"][0]);
                              });
                            }),
                   "trained on 2 data source(s), this run has 1"});

  // The trainer that must stay untouched: one step in, its state captured.
  std::unique_ptr<Trainer> t = make_trainer(c);
  Trace before;
  train(*t, 1, &before);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const Status s = t->load_checkpoint(k.dir);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find(k.needle), std::string::npos) << s.message();
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line: " << s.message();
    Trace after = before;  // the same history; the state is read again
    capture_state(*t, &after);
    expect_bitwise_equal(before, after);
  }
  // ... and it trains on exactly like a trainer that never saw a bad checkpoint.
  train(*t, 1, &before);
  expect_bitwise_equal(before, run(c, 2));
}

// ---- primary weights (--save-primary) -----------------------------------------------------------

TEST_F(CheckpointE2E, PrimaryWeightsFileHoldsTheBytesTheRunComputesWith) {
  for (Recipe recipe : kRecipes) {
    SCOPED_TRACE(recipe_name(recipe));
    const TrainConfig c = resume_run(recipe, Layout::kDiscrete);
    std::unique_ptr<Trainer> t = make_trainer(c);
    Trace unused;
    train(*t, 1, &unused);
    const std::string dir =
        t->save_checkpoint(root(std::string("primary_") + recipe_name(recipe)), 1, true)
            .value()
            .info.dir;
    const std::string path = (fs::path(dir) / kPrimaryFile).string();
    io::SafetensorsFile file = io::SafetensorsFile::read(path).value();

    // Expected bytes, from the parameters themselves.
    const ModelConfig m = tiny();
    const int64_t H = m.hidden_size, F = m.moe_intermediate_size;
    const NamedParam* fc1 = nullptr;
    for (const NamedParam& p : t->model().params())
      if (p.name == "model.layers.1.mlp.experts.gate_up_proj") fc1 = &p;
    ASSERT_NE(fc1, nullptr);
    std::map<std::string, std::vector<uint8_t>> parts;
    for (const NamedStorage& s : fc1->param->weight_components())
      parts[s.name] = s.storage->download();
    // Expert 2's up_proj: rows [F, 2F) of expert 2 of the (E, 2F, H) pack.
    const io::SafetensorsEntry* up = file.find("model.layers.1.mlp.experts.2.up_proj.weight");
    ASSERT_NE(up, nullptr);
    const int64_t first_row = 2 * 2 * F + F;
    auto range = [](const std::vector<uint8_t>& v, int64_t begin, int64_t n) {
      return std::vector<uint8_t>(v.begin() + begin, v.begin() + begin + n);
    };
    const std::vector<uint8_t> got(up->bytes.begin(), up->bytes.end());
    if (recipe == Recipe::kBF16) {
      EXPECT_EQ(up->dtype, "BF16");
      EXPECT_EQ(got, range(parts.at("bf16"), first_row * H * 2, F * H * 2));
      EXPECT_EQ(file.find("model.layers.1.mlp.experts.2.up_proj.weight_scale"), nullptr);
      continue;
    }
    const io::SafetensorsEntry* scale = file.find(up->name + "_scale");
    ASSERT_NE(scale, nullptr);
    const std::vector<uint8_t> got_scale(scale->bytes.begin(), scale->bytes.end());
    if (recipe == Recipe::kMxfp8) {
      EXPECT_EQ(up->dtype, "F8_E4M3");
      EXPECT_EQ(scale->dtype, "F8_E8M0");
      EXPECT_EQ(got, range(parts.at("row_data"), first_row * H, F * H));
      EXPECT_EQ(got_scale, range(parts.at("row_scale"), first_row * (H / 32), F * (H / 32)));
    } else {
      EXPECT_EQ(up->dtype, "U8");
      EXPECT_EQ(up->shape, (std::vector<int64_t>{F, H / 2}));
      EXPECT_EQ(scale->dtype, "F8_E4M3");
      EXPECT_EQ(got, range(parts.at("row_data"), first_row * H / 2, F * H / 2));
      EXPECT_EQ(got_scale, range(parts.at("row_scale"), first_row * (H / 16), F * (H / 16)));
      const io::SafetensorsEntry* scale_2 = file.find(up->name + "_scale_2");
      ASSERT_NE(scale_2, nullptr);
      EXPECT_EQ(std::vector<uint8_t>(scale_2->bytes.begin(), scale_2->bytes.end()),
                range(parts.at("decode_scale"), 2 * 4, 4));
    }
    // Non-expert weights are their BF16 primaries; `packmoe dequantize` reads the file, and its
    // values are the masters within the format's error.
    EXPECT_EQ(file.find("model.layers.0.self_attn.q_proj.weight")->dtype, "BF16");
    const std::string deq = (fs::path(dir).parent_path() / "deq.safetensors").string();
    ASSERT_TRUE(io::dequantize_file(path, deq, DType::kF32, cpu_backend()).is_ok());
    io::SafetensorsFile d = io::SafetensorsFile::read(deq).value();
    const io::SafetensorsEntry* up_f32 = d.find(up->name);
    ASSERT_NE(up_f32, nullptr);
    const Tensor master = t->snapshot().masters.at("model.layers.1.mlp.experts.gate_up_proj");
    const float* want = master.data_as<const float>() + first_row * H;
    double err = 0, norm = 0;
    for (int64_t i = 0; i < F * H; ++i) {
      float v;
      std::memcpy(&v, up_f32->bytes.data() + 4 * i, 4);
      err += (v - want[i]) * (v - want[i]);
      norm += want[i] * want[i];
    }
    // Measured 2026-11-30: 0.026 (MXFP8), 0.111 (NVFP4); a misplaced scale would be far off.
    std::printf("%s primary: dequantized vs master, rel. Frobenius %.4f\n", recipe_name(recipe),
                std::sqrt(err / norm));
    EXPECT_LT(std::sqrt(err / norm), recipe == Recipe::kMxfp8 ? 0.04 : 0.15);
  }
}

}  // namespace
}  // namespace packmoe::train
