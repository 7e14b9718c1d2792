// Atomic file output (see atomic_file.h). O_EXCL with a per-process counter instead of mkstemp:
// mkstemp creates mode 0600, and our files should get the usual 0666 & ~umask.
#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <system_error>

namespace packmoe::io {
namespace {

bool write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));  // Linux caps one write
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

Status write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> parts) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (!target.has_filename()) return Status::error(path + ": cannot write: path names a directory");
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  static std::atomic<uint64_t> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    // Appended piecewise: GCC 12 gives a false -Wrestrict on the chained operator+ form.
    std::string name = ".";
    name += target.filename().string();
    name += ".tmp.";
    name += std::to_string(::getpid());
    name += ".";
    name += std::to_string(counter++);
    tmp = (dir / name).string();
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) {
      return Status::error(path + ": cannot create a temporary file in '" + dir.string() +
                           "': " + errno_text(errno));
    }
  }
  if (fd < 0) return Status::error(path + ": cannot create a temporary file: too many collisions");
  auto abandon = [&](const std::string& step, int err) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return Status::error(path + ": " + step + " failed: " + errno_text(err) + " (nothing written)");
  };
  for (const auto& part : parts) {
    if (!write_all(fd, part.data(), part.size())) return abandon("write", errno);
  }
  if (::fsync(fd) != 0) return abandon("fsync", errno);
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) return abandon("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return abandon("rename over the target", errno);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

}  // namespace packmoe::io
