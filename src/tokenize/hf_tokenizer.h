// Hugging Face `tokenizer.json` tokenizers of the byte-level BPE kind (GPT-2, Qwen2/3, Llama-3):
// added tokens split out first, optional NFC normalizer, Split / ByteLevel pre-tokenizers (PCRE2
// regexes), the BPE model by merge rank, the ByteLevel decoder. Anything else in the file is an
// error naming the field; what is accepted and ignored is listed in docs/tokenizers.md.
// Invariant: encode equals tokenizers' `encode(text, add_special_tokens=False).ids`.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenize/bpe_model.h"
#include "tokenize/regex.h"
#include "tokenize/tokenizer.h"

namespace packmoe::tokenize {

class HfTokenizer final : public Tokenizer {
 public:
  // `json` is the parsed tokenizer.json; `config` tokenizer_config.json's settings.
  static Result<std::unique_ptr<HfTokenizer>> create(const nlohmann::json& json,
                                                     const TokenizerConfig& config,
                                                     std::vector<std::string> files);

  Result<std::vector<uint32_t>> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids, bool skip_special = false) const override;
  uint32_t vocab_size() const override { return static_cast<uint32_t>(id_to_token_.size()); }
  std::optional<uint32_t> token_id(std::string_view token) const override;
  bool is_special(uint32_t id) const override { return id < special_.size() && special_[id]; }
  const char* kind() const override { return "hf-bpe"; }

 private:
  struct AddedToken {
    std::string content;
    uint32_t id = 0;
    bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
  };
  // Added tokens of one class (normalized or not), longest first per first byte.
  struct AddedMatcher {
    std::vector<const AddedToken*> by_first_byte[256];
    bool empty = true;
  };
  struct PreTokenizerStep {
    std::optional<Regex> split;   // Split (Isolated); none: ByteLevel
    bool add_prefix_space = false;  // ByteLevel
  };

  HfTokenizer() = default;
  Status parse_added_tokens(const nlohmann::json& added);
  Status parse_pre_tokenizer(const nlohmann::json& pre, const std::string& field);
  // Emits text stretches to `on_text` and added-token ids to `out`, in order.
  template <typename OnText>
  void split_added(std::string_view text, const AddedMatcher& m, std::vector<uint32_t>* out,
                   OnText&& on_text) const;
  void encode_plain(std::string_view text, std::vector<uint32_t>* out) const;

  std::vector<AddedToken> added_;
  AddedMatcher raw_added_, normalized_added_;
  std::unordered_map<std::string, uint32_t> added_ids_;
  bool nfc_ = false;
  std::vector<PreTokenizerStep> steps_;
  BpeModel bpe_;
  std::optional<Regex> word_char_;         // single_word's neighbour test
  std::vector<std::string> id_to_token_;   // (V); "" where no token has the id
  std::vector<uint8_t> special_;           // (V)
};

}  // namespace packmoe::tokenize
