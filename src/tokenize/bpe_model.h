// The BPE model of a byte-level Hugging Face tokenizer.json: a vocabulary of byte-level strings
// and merges ranked by their order in the file. A pre-token's bytes start as one symbol per byte
// (its byte-level character) and the adjacent pair of lowest rank is merged, leftmost first among
// equal ranks, until no ranked pair is left (tokenizers' models/bpe/word.rs merge_all).
// Invariant: after from_json every byte has a symbol id and every merge's result is in the
// vocabulary, so encode cannot fail.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace packmoe::tokenize {

class BpeModel {
 public:
  // `model` is tokenizer.json's "model" object; errors name the field ("model.merges[12]: ...").
  static Result<BpeModel> from_json(const nlohmann::json& model);

  // Appends the ids of one pre-token (raw bytes).
  void encode(std::string_view bytes, std::vector<uint32_t>* out) const;

  // The vocabulary: byte-level string -> id.
  const std::unordered_map<std::string, uint32_t>& vocab() const { return vocab_; }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t result;  // id of the merged symbol
  };
  static uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }

  std::unordered_map<std::string, uint32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank, result
  uint32_t byte_ids_[256] = {};                 // id of each byte's symbol
  bool ignore_merges_ = false;                  // a pre-token in the vocabulary is one token
};

}  // namespace packmoe::tokenize
