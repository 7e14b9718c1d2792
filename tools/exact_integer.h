// A CLI11 check that an integer flag's text is exactly an integer of type T: CLI11's own
// conversion wraps "-1" to 2^64 - 1 for unsigned types and clamps "99999999999999999999", so
// integer flags are checked on their text first. Invariant: a flag that passes converts exactly.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <limits>
#include <string>
#include <type_traits>

namespace packmoe::tools {

template <typename T>
CLI::Validator exact_integer() {
  static_assert(std::is_integral_v<T>);
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T v{};
        const char* end = text.data() + text.size();
        const auto [p, ec] = std::from_chars(text.data(), end, v);
        const std::string range = std::to_string(std::numeric_limits<T>::min()) + " to " +
                                  std::to_string(std::numeric_limits<T>::max());
        if (ec == std::errc::result_out_of_range)
          return "'" + text + "' is out of range (" + range + ")";
        if (ec != std::errc() || p != end)
          return "'" + text + "' is not an integer in " + range;
        return "";
      },
      "INT");
}

}  // namespace packmoe::tools
