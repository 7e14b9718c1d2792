// GPT-2's byte-level alphabet (bytes_to_unicode in openai/gpt-2 encoder.py, the ByteLevel
// pre-tokenizer and decoder of Hugging Face tokenizers): each byte maps to one printable code
// point, so any byte string is a string of vocabulary symbols. Invariant: the map is a bijection
// between the 256 bytes and 256 code points (printable Latin-1 to itself, the rest to U+0100..).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace packmoe::tokenize {

// The code point of byte b.
uint32_t byte_to_codepoint(uint8_t b);
// The byte of a code point, or none when it is not in the alphabet.
std::optional<uint8_t> codepoint_to_byte(uint32_t cp);
// The UTF-8 of byte_to_codepoint(b): the vocabulary symbol of one byte.
const std::string& byte_symbol(uint8_t b);

// Appends the UTF-8 of code point cp (< 0x110000) to out.
void append_utf8(uint32_t cp, std::string* out);
// Decodes the code point starting at s[i] of valid UTF-8 (tokenizer strings are), advancing i.
uint32_t next_codepoint(std::string_view s, size_t* i);

// The ByteLevel decoder rule: a token whose characters are all in the alphabet becomes their
// bytes; any other token stays as its own UTF-8.
void append_decoded_token(std::string_view token, std::string* out);

}  // namespace packmoe::tokenize
