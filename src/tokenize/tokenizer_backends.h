// The two tokenizer implementations as factories, so that load_tokenizer (tokenize/tokenizer.cpp)
// needs neither's headers: a build without PCRE2 / ICU / SentencePiece (PACKMOE_TOKENIZERS,
// CMakeLists.txt) links tokenize/tokenizers_unavailable.cpp instead, whose factories refuse with
// one line saying what to install. Invariant: these are the only entries to the implementations.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenize/tokenizer.h"

namespace packmoe::tokenize {

// A parsed tokenizer.json (tokenize/hf_tokenizer.h).
Result<std::unique_ptr<Tokenizer>> make_hf_tokenizer(const nlohmann::json& json,
                                                     const TokenizerConfig& config,
                                                     std::vector<std::string> files);
// A SentencePiece .model file (tokenize/sentencepiece_tokenizer.h).
Result<std::unique_ptr<Tokenizer>> make_sentencepiece_tokenizer(const std::string& model_path,
                                                                const TokenizerConfig& config,
                                                                std::vector<std::string> files);

}  // namespace packmoe::tokenize
