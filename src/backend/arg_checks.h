// Argument checks shared by the ops' validate_* functions: one clear Status per bad argument,
// named after the op, before any memory is touched.
#pragma once

#include <initializer_list>
#include <string>

#include "core/status.h"

namespace packmoe {

struct NamedPointer {
  const void* ptr;
  const char* name;
};

// The first null pointer, in the order given, as "<op>: <name> is null".
inline Status require_non_null(const char* op, std::initializer_list<NamedPointer> pointers) {
  for (const NamedPointer& p : pointers)
    if (p.ptr == nullptr) return Status::error(std::string(op) + ": " + p.name + " is null");
  return Status::ok();
}

}  // namespace packmoe
