// Reading input files safely: only a regular file is accepted (a FIFO, a device such as /dev/zero
// or a directory is refused before a byte is read, and opening never blocks), and a whole-file
// read is bounded. Every reader of user files (data, configs, checkpoints, quantize inputs)
// opens through here. Invariant: a returned fd is a regular file opened read-only.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace packmoe::io {

// Whole-file reads of JSON and text are bounded by this (checkpoint JSON is a few KB).
constexpr uint64_t kMaxJsonFileBytes = uint64_t{64} << 20;

// An open regular file; closes on destruction.
class RegularFile {
 public:
  RegularFile() = default;
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  RegularFile(RegularFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  RegularFile& operator=(RegularFile&& o) noexcept;
  ~RegularFile();

  // Opens `path`; errors name it ("not a regular file", "cannot open: ...").
  static Result<RegularFile> open(const std::string& path);

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }  // at open time

  // Exactly `n` bytes at `offset` into dst; a short read is an error (the file changed).
  Status read_at(const std::string& path, uint64_t offset, void* dst, uint64_t n) const;

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole regular file `path`, refused when larger than `max_bytes`.
Result<std::string> read_regular_file(const std::string& path, uint64_t max_bytes);

}  // namespace packmoe::io
