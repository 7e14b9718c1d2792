// `packmoe eval`: the lm loss and perplexity of a checkpoint's model over a data set (its
// validation side, by default as the training run split it, or all of it), forwards only: the
// model from the checkpoint's masters, no optimizer, no gradient. Invariant: with the run's data,
// masking flags and batch shape it reads the rows the run's evaluation read, and its loss is the
// run's validation loss (the same mean over every target, Trainer::evaluate); every input is
// checked before the model is built.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/read_file.h"
#include "io/state_file.h"
#include "tokenize/tokenizer.h"
#include "tools/commands.h"
#include "tools/exact_integer.h"
#include "train/checkpoint.h"
#include "train/data_sources.h"
#include "train/model_config.h"
#include "train/train_config.h"

namespace packmoe::tools {
namespace {

namespace fs = std::filesystem;

// Rows an evaluation of `--batches all` reads at most: every distinct row before one repeats.
constexpr int64_t kAllBatches = int64_t{1} << train::kMaxAccumBits;

// The TrainConfig of the run that wrote the checkpoint (trainer_state.json's "train").
Result<train::TrainConfig> checkpoint_train_config(const std::string& dir) {
  const std::string state = (fs::path(dir) / train::kTrainerStateFile).string();
  Result<std::string> text = io::read_regular_file(state, io::kMaxJsonFileBytes);
  if (!text) return text.status();
  Result<nlohmann::json> j = parse_json_text(text.value(), state);
  if (!j) return j.status();
  if (!j.value().is_object() || !j.value().contains("train"))
    return Status::error(state + ": no \"train\" settings");
  train::TrainConfig config;
  Status s = train::apply_train_json(j.value()["train"], &config);
  if (!s) return Status::error(state + ": " + s.message());
  return config;
}

}  // namespace

void add_eval_command(CLI::App& app, EvalArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Loss and perplexity of a checkpoint's model over a data set: forwards only (no optimizer,\n"
      "no gradient). By default it reads the validation side of --data as the training run split\n"
      "it, the run's --eval-batches micro-batches of its shape, so the loss is the validation\n"
      "loss the run printed (give the run's --attention-mask flags too). Prints a one-line\n"
      "result and a JSON line.");
  cmd->add_option("checkpoint", args.checkpoint,
                  "a checkpoint directory (step-XXXXXXXX) or a --save-dir root: its newest "
                  "complete checkpoint")
      ->required();
  cmd->add_option("--data", args.data,
                  "the data, in train's --data forms (fortunes, text:PATH, megatron:PREFIX, "
                  "llmc:SHARD, sft:FILE.jsonl, or a blend)")
      ->required();
  cmd->add_option("--split", args.split,
                  "validation: the side the run held out (its --valid-fraction); all: every "
                  "source whole (default: validation)");
  cmd->add_option("--batches", args.batches,
                  "micro-batches to read: a count, or all (every distinct row, whole batches); "
                  "default: the run's --eval-batches");
  cmd->add_option("--micro-batch", args.micro_batch, "rows per micro-batch (default: the run's)")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--seq-len", args.seq_len, "tokens per row (default: the run's)")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer for text and SFT data (default: the one the run was trained with)");
  cmd->add_option("--device", args.device, "cpu, cuda or auto (default: auto)");
  cmd->add_option("--attention-mask", args.attention_mask,
                  "causal or document, as the run trained (default: causal)");
  cmd->add_flag("--reset-position-ids", args.reset_position_ids,
                "with --attention-mask document: positions restart at each document");
  cmd->add_flag("--quiet", args.quiet, "no progress line");
  args.cmd = cmd;
}

Status run_eval(const EvalArgs& args) {
  // ---- every input, before the model is built ----
  if (args.split != "validation" && args.split != "all")
    return Status::error("--split must be validation or all (got '" + args.split + "')");
  if (args.attention_mask != "causal" && args.attention_mask != "document")
    return Status::error("--attention-mask " + args.attention_mask +
                         ": expected causal or document");
  if (args.reset_position_ids && args.attention_mask != "document")
    return Status::error("--reset-position-ids needs --attention-mask document");
  Result<std::string> dir = train::find_checkpoint(args.checkpoint, nullptr);
  if (!dir) return dir.status();
  Result<io::CheckpointInfo> info = io::verify_checkpoint(dir.value());
  if (!info) return info.status();
  Result<ModelConfig> model =
      train::load_model_config((fs::path(dir.value()) / train::kConfigFile).string());
  if (!model) return model.status();
  Result<train::TrainConfig> run = checkpoint_train_config(dir.value());
  if (!run) return run.status();
  train::TrainConfig config = run.value();
  if (args.micro_batch) config.micro_batch_size = *args.micro_batch;
  if (args.seq_len) config.seq_len = *args.seq_len;
  int64_t batches = config.eval_batches;
  if (args.batches == "all") {
    batches = kAllBatches;
  } else if (!args.batches.empty()) {
    char* end = nullptr;
    const long long n = std::strtoll(args.batches.c_str(), &end, 10);
    if (end == args.batches.c_str() || *end != '\0' || n < 1 || n > kAllBatches)
      return Status::error("--batches must be a count in [1, " + std::to_string(kAllBatches) +
                           "] or all (got '" + args.batches + "')");
    batches = n;
  }
  PACKMOE_RETURN_IF_ERROR(train::validate(config, model.value()));
  PACKMOE_RETURN_IF_ERROR(train::check_run_fits(config, model.value(), host_memory_bytes()));
  const std::string tokenizer_path = args.tokenizer.empty() ? config.tokenizer : args.tokenizer;
  std::unique_ptr<tokenize::Tokenizer> tokenizer;
  if (!tokenizer_path.empty()) {
    if (args.tokenizer.empty() && !fs::exists(tokenizer_path))
      return Status::error("the checkpoint's run was trained with the tokenizer " + tokenizer_path +
                           ", which is gone: give --tokenizer PATH");
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(tokenizer_path);
    if (!t) return Status::error("--tokenizer: " + t.status().message());
    tokenizer = std::move(t.value());
    if (model.value().vocab_size < static_cast<int64_t>(tokenizer->vocab_size()))
      return Status::error("the model's vocab_size = " + std::to_string(model.value().vocab_size) +
                           " is smaller than the tokenizer's " +
                           std::to_string(tokenizer->vocab_size()));
  }
  const bool validation = args.split == "validation";
  if (validation && config.valid_fraction == 0)
    return Status::error(
        "the run held no validation data back (valid_fraction 0): give its "
        "--valid-data as --data with --split all");
  Result<train::LoadedData> data = train::load_data(
      args.data, "--data", validation ? config.valid_fraction : 0.0, tokenizer.get());
  if (!data) return data.status();
  train::StreamOptions stream;
  stream.shuffle = config.shuffle;
  stream.seed = config.seed;
  if (args.attention_mask == "document") {
    stream.document_mask = train::DocumentMask::kIndex;
    stream.reset_positions = args.reset_position_ids;
  }
  Result<std::vector<Batch>> rows = train::fixed_batches(
      std::move(validation ? data.value().validation : data.value().train),
      model.value().vocab_size, config.micro_batch_size, config.seq_len, batches, stream);
  if (!rows) return rows.status();
  Result<Backend*> backend = backend_from_flag(args.device);
  if (!backend) return backend.status();
  Result<ModelWeights> weights =
      io::load_hf_weights((fs::path(dir.value()) / io::kHfWeightsFile).string(), model.value());
  if (!weights) return weights.status();
  PACKMOE_RETURN_IF_ERROR(io::check_finite(weights.value(), dir.value()));

  // ---- the forwards ----
  ModelPrecision precision = config.precision;
  precision.recipe.sr_seed = config.seed;
  Model m(*backend.value(), model.value(), precision, weights.value());
  weights.value().clear();
  const bool progress = !args.quiet && isatty(STDERR_FILENO) != 0;
  double loss_sum = 0;  // lm loss x targets, as Trainer::evaluate
  int64_t targets = 0;
  const size_t n = rows.value().size();
  for (size_t i = 0; i < n; ++i) {
    Result<ForwardLosses> losses = m.forward(rows.value()[i]);
    if (!losses) return losses.status();
    loss_sum += static_cast<double>(losses.value().lm_loss) *
                static_cast<double>(losses.value().target_tokens);
    targets += losses.value().target_tokens;
    if (progress)
      std::fprintf(stderr, "\r\033[Keval: batch %zu/%zu, loss %.4f", i + 1, n,
                   targets ? loss_sum / static_cast<double>(targets) : 0.0);
  }
  if (progress) std::fprintf(stderr, "\r\033[K");
  if (targets == 0)
    return Status::error("the batches have no target (every token's loss is masked)");
  const double loss = loss_sum / static_cast<double>(targets);
  const double perplexity = std::exp(loss);
  const Batch& first = rows.value().front();
  std::printf(
      "eval %s: loss %.4f, perplexity %.4f over %lld targets (%zu batches of %lld x %lld "
      "tokens, %s of %s) on %s\n",
      dir.value().c_str(), loss, perplexity, static_cast<long long>(targets), n,
      static_cast<long long>(first.batch), static_cast<long long>(first.seq),
      validation ? "the validation side" : "all", data.value().description.c_str(),
      backend.value()->name().c_str());
  nlohmann::json j = {{"checkpoint", dir.value()},
                      {"step", info.value().step},
                      {"split", args.split},
                      {"loss", loss},
                      {"perplexity", perplexity},
                      {"targets", targets},
                      {"batches", n},
                      {"micro_batch_size", first.batch},
                      {"seq_len", first.seq}};
  std::printf("%s\n", j.dump().c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
