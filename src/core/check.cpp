// Abort path of PACKMOE_CHECK.
#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace packmoe {
namespace {
int g_rank = -1;
}

void set_check_rank(int rank) { g_rank = rank; }

void check_failed(const char* file, int line, const char* expr, const std::string& msg) {
  if (g_rank >= 0) std::fprintf(stderr, "[rank %d] ", g_rank);
  std::fprintf(stderr, "packmoe: check failed at %s:%d: %s", file, line, expr);
  if (!msg.empty()) std::fprintf(stderr, ": %s", msg.c_str());
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

}  // namespace packmoe
