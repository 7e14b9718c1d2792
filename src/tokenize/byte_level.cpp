// The GPT-2 byte-level alphabet, built once (see byte_level.h).
#include "tokenize/byte_level.h"

#include <vector>

#include "core/check.h"

namespace packmoe::tokenize {
namespace {

struct Alphabet {
  std::array<uint32_t, 256> to_cp{};
  std::array<std::string, 256> symbol;
  std::array<int16_t, 256 + 68> from_cp;  // -1: not in the alphabet
  Alphabet() {
    from_cp.fill(-1);
    // Printable bytes keep their Latin-1 code point; the other 68 take 256, 257, ... in order.
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      to_cp[b] = printable[b] ? static_cast<uint32_t>(b) : next++;
      append_utf8(to_cp[b], &symbol[b]);
      from_cp[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet a;
  return a;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return alphabet().to_cp[b]; }

std::optional<uint8_t> codepoint_to_byte(uint32_t cp) {
  if (cp >= alphabet().from_cp.size() || alphabet().from_cp[cp] < 0) return std::nullopt;
  return static_cast<uint8_t>(alphabet().from_cp[cp]);
}

const std::string& byte_symbol(uint8_t b) { return alphabet().symbol[b]; }

void append_utf8(uint32_t cp, std::string* out) {
  PACKMOE_CHECK(cp < 0x110000, "code point " << cp);
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint32_t next_codepoint(std::string_view s, size_t* i) {
  const auto c0 = static_cast<unsigned char>(s[*i]);
  int len = c0 < 0x80 ? 1 : c0 < 0xE0 ? 2 : c0 < 0xF0 ? 3 : 4;
  PACKMOE_CHECK(*i + len <= s.size(), "truncated UTF-8 at byte " << *i);
  uint32_t cp = len == 1 ? c0 : len == 2 ? (c0 & 0x1F) : len == 3 ? (c0 & 0x0F) : (c0 & 0x07);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[*i + k]) & 0x3F);
  *i += len;
  return cp;
}

void append_decoded_token(std::string_view token, std::string* out) {
  const size_t at = out->size();
  size_t i = 0;
  while (i < token.size()) {
    const std::optional<uint8_t> b = codepoint_to_byte(next_codepoint(token, &i));
    if (!b) {  // not all in the alphabet: the token's own text
      out->resize(at);
      out->append(token);
      return;
    }
    out->push_back(static_cast<char>(*b));
  }
}

}  // namespace packmoe::tokenize
