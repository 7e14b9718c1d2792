// `packmoe train`: a Qwen3-MoE model from a preset or config file, trained on the byte-level
// fortunes corpus (default) or Megatron / llm.c token files; optionally resumed from a checkpoint
// or initialised from Hugging Face weights, saving checkpoints on the way. Settings come from the
// defaults (or the resumed checkpoint's), then the --config file, then the flags (flags win).
// Invariant: every input is checked (flags, config, checkpoint, data, model shape) before DIR is
// touched, so a bad input leaves no output behind.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "dist/communicator.h"
#include "dist/dist_optimizer.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/output_dir.h"
#include "io/read_file.h"
#include "io/read_progress.h"
#include "io/state_file.h"
#include "io/text_corpus.h"
#include "io/token_data.h"
#include "tokenize/encode_documents.h"
#include "tokenize/tokenizer.h"
#include "tools/commands.h"
#include "tools/exact_integer.h"
#include "tools/progress_line.h"
#include "train/checkpoint.h"
#include "train/data_sources.h"
#include "train/memory_plan.h"
#include "train/plot.h"
#include "train/rank_agreement.h"
#include "train/train_loop.h"
#include "train/trainer.h"

namespace packmoe::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

template <typename T>
std::string text(const T& v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// A flag bound to a TrainConfig field: parsed into args.flags, copied over the file's value only
// when given on the command line.
template <typename T>
void add_train_flag(CLI::App* cmd, TrainArgs& args, const std::string& name,
                    T train::TrainConfig::*field, const std::string& help) {
  const train::TrainConfig defaults;
  CLI::Option* o =
      cmd->add_option(name, args.flags.*field, help + " (default: " + text(defaults.*field) + ")");
  if constexpr (std::is_integral_v<T>) o->check(exact_integer<T>());
  args.apply_flags.push_back(
      [name, field](const CLI::App& c, const train::TrainConfig& from, train::TrainConfig& to) {
        if (c.count(name)) to.*field = from.*field;
      });
}

Result<json> read_json_file(const std::string& path) {
  Result<std::string> text = io::read_regular_file(path, io::kMaxJsonFileBytes);
  if (!text) return Status::error("--config: " + text.status().message());
  return parse_json_text(text.value(), path);
}

// Where the job runs: one process on `device`, or under mpirun one rank per process (on CUDA one
// GPU each: NCCL; on the CPU: MPI).
struct Placement {
  Backend* backend = nullptr;
  std::unique_ptr<Communicator> comm;  // null: one process (also mpirun -np 1)
};

// Under mpirun the communicator comes first: on CUDA it selects this rank's GPU
// (OMPI_COMM_WORLD_LOCAL_RANK) before anything creates the CUDA backend; `auto` means CUDA when
// a GPU is visible.
Result<Placement> place_job(const TrainArgs& args) {
  const std::string& device = args.device;
  if (args.cmd->count("--comm-timeout") &&
      (!(args.comm_timeout_s >= 0) || args.comm_timeout_s > 1e9))
    return Status::error("--comm-timeout = " + text(args.comm_timeout_s) +
                         " must be seconds in [0, 1e9] (0: no watchdog)");
  Placement p;
  if (!launched_by_mpirun()) {
    Result<Backend*> b = backend_from_flag(device);
    if (!b) return b.status();
    p.backend = b.value();
    return p;
  }
  bool cuda = false;
  if (device == "cuda" || (device == "auto" && visible_cuda_devices() > 0)) {
    cuda = true;
  } else if (device != "cpu" && device != "auto") {
    return backend_from_flag(device).status();  // names the legal values
  }
  Result<CommOptions> options = comm_options_from_env();
  if (!options) return options.status();
  if (args.cmd->count("--comm-timeout")) options.value().timeout_s = args.comm_timeout_s;
  Result<std::unique_ptr<Communicator>> c =
      make_communicator(cuda ? CommKind::kNccl : CommKind::kMpi, options.value());
  if (!c) return c.status();
  p.comm = std::move(c.value());
  p.backend = &p.comm->backend();
  if (p.comm->size() == 1) p.comm.reset();
  return p;
}

// --attention-mask, --eod-token, --reset-position-ids as the samplers' document options.
Result<train::StreamOptions> document_masking(const TrainArgs& args) {
  train::StreamOptions o;
  const bool document = args.attention_mask == "document";
  if (!document && args.attention_mask != "causal")
    return Status::error("--attention-mask " + args.attention_mask +
                         ": expected causal or document");
  if (!document && (args.cmd->count("--eod-token") || args.reset_position_ids))
    return Status::error("--eod-token and --reset-position-ids need --attention-mask document");
  if (args.cmd->count("--eod-token") && (args.eod_token < 0 || args.eod_token > INT32_MAX))
    return Status::error("--eod-token " + text(args.eod_token) + " must be a token id >= 0");
  if (!document) return o;
  o.document_mask = args.cmd->count("--eod-token") ? train::DocumentMask::kEodToken
                                                    : train::DocumentMask::kIndex;
  o.eod_token = o.document_mask == train::DocumentMask::kEodToken
                    ? static_cast<uint32_t>(args.eod_token)
                    : 0;
  o.reset_positions = args.reset_position_ids;
  return o;
}

}  // namespace

