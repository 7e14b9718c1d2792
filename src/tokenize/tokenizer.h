// Tokenizer: text <-> token ids, behind one interface for the data tools (`packmoe tokenize`,
// train --tokenizer) and later SFT / eval / generate. Two implementations: Hugging Face
// `tokenizer.json` byte-level BPE (tokenize/hf_tokenizer.h) and SentencePiece `.model`
// (tokenize/sentencepiece_tokenizer.h). Invariant: a loaded Tokenizer is immutable, so encode and
// decode may be called from many threads at once; every id encode returns is < vocab_size().
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace packmoe::tokenize {

// What tokenizer_config.json says (each absent when the file or the key is).
struct TokenizerConfig {
  std::optional<std::string> eos_token, bos_token, pad_token, chat_template;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Ids of `text` (UTF-8) without any template tokens (Hugging Face's add_special_tokens=False):
  // special tokens written in the text are recognised as such. Invalid UTF-8 is an error naming
  // the byte offset.
  virtual Result<std::vector<uint32_t>> encode(std::string_view text) const = 0;
  // The text of `ids`; ids without a token (>= vocab_size, e.g. a model's padding rows) decode
  // to nothing, and with skip_special the special tokens too.
  virtual std::string decode(std::span<const uint32_t> ids, bool skip_special = false) const = 0;

  // One more than the largest id (vocabulary plus added tokens).
  virtual uint32_t vocab_size() const = 0;
  // The id of a token by its text: an added / special token ("<|im_end|>") or a vocabulary piece.
  virtual std::optional<uint32_t> token_id(std::string_view token) const = 0;
  virtual bool is_special(uint32_t id) const = 0;

  std::optional<uint32_t> eos_id() const { return eos_id_; }  // end of a document
  std::optional<uint32_t> bos_id() const { return bos_id_; }
  std::optional<uint32_t> pad_id() const { return pad_id_; }
  // tokenizer_config.json's "chat_template" (the Jinja source), when the files carry one.
  const std::optional<std::string>& chat_template() const { return chat_template_; }
  // "hf-bpe" or "sentencepiece", for messages.
  virtual const char* kind() const = 0;
  // The files that define this tokenizer (first: tokenizer.json or the .model; then
  // tokenizer_config.json and special_tokens_map.json where present): what export-hf copies.
  const std::vector<std::string>& files() const { return files_; }

 protected:
  // Sets eos / bos / pad from the config's names (an error naming the key when a name has no
  // id), keeping the implementation's defaults for names the config lacks, and the template.
  Status apply_config(const TokenizerConfig& config);

  std::optional<uint32_t> eos_id_, bos_id_, pad_id_;
  std::optional<std::string> chat_template_;
  std::vector<std::string> files_;
};

// PATH is a tokenizer.json, a SentencePiece .model, or a directory holding tokenizer.json
// (preferred) or tokenizer.model. Beside the file, tokenizer_config.json (if present) gives
// eos_token / bos_token / pad_token and chat_template. Every unsupported feature is an error
// naming the field (e.g. "tokenizer.json: normalizer.type 'NFKC' is not supported").
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path);

// The files a tokenizer at PATH consists of (as Tokenizer::files), without parsing them.
Result<std::vector<std::string>> tokenizer_files(const std::string& path);

// Copies the files of the tokenizer at PATH into `dir` (each atomically), under the names
// Hugging Face loaders look for: tokenizer.json or tokenizer.model (a SentencePiece file of any
// name), tokenizer_config.json, special_tokens_map.json, chat_template.jinja. Returns the names.
Result<std::vector<std::string>> copy_tokenizer_files(const std::string& path,
                                                      const std::string& dir);

// An error naming the first invalid byte unless `text` is well-formed UTF-8 (no overlong forms,
// no surrogates, nothing above U+10FFFF).
Status check_utf8(std::string_view text);

}  // namespace packmoe::tokenize
