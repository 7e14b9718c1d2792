// Subcommands of the `packmoe` executable: flag registration and the run functions.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "train/train_config.h"

namespace packmoe::tools {

// "auto" picks CUDA when a GPU is usable, else the CPU.
Result<Backend*> backend_from_flag(const std::string& device);

struct DemoArgs {
  std::string device = "auto";
  std::string format = "all";
  int64_t experts = 8, rows = 256, cols = 512;
  uint64_t seed = 1;
};
void add_demo_command(CLI::App& app, DemoArgs& args);
Status run_demo(const DemoArgs& args);

struct QuantizeArgs {
  std::string device = "auto", format, element = "e4m3", in, out;
  std::vector<std::string> exclude;  // --exclude REGEX (given: replaces the default list)
  bool two_d = false, quiet = false;
};
void add_quantize_command(CLI::App& app, QuantizeArgs& args);
Status run_quantize(const QuantizeArgs& args);

struct DequantizeArgs {
  std::string device = "auto", dtype = "f32", in, out;
  bool quiet = false;
};
void add_dequantize_command(CLI::App& app, DequantizeArgs& args);
Status run_dequantize(const DequantizeArgs& args);

struct PlotArgs {
  std::vector<std::string> metrics, names;
  std::string out = "plot.svg", title;
  double smooth = 0;
  bool quiet = false;
};
void add_plot_command(CLI::App& app, PlotArgs& args);
Status run_plot(const PlotArgs& args);

// `packmoe train` (tools/train_command.cpp). Flags that set a TrainConfig field parse into
// `flags`; apply_flags copies those given on the command line over the config file's values.
struct TrainArgs {
  std::string config_file, preset = "tiny", recipe = "bf16", layout = "single", primary = "low";
  std::string gather_mode = "bf16", recompute = "none", dispatch_dtype = "bf16";
  std::string device = "auto", data = "fortunes", valid_data, out = "runs/train";
  std::string tokenizer;  // --tokenizer: text is tokenized with it, vocab_size comes from it
  int64_t decay_steps = 0;
  // Checkpoints: --save-dir, --save-interval, --keep-last, --save-primary; where to start from:
  // --resume DIR|auto or --init-from-hf DIR.
  std::string save_dir, resume, init_from_hf;
  int64_t save_interval = 0;
  int keep_last = 2;
  bool save_primary = false;
  std::string tensorboard;  // --tensorboard DIR: event files there (empty: none)
  bool overwrite = false;       // --overwrite: a new run may replace a save root's checkpoints
  double comm_timeout_s = 0;    // --comm-timeout, when given (CommOptions::timeout_s)
  // Attention over documents: --attention-mask causal|document, --eod-token, --reset-position-ids.
  std::string attention_mask = "causal";
  int64_t eod_token = -1;  // -1: documents from the data's document index
  bool reset_position_ids = false;
  bool shuffle = true;  // --shuffle / --no-shuffle, when given
  int64_t dry_run_ranks = 0;  // --dry-run RANKS: print the memory plan of RANKS ranks, train nothing
  train::TrainConfig flags;
  std::vector<std::function<void(const CLI::App&, const train::TrainConfig&, train::TrainConfig&)>>
      apply_flags;
  CLI::App* cmd = nullptr;  // to ask which flags were given
};
void add_train_command(CLI::App& app, TrainArgs& args);
Status run_train(const TrainArgs& args);

// `packmoe tokenize` (tools/tokenize_command.cpp).
struct TokenizeArgs {
  std::string tokenizer, output, json_key = "text", separator_line, eod_token;
  std::vector<std::string> inputs;
  int threads = 0;  // 0: tokenize::default_threads()
  bool add_bos = false, quiet = false;
};
void add_tokenize_command(CLI::App& app, TokenizeArgs& args);
Status run_tokenize(const TokenizeArgs& args);

// `packmoe export-hf` (tools/export_command.cpp).
struct ExportHfArgs {
  std::string checkpoint, out, dtype = "bf16";
  std::string tokenizer;  // --tokenizer: instead of the one the checkpoint's run used
};
void add_export_hf_command(CLI::App& app, ExportHfArgs& args);
Status run_export_hf(const ExportHfArgs& args);

// `packmoe generate` (tools/generate_command.cpp).
struct GenerateArgs {
  std::string model, prompt, tokenizer, device = "auto", recipe = "bf16";
  int64_t max_new_tokens = 64, top_k = 0;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
  bool json = false;
};
void add_generate_command(CLI::App& app, GenerateArgs& args);
Status run_generate(const GenerateArgs& args);

// `packmoe eval` (tools/eval_command.cpp).
struct EvalArgs {
  std::string checkpoint, data, split = "validation", batches, tokenizer, device = "auto";
  std::string attention_mask = "causal";
  std::optional<int64_t> micro_batch, seq_len;
  bool reset_position_ids = false, quiet = false;
  CLI::App* cmd = nullptr;
};
void add_eval_command(CLI::App& app, EvalArgs& args);
Status run_eval(const EvalArgs& args);

}  // namespace packmoe::tools
