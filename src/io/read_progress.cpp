// ReadProgress (io/read_progress.h): the thread's active progress is a thread-local pointer.
#include "io/read_progress.h"

#include <utility>

namespace packmoe::io {
namespace {
thread_local ReadProgress* g_active = nullptr;
}  // namespace

ReadProgress::ReadProgress(Sink sink) : sink_(std::move(sink)), previous_(g_active) {
  g_active = this;
}

ReadProgress::~ReadProgress() { g_active = previous_; }

void ReadProgress::add(uint64_t bytes) {
  ReadProgress* p = g_active;
  if (p == nullptr) return;
  p->bytes_ += bytes;
  if (p->sink_) p->sink_(p->bytes_);
}

}  // namespace packmoe::io
