// SentencePiece `.model` tokenizers (Llama-1/2, Mistral, T5 and any spm_train model) through
// libsentencepiece. Ids, eos / bos / pad and the control tokens are the model's own;
// tokenizer_config.json beside the file may rename eos / bos / pad and carries the chat template.
// Invariant: encode equals SentencePieceProcessor::EncodeAsIds (no bos / eos added).
#pragma once

#include <memory>
#include <string>

#include "tokenize/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace packmoe::tokenize {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Loads `model_path`; a file that is not a SentencePiece model is an error naming it.
  static Result<std::unique_ptr<SentencePieceTokenizer>> load(const std::string& model_path,
                                                              const TokenizerConfig& config,
                                                              std::vector<std::string> files);
  ~SentencePieceTokenizer() override;

  Result<std::vector<uint32_t>> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids, bool skip_special = false) const override;
  uint32_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> token_id(std::string_view token) const override;
  bool is_special(uint32_t id) const override;
  const char* kind() const override { return "sentencepiece"; }

 private:
  SentencePieceTokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  uint32_t vocab_size_ = 0;
};

}  // namespace packmoe::tokenize
