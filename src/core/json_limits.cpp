// JSON with limits (core/json_limits.h).
#include "core/json_limits.h"

namespace packmoe {

Status check_json_text(std::string_view text, const std::string& what, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0')
      return Status::error(what + ": a NUL byte at byte " + std::to_string(i) +
                           " (not a JSON text)");
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        return Status::error(what + ": JSON nested deeper than " + std::to_string(max_depth) +
                             " levels (at byte " + std::to_string(i) + ")");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return Status::ok();
}

Result<nlohmann::json> parse_json_text(std::string_view text, const std::string& what) {
  PACKMOE_RETURN_IF_ERROR(check_json_text(text, what));
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    // nlohmann messages start with "[json.exception.parse_error.101] "; the tag means nothing.
    std::string_view s = e.what();
    if (size_t p = s.find("] "); !s.empty() && s[0] == '[' && p != std::string_view::npos)
      s.remove_prefix(p + 2);
    return Status::error(what + ": not valid JSON: " + printable_text(s, true));
  }
}

std::string printable_text(std::string_view s, bool escape_non_ascii) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7F || (escape_non_ascii && c >= 0x80)) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string json_brief(const nlohmann::json& v) {
  constexpr size_t kMaxString = 64;
  switch (v.type()) {
    case nlohmann::json::value_t::object:
      return "an object of " + std::to_string(v.size()) + " keys";
    case nlohmann::json::value_t::array:
      return "an array of " + std::to_string(v.size()) + " values";
    case nlohmann::json::value_t::string: {
      const std::string& s = v.get_ref<const std::string&>();
      const bool cut = s.size() > kMaxString;
      return "\"" + printable_text(std::string_view(s).substr(0, kMaxString), true) +
             (cut ? "...\"" : "\"");
    }
    case nlohmann::json::value_t::discarded: return "nothing";
    default: return v.dump();  // a scalar: number, boolean, null, binary never parsed
  }
}

}  // namespace packmoe
