// Output directories checked before a run starts: --out and --save-dir must be (or be creatable
// as) writable directories, found out before step 1 instead of at the first write after hours of
// training. Invariant: checking creates and changes nothing.
#pragma once

#include <string>

#include "core/status.h"

namespace packmoe::io {

// ok when `dir` is a directory this process may create files in, or does not exist and its
// nearest existing ancestor is one (so it can be created). Errors start with `flag` and `dir`.
Status check_writable_dir(const std::string& dir, const std::string& flag);

}  // namespace packmoe::io
