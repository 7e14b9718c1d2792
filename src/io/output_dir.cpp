// Output directories checked before a run starts (io/output_dir.h).
#include "io/output_dir.h"

#include <unistd.h>

#include <filesystem>
#include <system_error>


namespace packmoe::io {

namespace fs = std::filesystem;

Status check_writable_dir(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  fs::path p = fs::absolute(dir, ec);
  if (ec) return Status::error(flag + " " + dir + ": " + ec.message());
  // The nearest existing path: `dir` itself, or the ancestor it would be created under.
  fs::path existing = p;
  while (!fs::exists(fs::status(existing, ec)) && existing.has_parent_path() &&
         existing.parent_path() != existing)
    existing = existing.parent_path();
  const bool is_self = existing == p;
  if (!fs::is_directory(fs::status(existing, ec)))
    return Status::error(flag + " " + dir + ": " +
                         (is_self ? std::string("exists and is not a directory")
                                  : existing.string() + " is not a directory"));
  if (::access(existing.c_str(), W_OK | X_OK) != 0)
    return Status::error(flag + " " + dir + ": " +
                         (is_self ? std::string("the directory is not writable")
                                  : "cannot be created: " + existing.string() +
                                        " is not writable"));
  return Status::ok();
}

}  // namespace packmoe::io
