// Overflow-safe size arithmetic for sizes that come from users and files (configs, flags, headers):
// every product and sum is computed in 64 bits with the overflow reported, never wrapped, so a
// size is checked against what the machine can hold BEFORE anything is allocated.
// Invariant: a function here returns std::nullopt instead of any wrapped or negative result.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "core/status.h"

namespace packmoe {

// a * b and a + b of non-negative values, or nullopt when negative or beyond int64.
std::optional<int64_t> checked_mul(int64_t a, int64_t b);
std::optional<int64_t> checked_add(int64_t a, int64_t b);
// The product of non-negative factors, or nullopt.
std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors);

// Bytes of physical memory of this machine (sysconf), the bound a host allocation must fit.
int64_t host_memory_bytes();

// An error unless `bytes` (nullopt: overflowed) fits in `limit` bytes. The message reads
// "<what> needs <bytes> bytes, more than the <limit> bytes of <where>".
Status check_fits(std::optional<int64_t> bytes, int64_t limit, const std::string& what,
                  const std::string& where = "host memory");

}  // namespace packmoe
