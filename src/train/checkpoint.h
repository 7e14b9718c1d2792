// Trainer checkpoints (docs/checkpoints.md, "Trainer checkpoints"): the files a Trainer writes into
// a checkpoint directory (HF-named F32 masters, config.json, AdamW moments: one file, or one shard
// file per rank of a data-parallel job, trainer_state.json, optionally the primary weights), the
// reader that validates a directory into host memory, and the HF export. Invariant:
// read_trainer_checkpoint returns a TrainerCheckpoint only when every file passed every check
// (CRC-32C, names, shapes, dtypes, JSON fields, shard coverage), so applying it to a Trainer cannot
// fail halfway; nothing here depends on the expert layout, the recipe or the world size.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "dist/optimizer_state.h"
#include "dist/shard_plan.h"
#include "io/state_file.h"
#include "nn/model.h"
#include "train/batch_sampler.h"
#include "train/model_config.h"
#include "train/train_config.h"

namespace packmoe::train {

// Files of a trainer checkpoint directory besides io::kHfWeightsFile ("model.safetensors", the
// FP32 masters under HF names) and io::kCheckpointMarker.
inline constexpr const char* kConfigFile = "config.json";               // the model, HF fields
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";  // AdamW moments
inline constexpr const char* kTrainerStateFile = "trainer_state.json";  // step, data, RNG, config
inline constexpr const char* kPrimaryFile = "primary.safetensors";      // --save-primary only

// The optimizer shard file of `rank` in a data-parallel save of `world` ranks (the format of
// dist/optimizer_state.h): "optimizer-00001-of-00003.bin". It replaces kOptimizerFile there.
std::string optimizer_shard_file(int rank, int world);

// Names of a parameter's AdamW moments in optimizer.safetensors: "exp_avg/" / "exp_avg_sq/" +
// the ModelWeights name, F32 in the ModelWeights shape (experts packed (E, N, K)): the same bytes
// whichever layout wrote them.
std::string exp_avg_name(const std::string& param);
std::string exp_avg_sq_name(const std::string& param);

// The distributed optimizer's layout when a data-parallel job saved (trainer_state.json
// "shard_plan"). Loading needs only the shard files, which name their elements themselves; the
// reader checks them against this record, and any world size loads them.
struct SavedShardPlan {
  int64_t total = 0;  // flat buffer elements, padding included
  int64_t bucket_elems = 0;
  std::vector<ParamGeometry> params;  // (E, N, K, unit_rows), model_param_specs order
  std::vector<int64_t> offsets;       // (P) each parameter's start in the flat buffer
  std::vector<FlatRange> shards;      // (world_size) rank r's elements of the flat buffer
};
SavedShardPlan saved_shard_plan(const ShardPlan& plan);

// Everything a checkpoint holds, in host memory.
struct TrainerCheckpoint {
  std::string dir;   // where it was read from (empty for a snapshot)
  int64_t step = 0;  // optimizer steps done
  ModelConfig model;
  TrainConfig config;           // of the run that wrote it (recipe, primary, layout, seed inside)
  ModelWeights masters;         // F32, ModelWeights names and shapes
  io::StateTensors moments;     // exp_avg_name / exp_avg_sq_name of every parameter, full
  int64_t optimizer_steps = 0;  // AdamW's t
  SamplerState sampler;         // samples drawn from each training source so far
  std::vector<SourceShape> train_sources;  // (sources) the training data it counts

  int64_t world_size = 1;           // ranks that wrote it
  // Data-parallel saves only: the plan (the moments were in one shard file per rank).
  std::optional<SavedShardPlan> shard_plan;
};

// Writes config.json, model.safetensors and trainer_state.json into `dir` (normally a
// CheckpointWriter's temporary directory), each file atomically, and optimizer.safetensors unless
// the checkpoint has a shard plan (then every rank writes its write_optimizer_shard).
Status write_trainer_checkpoint(const std::string& dir, const TrainerCheckpoint& checkpoint);
// dir/optimizer_shard_file(shard.rank, shard.world_size), atomically.
Status write_optimizer_shard(const std::string& dir, const OptimizerShard& shard);

// Reads a checkpoint directory: verify_checkpoint (marker, sizes, CRC-32C: truncation and
// corruption), trainer_state.json (format, version, every field and type, step = the marker's,
// world size and shard plan, the train config valid for the model), config.json,
// model.safetensors (load_hf_weights: every name, shape, dtype), the moments: optimizer.safetensors
// (exactly the moments of the model's parameters) or every rank's shard file (each of this save
// and rank, the plan's parameters; together every element exactly once; their masters equal to
// model.safetensors). One error line naming the file.
Result<TrainerCheckpoint> read_trainer_checkpoint(const std::string& dir);

// A checkpoint directory from a path that is either one (it holds complete.json) or a save root:
// then the newest complete checkpoint under it (verified; `skipped` gets why newer ones were
// passed over). Errors: no such path, a root without a complete checkpoint.
Result<std::string> find_checkpoint(const std::string& path, std::vector<std::string>* skipped);

// The primary weights of every parameter as a safetensors file with HF names (hf_tensor_specs):
// a low-precision expert weight X as X (MXFP8 F8_E4M3 (rows, K) / NVFP4 U8 (rows, K/2), its
// rowwise copy), X_scale (F8_E8M0 (rows, K/32) / F8_E4M3 (rows, K/16), compact) and for NVFP4
// X_scale_2 (F32 scalar, the expert's decode scale), as `packmoe quantize` lays them out; every
// other weight (BF16 primaries) as BF16. Metadata "format": "pt" and, for a quantized recipe,
// packmoe.format / packmoe.block, so `packmoe dequantize` reads it. The exact bytes the run
// computes with; for export, not for resume.
Status write_primary_weights(const std::string& path, const Model& model);

// The tokenizer path the run of a checkpoint (a directory or a save root, as find_checkpoint)
// recorded in trainer_state.json's train.tokenizer, or "" when it had none: what export-hf copies
// and generate loads.
Result<std::string> checkpoint_tokenizer(const std::string& checkpoint);

// `packmoe export-hf`: the model of a checkpoint (a directory or a save root, as find_checkpoint)
// as OUT_DIR/model.safetensors in `dtype` (kBF16: round to nearest even, or kF32) plus
// OUT_DIR/config.json (with torch_dtype), what Qwen3MoeForCausalLM.from_pretrained(OUT_DIR)
// loads. Reads and checks the checkpoint before OUT_DIR is touched; each file is atomic. Returns
// the checkpoint directory it read.
Result<std::string> export_hf(const std::string& checkpoint, const std::string& out_dir,
                              DType dtype);

}  // namespace packmoe::train
