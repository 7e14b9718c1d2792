// Helpers of the io unit tests: a fresh per-test directory under $PACKMOE_TEST_TMP (else the
// system temp dir) named <prefix><test name>_<pid>, whole-file binary read/write, and a random
// seed recorded as the test's "seed" property.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <system_error>
#include <vector>

namespace packmoe::test {

// Removes any leftover of the same name, then creates it empty.
inline std::filesystem::path make_test_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  fs::path base = env && *env ? fs::path(env) : fs::temp_directory_path();
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = base / (prefix + std::string(info->name()) + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Best effort: a failure to clean up does not fail the test.
inline void remove_test_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// From std::random_device; recorded as the property "seed" (in gtest's XML report).
inline uint64_t recorded_random_seed() {
  std::random_device rd;
  const uint64_t seed = (uint64_t{rd()} << 32) | rd();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

inline std::vector<uint8_t> read_raw(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

inline void write_raw(const std::filesystem::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace packmoe::test
