// Resolving and reading generate's model (generate/model_source.h).
#include "generate/model_source.h"

#include <filesystem>

#include "core/json_limits.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/state_file.h"
#include "train/checkpoint.h"
#include "train/model_config.h"

namespace packmoe::generate {
namespace fs = std::filesystem;

namespace {

std::string in(const std::string& dir, const char* file) { return (fs::path(dir) / file).string(); }

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

}  // namespace

Result<ModelSource> find_model_source(const std::string& path, const std::string& tokenizer_flag) {
  ModelSource s;
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    return Status::error(path + ": no such directory (a checkpoint, a --save-dir root or a "
                         "Hugging Face model directory)");
  const bool hf = is_file(in(path, train::kConfigFile)) && !is_file(in(path, io::kCheckpointMarker));
  std::string tokenizer = tokenizer_flag;
  if (hf) {
    s.dir = path;
    if (!is_file(in(path, io::kHfWeightsFile)) && !is_file(in(path, io::kHfIndexFile)))
      return Status::error(path + ": has config.json but neither " + io::kHfWeightsFile +
                           " nor " + io::kHfIndexFile);
    if (tokenizer.empty() &&
        (is_file(in(path, "tokenizer.json")) || is_file(in(path, "tokenizer.model"))))
      tokenizer = path;
  } else {
    Result<std::string> dir = train::find_checkpoint(path, nullptr);
    if (!dir) return dir.status();
    s.checkpoint = true;
    s.dir = dir.value();
    if (tokenizer.empty()) {
      Result<std::string> recorded = train::checkpoint_tokenizer(s.dir);
      if (!recorded) return recorded.status();
      tokenizer = recorded.value();
      if (!tokenizer.empty() && !fs::exists(tokenizer, ec))
        return Status::error("the checkpoint's run was trained with the tokenizer " + tokenizer +
                             ", which is gone: give --tokenizer PATH (the run's --out directory "
                             "holds a copy)");
    }
  }
  const std::string config_path = in(s.dir, train::kConfigFile);
  std::vector<std::string> unknown;
  Result<ModelConfig> config = train::load_model_config(config_path, &unknown);
  if (!config) return config.status();
  if (!unknown.empty()) {
    std::string list;
    for (const std::string& k : unknown) list += (list.empty() ? "" : ", ") + printable_text(k, true);
    s.warnings.push_back(config_path + ": ignored " + std::to_string(unknown.size()) +
                         " key(s) packmoe does not know: " + list);
  }
  s.config = config.value();
  s.tokenizer = tokenizer;
  if (tokenizer.empty()) {
    Result<TextCodec> codec = TextCodec::bytes(s.config.vocab_size);
    if (!codec) return codec.status();
    s.codec = std::move(codec.value());
  } else {
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(tokenizer);
    if (!t) return Status::error("--tokenizer: " + t.status().message());
    Result<TextCodec> codec = TextCodec::from_tokenizer(std::move(t.value()), s.config.vocab_size);
    if (!codec) return codec.status();
    s.codec = std::move(codec.value());
  }
  return s;
}

Result<ModelWeights> load_weights(const ModelSource& s) {
  std::string from = s.dir;
  if (s.checkpoint) {
    PACKMOE_RETURN_IF_ERROR(io::verify_checkpoint(s.dir).status());
    from = in(s.dir, io::kHfWeightsFile);
  }
  Result<ModelWeights> w = io::load_hf_weights(from, s.config);
  if (!w) return w.status();
  PACKMOE_RETURN_IF_ERROR(io::check_finite(w.value(), from));
  return w;
}

}  // namespace packmoe::generate
