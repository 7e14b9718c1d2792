// io::ReadProgress (io/read_progress.h): while one is active, the readers' bytes reach its sink
// as a running total; a nested one takes the bytes until it ends, then the outer one again; with
// none active nothing is counted. Random small file sizes (read_at's 64 MiB step is not tested:
// CI stays small).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/test_files.h"
#include "io/read_file.h"
#include "io/read_progress.h"

namespace packmoe {
namespace {

TEST(ReadProgress, CountsTheBytesReadWhileActive) {
  const std::filesystem::path dir = test::make_test_dir("read_progress");
  std::mt19937_64 rng(test::recorded_random_seed());
  const uint64_t big = 4096 + rng() % 65536, small = 1 + rng() % 4096;
  test::write_raw(dir / "big", std::vector<uint8_t>(big, 7));
  test::write_raw(dir / "small", std::vector<uint8_t>(small, 9));
  auto read = [&](const char* name) {
    const std::string path = (dir / name).string();
    Result<io::RegularFile> f = io::RegularFile::open(path);
    ASSERT_TRUE(f.is_ok()) << f.status().message();
    std::vector<uint8_t> bytes(f.value().size());
    ASSERT_TRUE(f.value().read_at(path, 0, bytes.data(), bytes.size()).is_ok());
  };

  read("small");  // none active: nothing to count, nothing breaks
  std::vector<uint64_t> outer_reports, inner_reports;
  {
    io::ReadProgress outer([&](uint64_t b) { outer_reports.push_back(b); });
    read("big");
    EXPECT_EQ(outer.bytes(), big);
    EXPECT_EQ(outer_reports, std::vector<uint64_t>{big});
    {
      io::ReadProgress inner([&](uint64_t b) { inner_reports.push_back(b); });
      read("small");
      EXPECT_EQ(inner.bytes(), small);
    }
    read("small");
    EXPECT_EQ(outer.bytes(), big + small) << "the inner progress took its own bytes only";
    EXPECT_EQ(outer_reports.back(), big + small);
  }
  EXPECT_EQ(inner_reports, std::vector<uint64_t>{small});
  io::ReadProgress::add(123);  // none active again
  test::remove_test_dir(dir);
}

}  // namespace
}  // namespace packmoe
