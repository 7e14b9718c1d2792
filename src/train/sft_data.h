// Supervised fine-tuning data: a JSONL file of conversations ({"messages": [{"role", "content"},
// ...]}) or prompt / response pairs ({"prompt", "response"}), rendered with the tokenizer's chat
// template (tokenize/chat_template.h) or the plain one (docs/data.md), and tokenized with a loss
// flag per token. Invariant: a token is trained iff it is an assistant's content (or the template
// text between two pieces of one assistant message) or the special token that ends that turn;
// the pieces are tokenized apart, so no token straddles a trained and an untrained byte.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenize/chat_template.h"
#include "tokenize/tokenizer.h"

namespace packmoe::train {

struct SftConversation {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;  // (tokens) 1: a target with loss
  int64_t line = 0;              // of the JSONL file, 1-based
  uint64_t key = 0;              // io::document_hash of the line: the validation split's key
};

// How conversations become text: the tokenizer's chat template when it has one, else the plain
// template, which needs the tokenizer's eos.
class SftRenderer {
 public:
  // Errors: a chat template outside the supported subset (its line and construct), no template
  // and no eos.
  static Result<SftRenderer> create(const tokenize::Tokenizer& tokenizer);
  // Roles system | user | assistant; at least one assistant message, none empty.
  Result<SftConversation> encode(const std::vector<tokenize::ChatMessage>& messages) const;
  bool has_template() const { return tmpl_.has_value(); }

 private:
  explicit SftRenderer(const tokenize::Tokenizer& t) : tokenizer_(&t) {}
  Status append(std::string_view text, bool trained, SftConversation& out) const;
  Result<SftConversation> encode_plain(const std::vector<tokenize::ChatMessage>& messages) const;

  const tokenize::Tokenizer* tokenizer_;
  std::optional<tokenize::ChatTemplate> tmpl_;
  tokenize::ChatVariables vars_;
};

// Every non-blank line of `path`, in file order. Errors name FILE:LINE: not a JSON object, neither
// "messages" nor "prompt" / "response", a role other than system / user / assistant, an
// assistant message that is empty, a field that is not a string, an unknown message key.
Result<std::vector<SftConversation>> read_sft_file(const std::string& path,
                                                   const SftRenderer& renderer);

}  // namespace packmoe::train
