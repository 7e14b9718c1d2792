// Text <-> token ids for `packmoe generate`: a loaded tokenizer (tokenize/tokenizer.h), or byte
// tokens (id = byte value, V = 256: what `packmoe train` uses without --tokenizer). Invariant:
// every id encode returns is < the vocabulary the codec was made for.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "tokenize/tokenizer.h"

namespace packmoe::generate {

class TextCodec {
 public:
  // Byte tokens for a model of vocab_size V: an error unless V = 256 (a model with another
  // vocabulary was trained with a tokenizer, which must then be given).
  static Result<TextCodec> bytes(int64_t vocab_size);
  // The tokenizer's ids, an error when the model's vocabulary is smaller than the tokenizer's.
  static Result<TextCodec> from_tokenizer(std::unique_ptr<tokenize::Tokenizer> tokenizer,
                                          int64_t vocab_size);

  Result<std::vector<int32_t>> encode(std::string_view text) const;
  // The text of `ids` (special tokens skipped; ids without a token decode to nothing).
  std::string decode(std::span<const int32_t> ids) const;
  // The tokens that end a generation: the tokenizer's eos (none for bytes).
  std::vector<int32_t> stop_ids() const;
  std::string describe() const;  // "byte tokens", "hf-bpe tokenizer" ...

 private:
  std::shared_ptr<const tokenize::Tokenizer> tokenizer_;  // null: bytes
};

// The length of the longest prefix of `text` that does not end inside a UTF-8 sequence (a
// streamed decode prints up to there and waits for the rest of the character).
size_t complete_utf8_prefix(std::string_view text);

}  // namespace packmoe::generate