void add_train_command(CLI::App& app, TrainArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a Qwen3-MoE model whose experts live in one packed weight per layer (BF16, MXFP8\n"
      "or NVFP4 primary weights, FP32 masters). Writes DIR/config.json (the model, Hugging Face\n"
      "names), DIR/metrics.jsonl (one JSON object per step and per evaluation) and DIR/loss.svg\n"
      "(loss and grad-norm curves). Settings: defaults < --config file < flags. The config file "
      "is\n"
      "a JSON object with model keys (as in config.json: the sizes are required, other absent\n"
      "keys take the Hugging Face defaults, a value packmoe does not implement such as\n"
      "rope_scaling or a sliding window is an error, an unknown key a warning;\n"
      "docs/model-config.md) and/or a \"train\" object whose keys are the long names of the\n"
      "options below (steps, micro_batch_size, seq_len, grad_accum_steps, lr, min_lr,\n"
      "warmup_steps, decay_steps, weight_decay, beta1, beta2, eps, grad_clip, eval_interval,\n"
      "eval_batches, log_interval, seed, shuffle, valid_fraction, recipe, layout, primary,\n"
      "gather_mode, recompute, dispatch_dtype).\n"
      "Checkpoints: --save-dir ROOT writes ROOT/step-XXXXXXXX (FP32 masters as Hugging Face\n"
      "safetensors, config.json, AdamW moments, trainer_state.json) every --save-interval steps\n"
      "and after the last, keeping the newest --keep-last (under mpirun the AdamW state is one\n"
      "optimizer shard file per rank, and any rank count resumes it). --resume continues one\n"
      "bitwise as if never interrupted (its settings are the base, the config file and flags\n"
      "override them; --layout, --recipe and --primary may change); --init-from-hf starts a new\n"
      "run from Hugging Face weights. `packmoe export-hf` turns a checkpoint into a Hugging Face\n"
      "model.");
  args.cmd = cmd;
  cmd->add_option("--config", args.config_file, "JSON config file (model keys and/or \"train\")");
  cmd->add_option("--preset", args.preset,
                  "model preset when the config file has no model keys: tiny (byte vocab, 2 "
                  "layers, 4 experts), small (~100M parameters), qwen3_30b_a3b_layers (its "
                  "layer shapes, 4 layers), qwen3_30b_a3b (the whole Qwen3-30B-A3B, 48 layers) "
                  "(default: tiny)");
  cmd->add_option("--recipe", args.recipe, "expert precision: bf16, mxfp8 or nvfp4 (default: bf16)");
  cmd->add_option("--layout", args.layout,
                  "parameter layout: single (one packed tensor per expert weight) or discrete "
                  "(one per expert); bitwise identical results (default: single)");
  cmd->add_option("--primary", args.primary,
                  "experts' primary weight: low (the quantized bytes are the parameter) or high "
                  "(BF16, quantized at every forward) (default: low)");
  cmd->add_option(
      "--gather-mode", args.gather_mode,
      "how data parallelism (mpirun -np N) all-gathers the updated weights each step; all give\n"
      "the same weights:\n"
      "  bf16: the BF16 master shards; every rank quantizes whole packs (2 B/param)\n"
      "  lowp: each rank quantizes its own rows and the quantized bytes travel (MXFP8 2D about\n"
      "        1, NVFP4 about 0.56 B/param)\n"
      "  reuse-grad-buffer: as bf16, through the gradient buffer's memory (no extra buffer)\n"
      "(default: bf16)");
  add_train_flag(cmd, args, "--expert-parallel", &train::TrainConfig::expert_parallel,
                 "expert parallelism EP: every MoE layer's experts are cut into EP ranges and\n"
                 "each group of EP consecutive ranks (mpirun -np N) holds them, one range per\n"
                 "rank; tokens reach their experts by all-to-all. EP divides N and the experts;\n"
                 "dense weights stay data-parallel over all ranks");
  cmd->add_option("--dispatch-dtype", args.dispatch_dtype,
                  "how expert parallelism's forward dispatch carries the FC1 input rows:\n"
                  "  bf16: as BF16 (2 B per value)\n"
                  "  recipe: as the mxfp8 / nvfp4 rowwise copy the FC1 GEMM reads (MXFP8 about\n"
                  "  1.03, NVFP4 about 0.56 B per value); the forward is bitwise bf16's, the FC1\n"
                  "  weight gradient within docs/dist.md's bound. Needs --expert-parallel > 1\n"
                  "  and a quantized --recipe\n"
                  "(default: bf16)");
  cmd->add_option("--dry-run", args.dry_run_ranks,
                  "plan a job of RANKS ranks (mpirun -np RANKS) with these settings and exit:\n"
                  "print, for its largest rank, the parameters it holds (dense + its experts),\n"
                  "its primary weights, FP32 replicas, FP32 gradient buffer, FP32 master shard,\n"
                  "AdamW moments and gather buffers, and the bytes all-gathered and\n"
                  "reduce-scattered per step. Builds no model, reads no data, writes nothing and\n"
                  "does not compare with this machine's memory, so a laptop sizes a GPU job;\n"
                  "activations, workspace and the CUDA context are not counted")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--recompute", args.recompute,
                  "activations recomputed in backward instead of kept, the same bytes either way:\n"
                  "  none: all kept; selective: the attention core and the SwiGLUs re-run (as\n"
                  "  Megatron's); full: each layer keeps only its input and re-runs its forward\n"
                  "(default: none)");
  add_train_flag(cmd, args, "--steps", &train::TrainConfig::steps, "optimizer steps");
  add_train_flag(cmd, args, "--micro-batch", &train::TrainConfig::micro_batch_size,
                 "rows per micro-batch (B)");
  add_train_flag(cmd, args, "--seq-len", &train::TrainConfig::seq_len, "tokens per row (S)");
  add_train_flag(cmd, args, "--grad-accum", &train::TrainConfig::grad_accum_steps,
                 "micro-batches per optimizer step");
  add_train_flag(cmd, args, "--lr", &train::TrainConfig::lr, "peak learning rate");
  add_train_flag(cmd, args, "--min-lr", &train::TrainConfig::min_lr,
                 "learning rate at the end of the cosine decay");
  add_train_flag(cmd, args, "--warmup", &train::TrainConfig::warmup_steps,
                 "linear warmup steps from 0 to --lr");
  cmd->add_option("--decay-steps", args.decay_steps,
                  "step at which the cosine reaches --min-lr, constant after (default: --steps)")
      ->check(exact_integer<int64_t>());
  add_train_flag(cmd, args, "--weight-decay", &train::TrainConfig::weight_decay,
                 "AdamW decoupled weight decay, not applied to norms");
  add_train_flag(cmd, args, "--beta1", &train::TrainConfig::beta1, "AdamW beta1");
  add_train_flag(cmd, args, "--beta2", &train::TrainConfig::beta2, "AdamW beta2");
  add_train_flag(cmd, args, "--eps", &train::TrainConfig::eps, "AdamW epsilon");
  add_train_flag(cmd, args, "--grad-clip", &train::TrainConfig::grad_clip,
                 "max global grad norm; <= 0 disables clipping");
  add_train_flag(cmd, args, "--eval-interval", &train::TrainConfig::eval_interval,
                 "evaluate every N steps and after the last; 0: never");
  add_train_flag(cmd, args, "--eval-batches", &train::TrainConfig::eval_batches,
                 "validation micro-batches per evaluation (always the same ones)");
  add_train_flag(cmd, args, "--log-interval", &train::TrainConfig::log_interval,
                 "steps per log line");
  add_train_flag(cmd, args, "--seed", &train::TrainConfig::seed,
                 "seed of the weight init and NVFP4 stochastic rounding");
  cmd->add_option("--device", args.device, "auto (CUDA if a GPU is usable), cpu or cuda (default: auto)");
  cmd->add_option("--data", args.data,
                  "training data: fortunes (the Debian fortunes corpus, byte tokens), text:PATH "
                  "(fortune-format text files or folders, '%' lines separate documents; a file "
                  "without them is one document), megatron:PREFIX (PREFIX.bin/.idx, "
                  "memory-mapped), llmc:SHARD (an llm.c .bin token shard, memory-mapped) or "
                  "sft:FILE.jsonl (conversations for fine-tuning, with --tokenizer: loss on the "
                  "assistants' tokens only, packed into rows; docs/data.md); or "
                  "a blend of several, separated by spaces or commas, each after a weight "
                  "(\"0.7 megatron:a 0.3 megatron:b\": rows drawn in these proportions) or none "
                  "(\"megatron:a megatron:b\": each weighs its samples, i.e. concatenated). "
                  "Without --valid-data each source holds --valid-fraction of itself back for "
                  "validation (default: fortunes)");
  cmd->add_flag("--shuffle,!--no-shuffle", args.shuffle,
                "--shuffle: documents and samples in a seeded order per epoch (from --seed), as "
                "Megatron's GPTDataset; --no-shuffle: in file order (default: --shuffle)");
  add_train_flag(cmd, args, "--valid-fraction", &train::TrainConfig::valid_fraction,
                 "share of each --data source held back for validation when no --valid-data is "
                 "given, in [0, 1): whole documents by a fixed hash (text: of its bytes, token "
                 "files: of its index), or the last tokens when that leaves a side empty (one "
                 "document)");
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer for text data (tokenizer.json, a SentencePiece .model, or a folder "
                  "holding one): text: and fortunes data are tokenized with it, each document "
                  "followed by its eos token; the model's vocab_size is the tokenizer's unless "
                  "a config file's model keys say it (then it must be at least as large); the "
                  "files are copied into --out and the path is kept in checkpoints for export-hf "
                  "(default: byte tokens; a resumed run keeps its checkpoint's tokenizer)");
  cmd->add_option("--attention-mask", args.attention_mask,
                  "causal (each row one causal sequence) or document (tokens attend only inside "
                  "their own document: the data's document boundaries, or --eod-token's) "
                  "(default: causal)");
  cmd->add_option("--eod-token", args.eod_token,
                  "with --attention-mask document: a document ends with each token of this id "
                  "(e.g. the tokenizer's end-of-text id) instead of the data's boundaries");
  cmd->add_flag("--reset-position-ids", args.reset_position_ids,
                "with --attention-mask document: RoPE positions restart at 0 in each document");
  cmd->add_option("--valid-data", args.valid_data,
                  "validation data, the same forms (a blend too), read whole; then --data is "
                  "read whole for training (default: the --valid-fraction of each --data "
                  "source)");
  cmd->add_option("--out", args.out,
                  "output directory for config.json, metrics.jsonl and loss.svg; a resumed run "
                  "appends to metrics.jsonl, dropping records past the checkpoint's step "
                  "(default: " +
                      args.out + ")");
  cmd->add_option("--tensorboard", args.tensorboard,
                  "also write the run's scalars (loss, eval loss, lr, grad norm, aux loss, "
                  "tokens/s, MFU, memory, expert load) as a TensorBoard event file in DIR: "
                  "tensorboard --logdir DIR");
  cmd->add_option("--save-dir", args.save_dir,
                  "checkpoint root: writes ROOT/step-XXXXXXXX atomically (temporary directory, "
                  "CRC-32C marker, rename) every --save-interval steps and after the last step");
  cmd->add_option("--save-interval", args.save_interval,
                  "steps between checkpoints; 0: only after the last step (default: 0)")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--keep-last", args.keep_last,
                  "checkpoints that verify kept under --save-dir, older ones are deleted "
                  "(default: " +
                      std::to_string(args.keep_last) + ")")
      ->check(exact_integer<int>());
  cmd->add_flag("--overwrite", args.overwrite,
                "start a new run in a --save-dir that holds checkpoints (another run's): delete "
                "them first. Without it such a run is refused (continue one with --resume)");
  cmd->add_option("--comm-timeout", args.comm_timeout_s,
                  "under mpirun: seconds a rank waits in a collective for the others before the "
                  "job is aborted as stalled (0: never; default: PACKMOE_COMM_TIMEOUT_S, else " +
                      text(CommOptions{}.timeout_s) + ")");
  cmd->add_flag("--save-primary", args.save_primary,
                "also write each checkpoint's low-precision primary weights (data + scales, the "
                "names of `packmoe quantize`) as primary.safetensors, for export");
  cmd->add_option(
      "--resume", args.resume,
      "continue a run: DIR (a checkpoint directory, or a save root: its newest complete "
      "checkpoint) or auto (the newest complete checkpoint under --save-dir; none: "
      "start from step 0). The model is the checkpoint's; a --preset or config model "
      "that differs is an error");
  cmd->add_option("--init-from-hf", args.init_from_hf,
                  "start a new run (step 0, fresh optimizer) from Hugging Face weights: DIR with "
                  "config.json and model.safetensors (or a sharded index), per-expert or fused "
                  "expert names, F32 or BF16. DIR's config.json defines the model; a --preset or "
                  "config model that differs is an error");
}

