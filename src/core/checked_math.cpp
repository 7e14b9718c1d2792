// Overflow-safe size arithmetic (core/checked_math.h).
#include "core/checked_math.h"

#include <unistd.h>

#include <limits>

namespace packmoe {

std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  std::optional<int64_t> p = 1;
  for (int64_t f : factors) {
    p = checked_mul(*p, f);
    if (!p) return std::nullopt;
  }
  return p;
}

int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<int64_t>::max();
  return checked_mul(pages, page).value_or(std::numeric_limits<int64_t>::max());
}

Status check_fits(std::optional<int64_t> bytes, int64_t limit, const std::string& what,
                  const std::string& where) {
  if (!bytes) return Status::error(what + " overflows a 64-bit byte count");
  if (*bytes > limit)
    return Status::error(what + " needs " + std::to_string(*bytes) + " bytes, more than the " +
                         std::to_string(limit) + " bytes of " + where);
  return Status::ok();
}

}  // namespace packmoe
