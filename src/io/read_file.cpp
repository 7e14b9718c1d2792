// Reading input files safely (io/read_file.h).
#include "io/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "io/atomic_file.h"
#include "io/read_progress.h"

namespace packmoe::io {

RegularFile& RegularFile::operator=(RegularFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    size_ = o.size_;
    o.fd_ = -1;
  }
  return *this;
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<RegularFile> RegularFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  RegularFile f;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd_ < 0) return Status::error(path + ": cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0) return Status::error(path + ": cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode))
    return Status::error(path + ": not a regular file (" +
                         (S_ISDIR(st.st_mode)    ? "a directory"
                          : S_ISFIFO(st.st_mode) ? "a FIFO"
                          : S_ISCHR(st.st_mode)  ? "a character device"
                          : S_ISSOCK(st.st_mode) ? "a socket"
                                                 : "a special file") +
                         ")");
  const int flags = ::fcntl(f.fd_, F_GETFL);
  if (flags >= 0) (void)::fcntl(f.fd_, F_SETFL, flags & ~O_NONBLOCK);
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

Status RegularFile::read_at(const std::string& path, uint64_t offset, void* dst,
                            uint64_t n) const {
  uint8_t* out = static_cast<uint8_t*>(dst);
  uint64_t got = 0;
  while (got < n) {
    // 64 MiB per call: a progress bar over a large file moves in small steps.
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n - got, uint64_t{64} << 20));
    const ssize_t r = ::pread(fd_, out + got, want, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::error(path + ": read failed: " + errno_text(errno));
    if (r == 0)
      return Status::error(path + ": file shrank while being read (" + std::to_string(got) +
                           " of " + std::to_string(n) + " bytes at offset " +
                           std::to_string(offset) + ")");
    got += static_cast<uint64_t>(r);
    ReadProgress::add(static_cast<uint64_t>(r));
  }
  return Status::ok();
}

Result<std::string> read_regular_file(const std::string& path, uint64_t max_bytes) {
  Result<RegularFile> f = RegularFile::open(path);
  if (!f) return f.status();
  if (f.value().size() > max_bytes)
    return Status::error(path + ": " + std::to_string(f.value().size()) +
                         " bytes, more than the " + std::to_string(max_bytes) +
                         " bytes this file may have");
  std::string text(static_cast<size_t>(f.value().size()), '\0');
  PACKMOE_RETURN_IF_ERROR(f.value().read_at(path, 0, text.data(), text.size()));
  return text;
}

}  // namespace packmoe::io