namespace {

// What a start-up read (a checkpoint, Hugging Face weights) cost; printed once the run starts.
struct ReadCost {
  uint64_t bytes = 0;
  double seconds = 0;
};

// Where the run starts: fresh, from a checkpoint, or from Hugging Face weights.
struct Start {
  std::optional<train::TrainerCheckpoint> checkpoint;  // --resume found one
  std::optional<ModelConfig> hf_model;                 // --init-from-hf's config.json
  std::vector<std::string> notes;                      // printed once the run starts
  std::vector<std::string> warnings;                   // printed to stderr by rank 0
  ReadCost read;                                       // of the checkpoint or the HF weights
};

// One warning line for the keys of a model config that packmoe neither reads nor knows to be
// without effect (train/model_config.h).
std::optional<std::string> unknown_keys_warning(const std::string& where,
                                                const std::vector<std::string>& keys) {
  if (keys.empty()) return std::nullopt;
  std::string list;
  for (const std::string& k : keys) list += (list.empty() ? "" : ", ") + printable_text(k, true);
  return where + ": ignored " + std::to_string(keys.size()) +
         " key(s) packmoe does not know: " + list;
}

// Bytes of `path`: a regular file's size, or the sum over a directory's regular files.
uint64_t bytes_at(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return static_cast<uint64_t>(fs::file_size(path, ec));
  uint64_t total = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file(ec)) total += static_cast<uint64_t>(e.file_size(ec));
  return total;
}

