// run_cli: runs the packmoe binary ($PACKMOE_CLI, set by CTest) through the shell with `args` as
// written, and returns its exit code and its stdout + stderr together. Used by the CLI tests
// (test_cli, test_train_cli, test_metrics_plot).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace packmoe::test {

struct RunResult {
  int exit_code;       // -1 when the process did not exit normally
  std::string output;  // stdout + stderr
};

inline RunResult run_cli(const std::string& args) {
  const char* cli = std::getenv("PACKMOE_CLI");
  EXPECT_NE(cli, nullptr) << "PACKMOE_CLI is set by CTest";
  const std::string cmd = std::string(cli ? cli : "packmoe") + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace packmoe::test
