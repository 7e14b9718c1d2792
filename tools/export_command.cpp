// `packmoe export-hf`: a training checkpoint as a Hugging Face model directory (model.safetensors
// with Qwen3-MoE names, config.json, and the tokenizer files of the run when it had one) that
// Qwen3MoeForCausalLM.from_pretrained and AutoTokenizer load. Invariant: the checkpoint and the
// tokenizer are fully read and checked before OUT_DIR is touched; each file is atomic.
#include <cstdio>
#include <filesystem>

#include "tokenize/tokenizer.h"
#include "tools/commands.h"
#include "train/checkpoint.h"

namespace packmoe::tools {

void add_export_hf_command(CLI::App& app, ExportHfArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "export-hf",
      "Export the model of a packmoe checkpoint as a Hugging Face directory:\n"
      "OUT_DIR/model.safetensors (per-expert Qwen3-MoE names, BF16 rounded to nearest even by\n"
      "default) and OUT_DIR/config.json (Qwen3MoeConfig fields, architectures\n"
      "[\"Qwen3MoeForCausalLM\"], torch_dtype), loadable by\n"
      "Qwen3MoeForCausalLM.from_pretrained(OUT_DIR) and by `packmoe train --init-from-hf`.\n"
      "The weights are the FP32 masters (not the low-precision primary weights).");
  cmd->add_option("checkpoint", args.checkpoint,
                  "a checkpoint directory (step-XXXXXXXX holding complete.json), or a --save-dir "
                  "root: then its newest complete checkpoint")
      ->required();
  cmd->add_option("out", args.out, "output directory (created if missing)")->required();
  cmd->add_option("--dtype", args.dtype, "weight dtype: bf16 or f32 (default: bf16)");
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer files to copy beside the weights (tokenizer.json, a SentencePiece "
                  ".model, or a folder holding one); default: the one the run was trained with "
                  "(trainer_state.json's train.tokenizer), if any");
}

Status run_export_hf(const ExportHfArgs& args) {
  DType dtype;
  if (args.dtype == "bf16") {
    dtype = DType::kBF16;
  } else if (args.dtype == "f32") {
    dtype = DType::kF32;
  } else {
    return Status::error("--dtype must be bf16 or f32 (got '" + args.dtype + "')");
  }
  std::string tokenizer = args.tokenizer;
  if (tokenizer.empty()) {
    Result<std::string> recorded = train::checkpoint_tokenizer(args.checkpoint);
    if (!recorded) return recorded.status();
    tokenizer = recorded.value();
    if (!tokenizer.empty() && !std::filesystem::exists(tokenizer))
      return Status::error("the checkpoint's run was trained with the tokenizer " + tokenizer +
                           ", which is gone: give --tokenizer PATH (the run's --out directory "
                           "holds a copy)");
  }
  if (!tokenizer.empty()) {  // a tokenizer that does not load is not copied
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(tokenizer);
    if (!t) return Status::error("--tokenizer: " + t.status().message());
  }
  Result<std::string> from = train::export_hf(args.checkpoint, args.out, dtype);
  if (!from) return from.status();
  std::string copied;
  if (!tokenizer.empty()) {
    Result<std::vector<std::string>> names = tokenize::copy_tokenizer_files(tokenizer, args.out);
    if (!names) return names.status();
    for (const std::string& n : names.value()) copied += ", " + n;
  }
  std::printf("exported %s: wrote %s/model.safetensors (%s) and %s/config.json%s\n",
              from.value().c_str(), args.out.c_str(), args.dtype.c_str(), args.out.c_str(),
              copied.c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
