// Programmer-error checks: a failed PACKMOE_CHECK prints file:line, the expression, an optional
// message and (in multi-rank jobs) the rank, then aborts. Bad user input never goes through here:
// it returns a Status (core/status.h).
#pragma once

#include <sstream>
#include <string>

namespace packmoe {

// Set by the launcher of a multi-rank job; -1 means single process.
void set_check_rank(int rank);
[[noreturn]] void check_failed(const char* file, int line, const char* expr, const std::string& msg);

}  // namespace packmoe

#define PACKMOE_CHECK(cond, ...)                                                           \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::ostringstream packmoe_check_os_;                                                \
      packmoe_check_os_ << "" __VA_OPT__(<< __VA_ARGS__);                                  \
      ::packmoe::check_failed(__FILE__, __LINE__, #cond, packmoe_check_os_.str());         \
    }                                                                                      \
  } while (0)
