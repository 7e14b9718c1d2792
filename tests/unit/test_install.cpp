// `cmake --install BUILD --prefix DIR` (CMakeLists.txt install rules): the packmoe executable lands
// in DIR/bin and runs from there (`packmoe --help`, `packmoe train --help`). The build directory is
// the one holding $PACKMOE_CLI (CTest sets it to the built executable).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "common/run_cli.h"
#include "common/test_files.h"

namespace packmoe {
namespace {

namespace fs = std::filesystem;

TEST(Install, PutsAWorkingPackmoeInPrefixBin) {
  const char* cli = std::getenv("PACKMOE_CLI");
  ASSERT_NE(cli, nullptr) << "PACKMOE_CLI unset (run through ctest)";
  const fs::path build = fs::path(cli).parent_path();
  const fs::path prefix = test::make_test_dir("install_") / "prefix with space";
  // Built with += (GCC 12 warns falsely on a chain of + here, -Wrestrict).
  std::string install = "cmake --install '";
  install += build.string();
  install += "' --prefix '";
  install += prefix.string();
  install += "' > '";
  install += (prefix.parent_path() / "log").string();
  install += "' 2>&1";
  ASSERT_EQ(std::system(install.c_str()), 0) << install;
  const fs::path installed = prefix / "bin" / "packmoe";
  ASSERT_TRUE(fs::is_regular_file(installed)) << installed;
  for (const char* args : {"--help", "train --help"}) {
    std::string cmd = "'";
    cmd += installed.string();
    cmd += "' ";
    cmd += args;
    const test::RunResult r = test::run_shell(cmd);
    EXPECT_EQ(r.exit_code, 0) << args << ": " << r.output;
    EXPECT_NE(r.output.find("packmoe"), std::string::npos) << r.output;
  }
  test::remove_test_dir(prefix.parent_path());
}

}  // namespace
}  // namespace packmoe
