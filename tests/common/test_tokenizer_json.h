// A small byte-level BPE tokenizer.json for the tokenizer tests, written by hand: the 256 byte
// symbols of GPT-2's alphabet with id = byte value (the alphabet rebuilt here from its definition
// in openai/gpt-2 encoder.py, independently of tokenize/byte_level.cpp), 16 merges, 4 added
// tokens, and the Qwen2 pre-tokenizer (Split with Qwen's regex, then ByteLevel) or GPT-2's
// (ByteLevel with its own regex). tests/unit/test_hf_tokenizer.cpp derives its expected ids by
// hand from this table.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace packmoe::test {

// The UTF-8 of byte b's symbol: printable Latin-1 keeps its code point, the other 68 bytes take
// U+0100, U+0101, ... in byte order.
inline std::string gpt2_byte_symbol(int b) {
  auto printable = [](int c) {
    return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  unsigned cp = static_cast<unsigned>(b);
  if (!printable(b)) {
    cp = 256;
    for (int c = 0; c < b; ++c) cp += printable(c) ? 0 : 1;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Merges in rank order and the ids of their results (256 + rank).
//   0 h e -> 256   1 l l -> 257   2 he ll -> 258   3 hell o -> 259   4 Ġ w -> 260
//   5 o r -> 261   6 Ġw or -> 262 7 l d -> 263     8 Ġwor ld -> 264  9 s a -> 265
//   10 ' s -> 266  11 ' t -> 267  12 1 2 -> 268    13 e l -> 269     14 ¥ x -> 270
//   15 ! ã -> 271 (ã: byte E3's symbol, the first byte of U+3000)
// Added: <|endoftext|> 272 (special), <|im_start|> 273 (special), <|im_end|> 274 (special),
// <think> 275 (not special). vocab_size 276.
enum class PreTokenizer { kQwen, kGpt2 };

inline nlohmann::json test_tokenizer_json(PreTokenizer pre = PreTokenizer::kQwen) {
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[gpt2_byte_symbol(b)] = b;
  const std::string G = gpt2_byte_symbol(' ');  // "Ġ"
  const std::string yen = "\xC2\xA5";           // byte 0xA5's symbol is U+00A5 itself
  const std::pair<std::string, std::string> merges[] = {
      {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {G, "w"},
      {"o", "r"}, {G + "w", "or"}, {"l", "d"}, {G + "wor", "ld"}, {"s", "a"},
      {"'", "s"}, {"'", "t"}, {"1", "2"}, {"e", "l"}, {yen, "x"}, {"!", "\xC3\xA3"}};
  json merge_list = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;
    merge_list.push_back(a + " " + b);
  }
  json added = json::array();
  int aid = 272;
  for (const auto& [content, special] : {std::pair<const char*, bool>{"<|endoftext|>", true},
                                         {"<|im_start|>", true},
                                         {"<|im_end|>", true},
                                         {"<think>", false}})
    added.push_back({{"id", aid++}, {"content", content}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", special}});
  // Qwen2's tokenizer.json pattern.
  const char* qwen =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                     {"use_regex", pre == PreTokenizer::kGpt2}};
  json pre_tokenizer =
      pre == PreTokenizer::kGpt2
          ? byte_level
          : json{{"type", "Sequence"},
                 {"pretokenizers",
                  {{{"type", "Split"}, {"pattern", {{"Regex", qwen}}}, {"behavior", "Isolated"},
                    {"invert", false}},
                   byte_level}}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
            {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab},
            {"merges", merge_list}}}};
}

}  // namespace packmoe::test
