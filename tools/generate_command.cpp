// `packmoe generate`: text from a checkpoint or a Hugging Face directory (docs/generate.md): the
// prompt through the tokenizer, greedy or seeded sampling over a KV cache (generate/generator.h),
// the text streamed to stdout as it is produced, or with --json one object with the ids. Invariant:
// every flag, the model's config, the tokenizer and the prompt's length are checked before the
// weights are read or anything is allocated.
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "generate/generator.h"
#include "generate/model_source.h"
#include "tools/commands.h"
#include "tools/exact_integer.h"
#include "train/train_config.h"

namespace packmoe::tools {

void add_generate_command(CLI::App& app, GenerateArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Continue a prompt with a trained model: a packmoe checkpoint (or a --save-dir root: its\n"
      "newest complete checkpoint) or a Hugging Face directory (an export-hf output). Greedy by\n"
      "default (--temperature 0); seeded sampling with --temperature, --top-k, --top-p, --seed.\n"
      "Stops at the tokenizer's end-of-sequence token, --max-new-tokens or the model's\n"
      "max_position_embeddings. Prints the prompt and the new text as it is produced (stdout), a\n"
      "summary on stderr; --json prints one JSON object with the token ids instead.");
  cmd->add_option("model", args.model,
                  "checkpoint directory, --save-dir root, or Hugging Face model directory")
      ->required();
  cmd->add_option("--prompt", args.prompt, "the text to continue")->required();
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer.json, a SentencePiece .model or a folder holding one (default: the "
                  "checkpoint run's tokenizer or the directory's own files; none: byte tokens)");
  cmd->add_option("--max-new-tokens", args.max_new_tokens, "tokens to generate at most (64)")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--temperature", args.temperature, "0: greedy (default); > 0: sampling");
  cmd->add_option("--top-k", args.top_k, "sample among the k most likely tokens (0: all)")
      ->check(exact_integer<int64_t>());
  cmd->add_option("--top-p", args.top_p,
                  "sample among the most likely tokens whose probabilities sum to p, in (0, 1]");
  cmd->add_option("--seed", args.seed, "seed of the sampling draws (0)")
      ->check(exact_integer<uint64_t>());
  cmd->add_option("--device", args.device, "auto (CUDA when a GPU is usable), cpu or cuda");
  cmd->add_option("--recipe", args.recipe,
                  "expert precision: bf16 (default), mxfp8, nvfp4 (quantized from the weights)");
  cmd->add_flag("--json", args.json, "print {prompt_ids, ids, text, stop, ...} instead of text");
}

namespace {

nlohmann::json id_array(std::span<const int32_t> ids) {
  nlohmann::json a = nlohmann::json::array();
  for (int32_t id : ids) a.push_back(id);
  return a;
}

}  // namespace

Status run_generate(const GenerateArgs& args) {
  generate::GenerateConfig config;
  config.max_new_tokens = args.max_new_tokens;
  config.sampling.temperature = args.temperature;
  config.sampling.top_k = args.top_k;
  config.sampling.top_p = args.top_p;
  config.sampling.seed = args.seed;
  PACKMOE_RETURN_IF_ERROR(generate::validate(config.sampling));
  if (config.max_new_tokens < 1)
    return Status::error("--max-new-tokens must be >= 1, got " +
                         std::to_string(config.max_new_tokens));
  Result<Recipe> recipe = train::parse_recipe(args.recipe);
  if (!recipe) return Status::error("--recipe: " + recipe.status().message());
  Result<Backend*> backend = backend_from_flag(args.device);
  if (!backend) return backend.status();

  Result<generate::ModelSource> source = generate::find_model_source(args.model, args.tokenizer);
  if (!source) return source.status();
  for (const std::string& w : source.value().warnings)
    std::fprintf(stderr, "packmoe: warning: %s\n", w.c_str());
  const ModelConfig& model_config = source.value().config;
  const generate::TextCodec& codec = source.value().codec;
  Result<std::vector<int32_t>> prompt = codec.encode(args.prompt);
  if (!prompt) return prompt.status();
  const int64_t n = static_cast<int64_t>(prompt.value().size());
  if (n == 0) return Status::error("--prompt is empty: give at least one token of text");
  if (n > model_config.max_position_embeddings)
    return Status::error("--prompt has " + std::to_string(n) + " tokens, more than the model's " +
                         "max_position_embeddings = " +
                         std::to_string(model_config.max_position_embeddings));
  config.stop_ids = codec.stop_ids();

  Result<ModelWeights> weights = generate::load_weights(source.value());
  if (!weights) return weights.status();
  ModelPrecision precision;
  precision.recipe.recipe = recipe.value();
  Model model(*backend.value(), model_config, precision, weights.value());
  weights.value().clear();

  // Streaming: the text of prompt + new ids, printed past what is already out, up to the last
  // complete UTF-8 character (a byte-level token may end inside one).
  std::vector<int32_t> all = prompt.value();
  const std::string prompt_text = codec.decode(all);
  size_t printed = 0;
  if (!args.json) {
    std::fwrite(prompt_text.data(), 1, prompt_text.size(), stdout);
    std::fflush(stdout);
    printed = prompt_text.size();
  }
  const auto start = std::chrono::steady_clock::now();
  Result<generate::GenerateResult> result = generate::generate(
      model, prompt.value(), config, [&](int32_t id, std::span<const float>) {
        all.push_back(id);
        if (args.json) return;
        const std::string text = codec.decode(all);
        const size_t ready = generate::complete_utf8_prefix(text);
        if (ready > printed) {
          std::fwrite(text.data() + printed, 1, ready - printed, stdout);
          std::fflush(stdout);
          printed = ready;
        }
      });
  if (!result) return result.status();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::vector<int32_t>& ids = result.value().ids;
  const char* stop = generate::stop_reason_name(result.value().stop);
  if (args.json) {
    nlohmann::json j;
    j["model"] = source.value().dir;
    j["device"] = backend.value()->name();
    j["tokenizer"] = codec.describe();
    j["prompt_ids"] = id_array(prompt.value());
    j["ids"] = id_array(ids);
    j["stop_ids"] = id_array(config.stop_ids);
    j["text"] = codec.decode(ids);
    j["stop"] = stop;
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    const std::string text = codec.decode(all);
    if (text.size() > printed) std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr,
                 "packmoe generate: %zu new tokens in %.2f s (%.1f tokens/s) on %s, stopped at "
                 "%s\n",
                 ids.size(), seconds, seconds > 0 ? ids.size() / seconds : 0.0,
                 backend.value()->name().c_str(), stop);
  }
  return Status::ok();
}

}  // namespace packmoe::tools
