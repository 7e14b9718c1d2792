// TrainConfig: every knob of a training run but the model shape and the data, with its checks and
// its JSON form (the "train" object of a `packmoe train --config` file). Invariant: a TrainConfig
// that passed validate() gives a well-defined run (no division by zero, no empty eval, S within
// the model's positions); JSON keys are exactly the field names, and unknown keys are errors.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "core/status.h"
#include "dist/dist_optimizer.h"
#include "nn/model.h"
#include "train/lr_schedule.h"

namespace packmoe::train {

struct TrainConfig {
  // Defaults: the tiny preset on the byte corpus trains on 2 CPU cores in about a minute, its
  // validation loss falling from ln 256 = 5.55 to about 2.1.
  int64_t steps = 1000;           // optimizer steps
  int64_t micro_batch_size = 8;   // B rows per micro-batch
  int64_t seq_len = 64;           // S tokens per row
  int64_t grad_accum_steps = 1;   // A micro-batches per step; tokens per step = A x B x S
  double lr = 3e-3;               // peak learning rate
  double min_lr = 3e-4;           // end of the cosine
  int64_t warmup_steps = 50;
  std::optional<int64_t> decay_steps;  // absent: = steps
  double weight_decay = 0.1;      // AdamW decoupled decay; never on norms (NamedParam::weight_decay)
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;         // max global grad norm; <= 0 disables clipping
  int64_t eval_interval = 100;    // evaluate every N steps and after the last; 0: never
  int64_t eval_batches = 8;       // fixed validation micro-batches per evaluation
  int64_t log_interval = 50;      // steps per log line
  uint64_t seed = 1234;           // weight init, NVFP4 stochastic rounding and the data order
  // Data: documents and samples in a seeded order per epoch (Megatron's GPTDataset shuffle);
  // false: source order (docs/data.md).
  bool shuffle = true;
  // Share of each source held out for validation when no validation data is given, in [0, 1)
  // (io/data_split.h: by document, or by position when a side would be empty).
  double valid_fraction = 0.1;
  // Expert precision and every parameter's layout. precision.recipe.sr_seed is replaced by seed.
  ModelPrecision precision;
  // How data parallelism (mpirun) all-gathers updated parameters; no effect on one rank. All modes
  // give bitwise the same weights (docs/dist.md); they differ in bytes moved and memory.
  GatherMode gather_mode = GatherMode::kBf16;
  // Expert parallelism (EP): each MoE layer's experts are cut into EP contiguous ranges, each rank
  // holds one (dist/expert_layout.h); tokens reach their experts by all-to-all. 1: every rank
  // holds every expert. EP must divide the ranks and the experts (checked by Trainer::create).
  int64_t expert_parallel = 1;
  // How the forward's dispatch carries the FC1 input rows under expert parallelism: bf16, or
  // recipe (the MXFP8 / NVFP4 rowwise copy the FC1 GEMM reads: fewer bytes, and the FC1 weight
  // gradient within docs/dist.md's bound of bf16's). recipe needs expert_parallel > 1 and a
  // quantized recipe.
  DispatchDtype dispatch_dtype = DispatchDtype::kBF16;
  // What each micro-batch's forward keeps for backward (nn/recompute.h): none, selective (the
  // attention core and the SwiGLUs re-run in backward) or full (each layer's forward re-run).
  // Every mode gives the same bytes; they trade memory for compute.
  Recompute recompute = Recompute::kNone;
  // The tokenizer the data was tokenized with (`--tokenizer`), as an absolute path; empty: byte
  // tokens or pre-tokenized files without one. Stored in checkpoints so that export-hf copies
  // its files beside the weights (docs/tokenizers.md).
  std::string tokenizer;
};

// Upper bounds of the integer settings, as powers of two: far above any real run, low enough that
// every count derived from them (tokens of a step and of the run, SR offsets) is exact in int64.
inline constexpr int kMaxStepsBits = 40;  // steps, warmup, decay, eval / log intervals
inline constexpr int kMaxAccumBits = 20;  // grad_accum_steps, eval_batches
inline constexpr int kMaxRowsBits = 31;   // micro_batch_size, and its tokens B x S
inline constexpr int64_t kMaxRanks = int64_t{1} << 10;  // data-parallel ranks, for token counts

// One error per bad value, naming the field, e.g. "micro_batch_size = 0 must be >= 1";
// also seq_len <= the model's max_position_embeddings, and the token counts of a micro-batch, a
// step and the run fit in int64.
Status validate(const TrainConfig& config, const ModelConfig& model);

// An error unless `value` (a step count read from a file, e.g. trainer_state.json's
// optimizer_steps) is in [0, 2^kMaxStepsBits].
Status check_step_count(const std::string& name, int64_t value);

// An error unless the model (check_model_fits) and a micro-batch's activations fit in
// `bytes_available` (e.g. host_memory_bytes()): checked before anything is allocated. A lower
// bound of what a run holds, so a run it passes may still be too large; one it refuses is.
Status check_run_fits(const TrainConfig& config, const ModelConfig& model,
                      int64_t bytes_available);
LrSchedule lr_schedule(const TrainConfig& config);

// Names used by flags and JSON: recipe bf16|mxfp8|nvfp4, layout single|discrete, primary low|high,
// recompute none|selective|full.
Result<Recipe> parse_recipe(const std::string& name);
Result<Layout> parse_layout(const std::string& name);
Result<PrimaryWeight> parse_primary(const std::string& name);
Result<Recompute> parse_recompute(const std::string& name);
Result<DispatchDtype> parse_dispatch_dtype(const std::string& name);  // bf16 | recipe
const char* layout_name(Layout layout);
const char* primary_name(PrimaryWeight primary);
const char* recompute_name(Recompute recompute);

// Every field under its JSON key (decay_steps only when set): apply_train_json of the result onto
// any TrainConfig gives back `config` exactly (doubles round-trip).
nlohmann::json train_config_to_json(const TrainConfig& config);

// Overwrites the fields present in `json` (an object whose keys are the field names above plus
// "recipe", "layout", "primary", "recompute", "dispatch_dtype", "tokenizer" (a path); gather_mode by name: bf16, lowp,
// reuse-grad-buffer); an unknown key or a wrong type is an error naming the key.
Status apply_train_json(const nlohmann::json& json, TrainConfig* config);

}  // namespace packmoe::train
