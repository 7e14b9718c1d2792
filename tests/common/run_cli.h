// run_cli: runs the packmoe binary ($PACKMOE_CLI, set by CTest) through the shell with `args` as
// written, and returns its exit code and its stdout + stderr together. Used by the CLI tests
// (test_cli, test_train_cli, test_metrics_plot, the dist CLI tests); run_shell runs any command.
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

// A variable CTest sets for the test ("" and a test failure when it is missing).
inline std::string ctest_env(const char* name) {
  const char* v = std::getenv(name);
  EXPECT_NE(v, nullptr) << name << " is set by CTest";
  return v ? v : "";
}

// How many times `what` occurs in `text` (overlapping occurrences counted).
inline size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// `cmd` run through the shell, its stdout + stderr captured together.
inline RunResult run_shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline RunResult run_cli(const std::string& args) {
  const char* cli = std::getenv("PACKMOE_CLI");
  EXPECT_NE(cli, nullptr) << "PACKMOE_CLI is set by CTest";
  return run_shell(std::string(cli ? cli : "packmoe") + " " + args);
}

}  // namespace packmoe::test
