// The tokenizer factories of a build without PCRE2, ICU or libsentencepiece (CMakeLists.txt,
// PACKMOE_TOKENIZERS): every load is refused with one line naming the packages. Everything else
// (byte-level text, Megatron and llm.c token files) works as usual in such a build.
#include "tokenize/tokenizer_backends.h"

namespace packmoe::tokenize {
namespace {

Status unavailable(const std::string& what) {
  return Status::error(what + ": this packmoe was built without tokenizers (libpcre2-dev, "
                              "libicu-dev or libsentencepiece-dev was missing): install them "
                              "(scripts/install-deps.sh) and reconfigure");
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> make_hf_tokenizer(const nlohmann::json&, const TokenizerConfig&,
                                                     std::vector<std::string> files) {
  return unavailable(files.empty() ? "tokenizer.json" : files.front());
}

Result<std::unique_ptr<Tokenizer>> make_sentencepiece_tokenizer(const std::string& model_path,
                                                                const TokenizerConfig&,
                                                                std::vector<std::string>) {
  return unavailable(model_path);
}

}  // namespace packmoe::tokenize
