// ReadProgress: counts the bytes the io/ readers read (RegularFile::read_at, the checkpoint CRC
// scan) while one is active on the calling thread and reports the running total to its sink, so
// a command can draw a progress bar over a long read (a checkpoint, Hugging Face weights) without
// a callback threaded through every reader. Invariant: reporting never changes what is read; with
// none active a reader pays one thread-local load per chunk.
#pragma once

#include <cstdint>
#include <functional>

namespace packmoe::io {

class ReadProgress {
 public:
  using Sink = std::function<void(uint64_t bytes_read)>;
  // Active on this thread until destroyed (then the one active before it is again).
  explicit ReadProgress(Sink sink);
  ~ReadProgress();
  ReadProgress(const ReadProgress&) = delete;
  ReadProgress& operator=(const ReadProgress&) = delete;

  uint64_t bytes() const { return bytes_; }
  // Adds `bytes` to this thread's active progress and reports the total; nothing when none.
  static void add(uint64_t bytes);

 private:
  Sink sink_;
  uint64_t bytes_ = 0;
  ReadProgress* previous_;
};

}  // namespace packmoe::io