// read() under a progress line of `label` over about `total` bytes; its cost into `cost`.
template <typename F>
auto read_with_progress(const std::string& label, uint64_t total, ReadCost& cost, F&& read) {
  ProgressLine line(label, total, ProgressLine::wanted());
  io::ReadProgress progress([&](uint64_t bytes) { line.update(bytes); });
  auto result = read();
  cost = {progress.bytes(), line.seconds()};
  return result;
}

// With data parallelism: the ranks agree on one status (train::agree), and an error is printed
// once, here, by the lowest failing rank (main's "packmoe: error:" line), naming that rank unless
// every rank failed, before a barrier: a rank that exits non-zero makes mpirun kill the others,
// which could otherwise take the line with it. Then every rank silences stderr, so main's own line
// goes nowhere. Collective.
Status agreed(Communicator* comm, Status status) {
  if (!comm) return status;
  const train::Agreement a = train::agree(*comm, status);
  if (a.failures == 0) return Status::ok();
  const Status agreed = Status::error(
      a.failures == comm->size() ? a.message
                                 : "rank " + std::to_string(a.first_failed) + ": " + a.message);
  if (comm->rank() == a.first_failed) {
    std::fprintf(stderr, "packmoe: error: %s\n", agreed.message().c_str());
    std::fflush(stderr);
  }
  comm->barrier();
  [[maybe_unused]] std::FILE* silenced = std::freopen("/dev/null", "w", stderr);
  return agreed;
}

Result<Start> resolve_start(const TrainArgs& args) {
  Start start;
  if (!args.resume.empty() && !args.init_from_hf.empty())
    return Status::error("--resume and --init-from-hf both set the starting weights; use one");
  if (!args.init_from_hf.empty()) {
    const std::string path = (fs::path(args.init_from_hf) / train::kConfigFile).string();
    std::vector<std::string> unknown;
    Result<ModelConfig> m = train::load_model_config(path, &unknown);
    if (!m) return Status::error("--init-from-hf: " + m.status().message());
    start.hf_model = m.value();
    if (auto w = unknown_keys_warning(path, unknown)) start.warnings.push_back(*w);
    return start;
  }
  if (args.resume.empty()) return start;
  std::string dir;
  std::vector<std::string> skipped;
  if (args.resume == "auto") {
    if (args.save_dir.empty()) return Status::error("--resume auto needs --save-dir");
    Result<io::LatestCheckpoint> latest = io::latest_checkpoint(args.save_dir);
    if (!latest) return latest.status();
    skipped = latest.value().skipped;
    if (latest.value().found) {
      dir = latest.value().found->dir;
    } else {
      start.notes.push_back("no complete checkpoint under " + args.save_dir +
                            ": starting from step 0");
    }
  } else {
    Result<std::string> found = train::find_checkpoint(args.resume, &skipped);
    if (!found) return Status::error("--resume: " + found.status().message());
    dir = found.value();
  }
  for (const std::string& why : skipped) start.notes.push_back("skipped " + why);
  if (dir.empty()) return start;
  // Every file is read twice: the marker's CRC check, then the tensors.
  Result<train::TrainerCheckpoint> c =
      read_with_progress("reading checkpoint " + dir, 2 * bytes_at(dir), start.read,
                         [&] { return train::read_trainer_checkpoint(dir); });
  if (!c) return Status::error("--resume: " + c.status().message());
  start.checkpoint = std::move(c.value());
  return start;
}


// The run's model and settings: the defaults (or the checkpoint's), then the --config file, then
// the flags, checked (train::validate); the tokenizer when one is named. Reads the config file and
// the tokenizer's, nothing else: no data, no output directory.
struct Settings {
  train::TrainConfig config;
  ModelConfig model;
  std::unique_ptr<tokenize::Tokenizer> tokenizer;  // --tokenizer (or the checkpoint's)
};

