// A compiled PCRE2 pattern in UTF mode with Unicode properties (\p{L}, \p{N}, \s over Unicode),
// as the pre-tokenizers of Hugging Face tokenizer.json files use them. Invariant: subjects are
// well-formed UTF-8 (Tokenizer::encode checks once; matching skips PCRE2's own check), and a
// Regex is immutable after compile, so one instance serves every thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace packmoe::tokenize {

class Regex {
 public:
  // Compiles `pattern` (JIT where PCRE2 has it); `literal` matches the text itself. Errors name
  // `what` and PCRE2's message with the offset.
  static Result<Regex> compile(const std::string& pattern, const std::string& what,
                               bool literal = false);

  // The first match at or after byte `from`: [begin, end) byte offsets.
  std::optional<std::pair<size_t, size_t>> find(std::string_view text, size_t from) const;
  // Whether the code point at byte `at` (a character boundary) begins a match (anchored).
  bool matches_at(std::string_view text, size_t at) const;

  // The "Isolated" split of Hugging Face's Split pre-tokenizer: every match is a piece and so is
  // every non-empty stretch between matches; the pieces concatenate to `text`.
  void split_isolated(std::string_view text, std::vector<std::string_view>* pieces) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

}  // namespace packmoe::tokenize
