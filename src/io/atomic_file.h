// Atomic file output shared by every writer (safetensors, token data, configs, plots): the bytes
// go to a temporary file in the target's directory (mode 0666 & ~umask), which is fsync'd and
// renamed over the target, then the directory is fsync'd (best effort). On any failure the
// temporary file is removed and the target is untouched, so a crash never leaves half a file.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/status.h"

namespace packmoe::io {

// Writes the concatenation of `parts` to `path` atomically. Errors name `path` and the step.
Status write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> parts);

// strerror-style text of an errno value.
std::string errno_text(int err);

}  // namespace packmoe::io