Result<Settings> resolve_settings(const TrainArgs& args, Start& start) {
  Settings settings;
  const std::optional<train::TrainerCheckpoint>& checkpoint = start.checkpoint;
  train::TrainConfig config = checkpoint ? checkpoint->config : train::TrainConfig{};
  std::optional<ModelConfig> model;  // given explicitly: a config file's model keys or --preset
  if (!args.config_file.empty()) {
    Result<json> file = read_json_file(args.config_file);
    if (!file) return file.status();
    if (!file.value().is_object())
      return Status::error(args.config_file + ": the config must be a JSON object");
    json model_keys = file.value();
    if (model_keys.contains("train")) {
      Status s = train::apply_train_json(model_keys["train"], &config);
      if (!s) return Status::error(args.config_file + ": " + s.message());
      model_keys.erase("train");
    }
    if (!model_keys.empty()) {
      if (args.cmd->count("--preset"))
        return Status::error("--preset and the model keys of " + args.config_file +
                             " both define the model; use one of them");
      std::vector<std::string> unknown;
      Result<ModelConfig> m = train::model_config_from_json(model_keys, &unknown);
      if (!m) return Status::error(args.config_file + ": " + m.status().message());
      model = m.value();
      if (auto w = unknown_keys_warning(args.config_file, unknown))
        start.warnings.push_back(*w);
    }
  }
  // The tokenizer: --tokenizer, else the checkpoint's or the config file's train.tokenizer.
  if (!args.tokenizer.empty()) config.tokenizer = fs::absolute(args.tokenizer).lexically_normal();
  if (!config.tokenizer.empty()) {
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(config.tokenizer);
    if (!t) return Status::error("--tokenizer: " + t.status().message());
    settings.tokenizer = std::move(t.value());
  }
  // A preset is a shape: with a tokenizer its vocab_size is the tokenizer's. A model from a
  // file, a checkpoint or HF weights keeps its own, which must hold every token id.
  const auto preset = [&](const std::string& name) -> Result<ModelConfig> {
    Result<ModelConfig> m = train::model_config_preset(name);
    if (m && settings.tokenizer) m.value().vocab_size = settings.tokenizer->vocab_size();
    return m;
  };
  if (!model && args.cmd->count("--preset")) {
    Result<ModelConfig> m = preset(args.preset);
    if (!m) return m.status();
    model = m.value();
  }
  // A checkpoint or HF directory brings its own model; one given explicitly must be the same.
  const std::optional<ModelConfig> stored =
      checkpoint ? std::optional<ModelConfig>(checkpoint->model) : start.hf_model;
  if (stored) {
    const std::string where =
        (fs::path(checkpoint ? checkpoint->dir : args.init_from_hf) / train::kConfigFile).string();
    if (model) PACKMOE_RETURN_IF_ERROR(train::check_same_model(*model, *stored, where));
    model = stored;
  }
  if (!model) {
    Result<ModelConfig> m = preset(args.preset);
    if (!m) return m.status();
    model = m.value();
  }
  if (settings.tokenizer &&
      model->vocab_size < static_cast<int64_t>(settings.tokenizer->vocab_size()))
    return Status::error("the model's vocab_size = " + std::to_string(model->vocab_size) +
                         " is smaller than the tokenizer's " +
                         std::to_string(settings.tokenizer->vocab_size()) + " (" +
                         config.tokenizer + "): drop vocab_size from the config or raise it");
  for (const auto& apply : args.apply_flags) apply(*args.cmd, args.flags, config);
  if (args.cmd->count("--decay-steps")) config.decay_steps = args.decay_steps;
  // Extending a run (--resume with another --steps) keeps the schedule it had: the cosine still
  // ends where it did, so the LR never jumps; --decay-steps re-stretches it explicitly.
  if (checkpoint && !config.decay_steps && config.steps != checkpoint->config.steps) {
    config.decay_steps = checkpoint->config.steps;
    char note[320];
    std::snprintf(note, sizeof note,
                  "schedule: --steps %lld continues a run of %lld steps on its own schedule (the "
                  "cosine reaches --min-lr %g at step %lld, constant after); --decay-steps N "
                  "re-stretches it",
                  static_cast<long long>(config.steps),
                  static_cast<long long>(checkpoint->config.steps), config.min_lr,
                  static_cast<long long>(checkpoint->config.steps));
    start.notes.push_back(note);
  }
  if (args.cmd->count("--shuffle")) config.shuffle = args.shuffle;
  if (args.cmd->count("--recipe")) {
    Result<Recipe> r = train::parse_recipe(args.recipe);
    if (!r) return r.status();
    config.precision.recipe.recipe = r.value();
  }
  if (args.cmd->count("--layout")) {
    Result<Layout> l = train::parse_layout(args.layout);
    if (!l) return l.status();
    config.precision.layout = l.value();
  }
  if (args.cmd->count("--primary")) {
    Result<PrimaryWeight> p = train::parse_primary(args.primary);
    if (!p) return p.status();
    config.precision.primary = p.value();
  }
  if (args.cmd->count("--recompute")) {
    Result<Recompute> r = train::parse_recompute(args.recompute);
    if (!r) return r.status();
    config.recompute = r.value();
  }
  if (args.cmd->count("--gather-mode")) {
    Result<GatherMode> m = parse_gather_mode(args.gather_mode);
    if (!m) return Status::error("--gather-mode: " + m.status().message());
    config.gather_mode = m.value();
  }
  if (args.cmd->count("--dispatch-dtype")) {
    Result<DispatchDtype> d = train::parse_dispatch_dtype(args.dispatch_dtype);
    if (!d) return Status::error("--dispatch-dtype: " + d.status().message());
    config.dispatch_dtype = d.value();
  }
  PACKMOE_RETURN_IF_ERROR(train::validate(config, *model));
  if (config.expert_parallel > 1 && args.save_primary)
    return Status::error("--save-primary with --expert-parallel " +
                         std::to_string(config.expert_parallel) +
                         ": each rank holds only its experts' primary weights; the checkpoint's "
                         "masters hold every expert (quantize them with packmoe quantize)");
  settings.config = config;
  settings.model = *model;
  return settings;
}

// Everything one rank sets up before its first collective: flags, settings, checkpoint, output
// directories and the data. No collective inside, so a rank that fails here reaches the agreement
// right after it instead of leaving the others waiting.
struct SetUp {
  Start start;
  train::TrainConfig config;
  std::optional<ModelConfig> model;
  std::string description;  // of the training data
  int64_t train_tokens = 0, valid_tokens = 0;
  train::TrainData data;
  std::optional<ModelWeights> hf_weights;
  std::unique_ptr<tokenize::Tokenizer> tokenizer;  // --tokenizer (or the checkpoint's)
};

