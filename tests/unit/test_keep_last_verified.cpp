// --keep-last counts only checkpoints that verify: a newer checkpoint damaged after its commit
// (a flipped byte) neither counts as one of the kept nor is deleted, so the good older one stays;
// checkpoint_dirs lists a root's step-* directories newest first, and remove_checkpoints deletes
// exactly those. Files go to $PACKMOE_TEST_TMP.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "common/test_files.h"
#include "io/checkpoint_dir.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;

void commit(const std::string& root, int64_t step, int keep_last) {
  auto w = CheckpointWriter::begin(root, step, keep_last);
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  test::write_raw(w.value().path("model.safetensors"), std::vector<uint8_t>(512, 7));
  auto c = w.value().commit();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
}

void flip_byte(const fs::path& file) {
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(100);
  f.put('\x5a');
}

TEST(KeepLastVerified, ADamagedCheckpointDoesNotCostAGoodOneItsPlace) {
  const fs::path dir = test::make_test_dir("keep_last_");
  const std::string root = (dir / "ckpt").string();
  commit(root, 1, 2);
  commit(root, 2, 2);
  flip_byte(fs::path(root) / checkpoint_dir_name(2) / "model.safetensors");
  ASSERT_FALSE(verify_checkpoint((fs::path(root) / checkpoint_dir_name(2)).string()));
  commit(root, 3, 2);  // keeps step 3 and the newest one that verifies: step 1
  EXPECT_TRUE(verify_checkpoint((fs::path(root) / checkpoint_dir_name(3)).string()));
  EXPECT_TRUE(verify_checkpoint((fs::path(root) / checkpoint_dir_name(1)).string()))
      << "the good step 1 was deleted because the damaged step 2 was counted";
  EXPECT_TRUE(fs::exists(fs::path(root) / checkpoint_dir_name(2))) << "damaged ones stay";
  commit(root, 4, 2);  // now steps 4 and 3 are kept; step 1 goes
  EXPECT_FALSE(fs::exists(fs::path(root) / checkpoint_dir_name(1)));
  EXPECT_TRUE(fs::exists(fs::path(root) / checkpoint_dir_name(3)));

  Result<std::vector<std::string>> dirs = checkpoint_dirs(root);
  ASSERT_TRUE(dirs.is_ok());
  const std::vector<std::string> want = {(fs::path(root) / checkpoint_dir_name(4)).string(),
                                         (fs::path(root) / checkpoint_dir_name(3)).string()};
  EXPECT_EQ(dirs.value(), want) << "step 2 was deleted as older than the kept ones";
  test::write_raw(fs::path(root) / "notes.txt", {1, 2, 3});
  ASSERT_TRUE(remove_checkpoints(root).is_ok());
  EXPECT_TRUE(checkpoint_dirs(root).value().empty());
  EXPECT_TRUE(fs::exists(fs::path(root) / "notes.txt")) << "only checkpoint directories go";
  EXPECT_TRUE(checkpoint_dirs((dir / "missing").string()).value().empty());
  test::remove_test_dir(dir);
}

}  // namespace
}  // namespace packmoe::io
