// PCRE2 wrapper (see regex.h). Match data is allocated per call: it is the only mutable state,
// and keeping it per call keeps a Regex shareable across threads.
#include "tokenize/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace packmoe::tokenize {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

namespace {

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
};

}  // namespace

Result<Regex> Regex::compile(const std::string& pattern, const std::string& what, bool literal) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP |
                           (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &err, &err_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(err, message, sizeof(message));
    return Status::error(what + ": the pattern does not compile (PCRE2, at offset " +
                         std::to_string(err_offset) + "): " +
                         reinterpret_cast<const char*>(message));
  }
  auto c = std::make_shared<Code>();
  c->code = code;
  c->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  Regex r;
  r.code_ = std::move(c);
  return r;
}

std::optional<std::pair<size_t, size_t>> Regex::find(std::string_view text, size_t from) const {
  MatchData m(code_->code);
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                             from, PCRE2_NO_UTF_CHECK, m.md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return std::nullopt;
  PACKMOE_CHECK(rc > 0, "pcre2_match failed with code " << rc);
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
  return std::make_pair(static_cast<size_t>(ov[0]), static_cast<size_t>(ov[1]));
}

bool Regex::matches_at(std::string_view text, size_t at) const {
  MatchData m(code_->code);
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                             at, PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, m.md, nullptr);
  PACKMOE_CHECK(rc > 0 || rc == PCRE2_ERROR_NOMATCH, "pcre2_match failed with code " << rc);
  return rc > 0;
}

void Regex::split_isolated(std::string_view text, std::vector<std::string_view>* pieces) const {
  MatchData m(code_->code);
  size_t at = 0, gap = 0;
  while (at < text.size()) {
    const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()),
                               text.size(), at, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    PACKMOE_CHECK(rc > 0, "pcre2_match failed with code " << rc);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    const size_t b = ov[0], e = ov[1];
    if (e == b) {  // an empty match splits nothing: step over one character
      at = b + 1;
      while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
      continue;
    }
    if (b > gap) pieces->push_back(text.substr(gap, b - gap));
    pieces->push_back(text.substr(b, e - b));
    at = gap = e;
  }
  if (gap < text.size()) pieces->push_back(text.substr(gap));
}

}  // namespace packmoe::tokenize