Result<SetUp> set_up(const TrainArgs& args) {
  SetUp set;
  if (args.save_interval < 0)
    return Status::error("--save-interval = " + std::to_string(args.save_interval) +
                         " must be >= 0");
  if (args.keep_last < 1)
    return Status::error("--keep-last = " + std::to_string(args.keep_last) + " must be >= 1");
  if (args.save_dir.empty() &&
      (args.cmd->count("--save-interval") || args.save_primary || args.overwrite))
    return Status::error("--save-interval, --save-primary and --overwrite need --save-dir");
  if (args.overwrite && !args.resume.empty())
    return Status::error("--overwrite starts a new run; --resume continues one: use one");
  // Outputs are writable, found out now rather than at the first write after the run.
  PACKMOE_RETURN_IF_ERROR(io::check_writable_dir(args.out, "--out"));
  if (!args.tensorboard.empty())
    PACKMOE_RETURN_IF_ERROR(io::check_writable_dir(args.tensorboard, "--tensorboard"));
  if (!args.save_dir.empty()) {
    PACKMOE_RETURN_IF_ERROR(io::check_writable_dir(args.save_dir, "--save-dir"));
    // A new run must not mix its checkpoints with another run's (--resume auto would continue
    // the other run's newest one).
    if (args.resume.empty() && !args.overwrite) {
      Result<std::vector<std::string>> found = io::checkpoint_dirs(args.save_dir);
      if (!found) return Status::error("--save-dir: " + found.status().message());
      if (!found.value().empty())
        return Status::error("--save-dir " + args.save_dir + " holds " +
                             std::to_string(found.value().size()) + " checkpoint(s) (newest " +
                             found.value().front() +
                             "): continue that run with --resume auto, or start a new one "
                             "there with --overwrite (deletes them), or use another --save-dir");
    }
  }
  Result<Start> start = resolve_start(args);  // every rank reads and checks the checkpoint
  if (!start) return start.status();
  set.start = std::move(start.value());
  const std::optional<train::TrainerCheckpoint>& checkpoint = set.start.checkpoint;
  if (checkpoint) {  // counts from trainer_state.json, in range before anything uses them
    const std::string state = (fs::path(checkpoint->dir) / "trainer_state.json").string() + ": ";
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"step", checkpoint->step},
                                      {"optimizer_steps", checkpoint->optimizer_steps}})
      if (Status s = train::check_step_count(name, value); !s)
        return Status::error(state + s.message());
    // Masters and moments finite, second moments >= 0: found now, not as a NaN loss steps later.
    PACKMOE_RETURN_IF_ERROR(io::check_finite(
        checkpoint->masters, (fs::path(checkpoint->dir) / io::kHfWeightsFile).string()));
    std::set<std::string> second_moments;
    for (const auto& [name, t] : checkpoint->masters)
      second_moments.insert(train::exp_avg_sq_name(name));
    PACKMOE_RETURN_IF_ERROR(io::check_finite(
        checkpoint->moments, checkpoint->dir + ": AdamW moments",
        [&](const std::string& name) { return second_moments.count(name) > 0; }));
  }

  Result<Settings> settings = resolve_settings(args, set.start);
  if (!settings) return settings.status();
  train::TrainConfig config = settings.value().config;
  const std::optional<ModelConfig> model = settings.value().model;
  set.tokenizer = std::move(settings.value().tokenizer);
  // Sizes against the machine before anything large is allocated (weights, data, activations).
  PACKMOE_RETURN_IF_ERROR(train::check_run_fits(config, *model, host_memory_bytes()));
  if (checkpoint && checkpoint->step >= config.steps)
    return Status::error("--resume: " + checkpoint->dir + " is at step " +
                         std::to_string(checkpoint->step) + ", not before steps = " +
                         std::to_string(config.steps) + ": nothing left to train (raise --steps)");
  std::optional<ModelWeights> hf_weights;
  if (set.start.hf_model) {
    Result<ModelWeights> w =
        read_with_progress("reading Hugging Face weights " + args.init_from_hf,
                           bytes_at(args.init_from_hf), set.start.read,
                           [&] { return io::load_hf_weights(args.init_from_hf, *model); });
    if (!w) return Status::error("--init-from-hf: " + w.status().message());
    PACKMOE_RETURN_IF_ERROR(io::check_finite(w.value(), "--init-from-hf " + args.init_from_hf));
    hf_weights = std::move(w.value());
  }

  // ---- data ----
  Result<train::StreamOptions> masking = document_masking(args);
  if (!masking) return masking.status();
  // With --valid-data the training sources are used whole; without it each source gives
  // valid_fraction of itself to validation (every source contributes).
  const bool own_validation = !args.valid_data.empty();
  Result<train::LoadedData> source =
      train::load_data(args.data, "--data", own_validation ? 0.0 : config.valid_fraction,
                       set.tokenizer.get());
  if (!source) return source.status();
  train::TrainData data;
  data.train = std::move(source.value().train);
  if (own_validation) {
    Result<train::LoadedData> valid =
        train::load_data(args.valid_data, "--valid-data", 0.0, set.tokenizer.get());
    if (!valid) return valid.status();
    data.validation = std::move(valid.value().train);
  } else {
    data.validation = std::move(source.value().validation);
  }
  if (config.eval_interval > 0 && !own_validation && config.valid_fraction == 0)
    return Status::error("--valid-fraction 0 holds no validation data back: give --valid-data "
                         "or --eval-interval 0");
  for (train::StreamOptions* stream : {&data.train_stream, &data.validation_stream}) {
    stream->document_mask = masking.value().document_mask;
    stream->eod_token = masking.value().eod_token;
    stream->reset_positions = masking.value().reset_positions;
  }
  int64_t train_tokens = 0, valid_tokens = 0;
  for (const auto& [blend, tokens] : {std::pair{&data.train, &train_tokens},
                                      std::pair{&data.validation, &valid_tokens}})
    for (const train::DataSource& src : blend->sources)
      for (const io::TokenRange& r : src.documents) *tokens += static_cast<int64_t>(r.size());

  set.data = std::move(data);
  set.hf_weights = std::move(hf_weights);
  set.config = config;
  set.model = model;
  set.description = source.value().description;
  set.train_tokens = train_tokens;
  set.valid_tokens = valid_tokens;
  return set;
}

// --dry-run RANKS: the memory plan of a job of RANKS ranks (train/memory_plan.h), from the
// settings alone: no model, no data, no output directory, no comparison with this machine.
Status run_dry_run(const TrainArgs& args) {
  const int64_t ranks = args.dry_run_ranks;
  if (ranks < 1 || ranks > train::kMaxRanks)
    return Status::error("--dry-run " + std::to_string(ranks) +
                         ": the job's ranks must be in [1, " + std::to_string(train::kMaxRanks) +
                         "]");
  // Both would check the model against this machine's memory (load_model_config).
  if (!args.resume.empty() || !args.init_from_hf.empty())
    return Status::error("--dry-run plans a model from --preset or --config: give the config.json "
                         "of the --resume checkpoint or the --init-from-hf directory as --config");
  Start start;
  Result<Settings> settings = resolve_settings(args, start);
  if (!settings) return settings.status();
  for (const std::string& w : start.warnings)
    std::fprintf(stderr, "packmoe: warning: %s\n", w.c_str());
  const train::TrainConfig& config = settings.value().config;
  const ModelConfig& model = settings.value().model;
  PACKMOE_RETURN_IF_ERROR(train::check_job_layout(model, config, ranks).status());
  const int ep = static_cast<int>(config.expert_parallel);
  Result<train::MemoryPlan> planned =
      train::plan_memory(model, config.precision, config.gather_mode, static_cast<int>(ranks), ep,
                         train::TrainerParallelism{}.bucket_elems);
  if (!planned) return planned.status();
  const train::MemoryPlan& plan = planned.value();
  const train::ParameterCount count = train::parameter_count(model);
  const train::RankMemory& top = plan.largest();
  const train::RankMemory& least = *std::min_element(
      plan.ranks.begin(), plan.ranks.end(),
      [](const auto& a, const auto& b) { return a.total_bytes() < b.total_bytes(); });
  auto gb = [](int64_t bytes) { return static_cast<double>(bytes) / 1e9; };
  std::printf("packmoe train --dry-run: %lld ranks, expert parallel %d (%lld of %lld experts per "
              "rank); experts: recipe %s, primary %s; gather mode %s\n",
              static_cast<long long>(ranks), ep,
              static_cast<long long>(ep > 1 ? model.num_experts / ep : model.num_experts),
              static_cast<long long>(model.num_experts),
              recipe_name(config.precision.recipe.recipe),
              train::primary_name(config.precision.primary),
              std::string(gather_mode_name(config.gather_mode)).c_str());
  std::printf("  model: %lld parameters (%lld active per token); nothing allocated, no data read\n",
              static_cast<long long>(count.total), static_cast<long long>(count.active));
  std::printf("  largest rank: %d of %lld (smallest: rank %d, %.2f GB)\n", top.rank,
              static_cast<long long>(ranks), least.rank, gb(least.total_bytes()));
  std::printf("  rank %d holds %lld parameters (%lld dense + %lld of its experts)\n", top.rank,
              static_cast<long long>(top.params()), static_cast<long long>(top.dense_params),
              static_cast<long long>(top.expert_params));
  const std::pair<const char*, int64_t> lines[] = {
      {"primary weights", top.weight_bytes},       {"FP32 replicas", top.fp32_replica_bytes()},
      {"FP32 gradients", top.grad_bytes()},        {"FP32 masters", top.master_bytes()},
      {"AdamW moments", top.moment_bytes()},       {"gather buffers", top.gather_buffer_bytes()},
      {"total", top.total_bytes()}};
  for (const auto& [name, bytes] : lines)
    std::printf("    %-16s %9.2f GB  (%lld bytes)\n", name, gb(bytes),
                static_cast<long long>(bytes));
  const auto over = [](int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); };
  std::printf("  per step: all-gather %.2f GB, reduce-scatter %.2f GB over %s (%s",
              gb(top.dense.all_gather_bytes), gb(top.dense.reduce_scatter_bytes),
              over(top.dense.ranks).c_str(), top.experts.ranks > 0 ? "dense" : "every parameter");
  if (top.experts.ranks > 0)
    std::printf("); all-gather %.2f GB, reduce-scatter %.2f GB over %s (experts",
                gb(top.experts.all_gather_bytes), gb(top.experts.reduce_scatter_bytes),
                over(top.experts.ranks).c_str());
  std::printf(")\n");
  if (ep > 1) {
    const train::AllToAllPlan a = train::plan_all_to_all(
        model, config.precision.recipe.recipe, config.dispatch_dtype, ep,
        config.micro_batch_size * config.seq_len, config.grad_accum_steps);
    std::printf("  expert all-to-all per step and rank (%lld MoE layers, dispatch %s: %lld B per "
                "row): %.2f GB to peers with even routing, at most %.2f GB sent; receive buffers "
                "up to %.2f GB per dispatch\n",
                static_cast<long long>(a.moe_layers), dispatch_dtype_name(config.dispatch_dtype),
                static_cast<long long>(a.dispatch_row_bytes), gb(a.even_remote_bytes_per_step),
                gb(a.max_bytes_per_step), gb(a.max_receive_bytes));
  }
  std::printf("  not counted: activations, GEMM and attention workspace, the CUDA context "
              "(docs/dist.md)\n");
  return Status::ok();
}

}  // namespace

