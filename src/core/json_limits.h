// JSON from files and flags, read with limits: every JSON text the program reads goes through
// parse_json_text, which refuses nesting deeper than kJsonMaxDepth and NUL bytes (nlohmann would
// stop at a NUL and ignore the rest) before nlohmann sees it, and reports errors as one line.
// Error messages show untrusted values only through json_brief / printable_text: never a
// recursive dump, never a raw control byte.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/status.h"

namespace packmoe {

// Deeper than any file the program writes (configs and checkpoints nest at most 4 levels).
constexpr int kJsonMaxDepth = 64;

// An error naming `what` unless `text` nests at most `max_depth` arrays / objects and holds no
// NUL byte. Strings are skipped (brackets inside them do not count); the syntax is nlohmann's job.
Status check_json_text(std::string_view text, const std::string& what,
                       int max_depth = kJsonMaxDepth);

// check_json_text, then nlohmann's parse; a parse error reads "<what>: not valid JSON: ...".
Result<nlohmann::json> parse_json_text(std::string_view text, const std::string& what);

// A short, one-line description of a value for error messages: numbers, booleans and null as
// JSON, strings quoted with control bytes escaped and cut at 64 bytes, containers by kind and size.
std::string json_brief(const nlohmann::json& v);

// `s` with control bytes (and DEL; with `escape_non_ascii` every byte >= 0x80) as \xNN, so a
// name from a file prints as one line with no terminal escapes.
std::string printable_text(std::string_view s, bool escape_non_ascii = false);

}  // namespace packmoe
