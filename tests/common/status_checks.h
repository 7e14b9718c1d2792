// expect_error: a Status that is an error of ONE line mentioning every one of `parts` (each
// missing part reported). Shared by the io unit tests (state_file, checkpoint_dir).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/status.h"

namespace packmoe::test {

inline void expect_error(const Status& s, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.is_ok()) << "expected an error mentioning " << parts.front();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}

}  // namespace packmoe::test