Status run_train(const TrainArgs& args) {
  if (args.cmd->count("--dry-run")) return run_dry_run(args);
  Result<Placement> placed = place_job(args);
  if (!placed) return placed.status();
  Backend* const backend = placed.value().backend;
  std::unique_ptr<Communicator> comm = std::move(placed.value().comm);
  const bool rank0 = !comm || comm->rank() == 0;
  if (!rank0 && !std::freopen("/dev/null", "w", stdout))
    return Status::error("cannot silence stdout on rank " + std::to_string(comm->rank()));
  // Every rank's set-up reaches this one agreement before any other collective.
  Result<SetUp> made = set_up(args);
  PACKMOE_RETURN_IF_ERROR(agreed(comm.get(), made ? Status::ok() : made.status()));
  SetUp& set = made.value();
  if (rank0)
    for (const std::string& w : set.start.warnings) std::fprintf(stderr, "packmoe: warning: %s\n", w.c_str());
  const int64_t train_tokens = set.train_tokens, valid_tokens = set.valid_tokens;
  // The trainer shards the optimizer over the ranks (collectives); a resumed optimizer takes the
  // checkpoint's state re-split for this job's world size.
  const ModelWeights* init = set.hf_weights ? &*set.hf_weights : nullptr;
  train::TrainerParallelism parallel;
  parallel.comm = comm.get();
  const train::ParameterCount params = train::parameter_count(*set.model);
  std::optional<ProgressLine> building;
  if (rank0)
    building.emplace((set.start.checkpoint ? std::string("building the model from the checkpoint")
                      : init ? std::string("building the model from the Hugging Face weights")
                             : "initialising " + short_count(params.total) + " parameters") +
                         " on " + backend->name(),
                     0, ProgressLine::wanted());
  Result<std::unique_ptr<train::Trainer>> trainer =
      set.start.checkpoint
          ? train::Trainer::resume(*backend, *set.start.checkpoint, set.config,
                                   std::move(set.data), parallel)
          : train::Trainer::create(*backend, *set.model, set.config, std::move(set.data), init,
                                   parallel);
  building.reset();
  PACKMOE_RETURN_IF_ERROR(agreed(comm.get(), trainer ? Status::ok() : trainer.status()));
  // The trainer holds its own copies: the host weights of the start (the whole model, and a
  // checkpoint's moments) are freed for the rest of the run.
  set.hf_weights.reset();
  if (set.start.checkpoint) {
    set.start.checkpoint->masters.clear();
    set.start.checkpoint->moments.clear();
  }

  // ---- outputs ----
  const Start& start = set.start;
  const std::optional<train::TrainerCheckpoint>& checkpoint = start.checkpoint;
  const train::TrainConfig& config = set.config;
  const std::optional<ModelConfig> model = set.model;
  const std::string config_path = (fs::path(args.out) / "config.json").string();
  const std::string metrics_path = (fs::path(args.out) / "metrics.jsonl").string();
  const std::string plot_path = (fs::path(args.out) / "loss.svg").string();
  // Rank 0 writes; the ranks agree on the outcome, so a failure here ends every rank together.
  auto write_outputs = [&]() -> Status {
    if (!rank0) return Status::ok();
    if (args.overwrite && !checkpoint)
      PACKMOE_RETURN_IF_ERROR(io::remove_checkpoints(args.save_dir));
    std::error_code ec;
    fs::create_directories(args.out, ec);
    if (ec)
      return Status::error("--out " + args.out + ": cannot create the directory: " + ec.message());
    if (!config.tokenizer.empty())  // a copy beside config.json, should the original move
      PACKMOE_RETURN_IF_ERROR(tokenize::copy_tokenizer_files(config.tokenizer, args.out).status());
    return train::save_model_config(*model, config_path);
  };
  PACKMOE_RETURN_IF_ERROR(agreed(comm.get(), write_outputs()));

  std::printf("packmoe train: %lld parameters (%lld active per token) on %s\n",
              static_cast<long long>(params.total), static_cast<long long>(params.active),
              backend->name().c_str());
  std::printf("  experts: recipe %s, primary %s, layout %s | recompute %s | data: %s, %s, %lld "
              "train / %lld validation tokens\n",
              recipe_name(config.precision.recipe.recipe), train::primary_name(config.precision.primary),
              train::layout_name(config.precision.layout), train::recompute_name(config.recompute),
              set.description.c_str(),
              config.shuffle ? "shuffled" : "in file order", static_cast<long long>(train_tokens),
              static_cast<long long>(valid_tokens));
  if (config.eval_interval > 0 && trainer.value()->eval_batches() < config.eval_batches)
    std::printf("  evaluation: %lld of the %lld --eval-batches (the validation data holds no "
                "more distinct rows)\n",
                static_cast<long long>(trainer.value()->eval_batches()),
                static_cast<long long>(config.eval_batches));
  std::printf("  %lld steps x %lld micro-batches x %lld rows x %lld tokens, lr %g -> %g\n",
              static_cast<long long>(config.steps), static_cast<long long>(config.grad_accum_steps),
              static_cast<long long>(config.micro_batch_size),
              static_cast<long long>(config.seq_len), config.lr, config.min_lr);
  if (comm) {
    const GatherTraffic& t = trainer.value()->optimizer().traffic();
    std::printf("  data parallel: %d ranks (%s), global batch %lld rows per step; gather mode %s: "
                "%.2f MB all-gathered (%.4f B/param), %.2f MB reduce-scattered per step\n",
                comm->size(), std::string(comm_kind_name(comm->kind())).c_str(),
                static_cast<long long>(comm->size() * config.grad_accum_steps *
                                       config.micro_batch_size),
                std::string(gather_mode_name(config.gather_mode)).c_str(),
                static_cast<double>(t.all_gather_bytes) / 1e6, t.bytes_per_element(),
                static_cast<double>(t.reduce_scatter_bytes) / 1e6);
  }
  if (DistOptimizer* experts = trainer.value()->parallel_optimizer().experts()) {
    const GatherTraffic& t = experts->traffic();
    std::printf("  expert parallel: EP %lld (groups of %lld consecutive ranks), %lld of %lld "
                "experts per rank; the experts' optimizer over %d ranks: %.2f MB all-gathered, "
                "%.2f MB reduce-scattered per step\n",
                static_cast<long long>(config.expert_parallel),
                static_cast<long long>(config.expert_parallel),
                static_cast<long long>(model->num_experts / config.expert_parallel),
                static_cast<long long>(model->num_experts), comm->size() /
                static_cast<int>(config.expert_parallel),
                static_cast<double>(t.all_gather_bytes) / 1e6,
                static_cast<double>(t.reduce_scatter_bytes) / 1e6);
    const train::AllToAllPlan a = train::plan_all_to_all(
        *model, config.precision.recipe.recipe, config.dispatch_dtype,
        static_cast<int>(config.expert_parallel), config.micro_batch_size * config.seq_len,
        config.grad_accum_steps);
    std::printf("  expert all-to-all per step (dispatch %s: %lld B per row): %.2f MB to peers with "
                "even routing, at most %.2f MB sent; receive buffers up to %.2f MB per dispatch\n",
                dispatch_dtype_name(config.dispatch_dtype),
                static_cast<long long>(a.dispatch_row_bytes),
                static_cast<double>(a.even_remote_bytes_per_step) / 1e6,
                static_cast<double>(a.max_bytes_per_step) / 1e6,
                static_cast<double>(a.max_receive_bytes) / 1e6);
  }
  if (comm) {
    // This rank's optimizer memory (both optimizers under expert parallelism).
    int64_t grads = 0, shard = 0;
    const DistOptimizer* both[2] = {&trainer.value()->optimizer(),
                                    trainer.value()->parallel_optimizer().experts()};
    for (const DistOptimizer* o : both) {
      if (o == nullptr) continue;
      grads += o->plan().total();
      shard += o->shard().size();
    }
    std::printf("  per rank: FP32 gradients %.2f MB, masters %.2f MB, AdamW moments %.2f MB\n",
                4.0 * static_cast<double>(grads) / 1e6, 4.0 * static_cast<double>(shard) / 1e6,
                8.0 * static_cast<double>(shard) / 1e6);
  }
  for (const std::string& note : start.notes) std::printf("  %s\n", note.c_str());
  if (start.read.bytes > 0) {
    const double rate = start.read.seconds > 0 ? start.read.bytes / start.read.seconds : 0.0;
    std::printf("  read %s in %.1f s (%s/s)\n",
                short_bytes(static_cast<double>(start.read.bytes)).c_str(), start.read.seconds,
                short_bytes(rate).c_str());
  }
  const train::StartupTimes& t = trainer.value()->startup_times();
  if (!start.hf_model && !checkpoint)
    std::printf("  start-up: weights initialised on %s in %.2f s, model %.2f s, optimizer %.2f s\n",
                backend->name().c_str(), t.weights, t.model, t.optimizer);
  else if (!checkpoint)
    std::printf("  start-up: model %.2f s, optimizer %.2f s\n", t.model, t.optimizer);
  else
    std::printf("  start-up: model %.2f s, optimizer %.2f s, checkpoint state %.2f s\n", t.model,
                t.optimizer, t.state);
  if (checkpoint)
    std::printf("  resumed from %s at step %lld (saved by %lld rank(s), continued by %d)\n",
                checkpoint->dir.c_str(), static_cast<long long>(checkpoint->step),
                static_cast<long long>(checkpoint->world_size), comm ? comm->size() : 1);
  if (start.hf_model)
    std::printf("  initialised from Hugging Face weights in %s\n", args.init_from_hf.c_str());
  std::fflush(stdout);

  train::TrainLoopOptions loop;
  loop.metrics_path = rank0 ? metrics_path : std::string();
  // Under mpirun a rank's stdout is a pseudo-terminal even when the job's output goes to a file:
  // no bar there.
  loop.progress_bar = !launched_by_mpirun() && isatty(STDOUT_FILENO) != 0;
  loop.save_dir = args.save_dir;
  loop.save_interval = args.save_interval;
  loop.keep_last = args.keep_last;
  loop.save_primary = args.save_primary;
  loop.tensorboard_dir = rank0 ? args.tensorboard : std::string();
  Result<train::TrainSummary> summary = train::run_training(*trainer.value(), loop);
  PACKMOE_RETURN_IF_ERROR(agreed(comm.get(), summary ? Status::ok() : summary.status()));
  if (rank0) PACKMOE_RETURN_IF_ERROR(train::plot_metrics_file(metrics_path, plot_path));
  const train::TrainSummary& s = summary.value();
  std::printf("done in %s: train loss %.4f (step %lld) -> %.4f (mean of steps %lld-%lld)",
              train::format_duration(s.seconds).c_str(), s.first_loss,
              static_cast<long long>(s.first_step), s.last_loss,
              static_cast<long long>(s.last_interval_begin), static_cast<long long>(s.last_step));
  if (s.last_eval_loss) std::printf(", validation loss %.4f", *s.last_eval_loss);
  std::printf("\n  metrics: %s\n  plot:    %s\n  config:  %s\n", metrics_path.c_str(),
              plot_path.c_str(), config_path.c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
