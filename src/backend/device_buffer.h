// DeviceBuffer: RAII bytes in a backend's memory, with host upload/download. For tools, tests
// and benchmarks; hot paths use arenas.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"

namespace packmoe {

class DeviceBuffer {
 public:
  DeviceBuffer(Backend& backend, size_t bytes) : backend_(&backend), bytes_(bytes) {
    ptr_ = bytes ? backend.allocate(bytes) : nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_) backend_->deallocate(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : backend_(o.backend_), bytes_(o.bytes_), ptr_(o.ptr_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;

  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  void upload(std::span<const uint8_t> host) {
    PACKMOE_CHECK(host.size() == bytes_, "upload of " << host.size() << " into " << bytes_);
    if (bytes_) backend_->copy(ptr_, host.data(), bytes_, Backend::CopyKind::kHostToDevice);
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_) backend_->copy(host.data(), ptr_, bytes_, Backend::CopyKind::kDeviceToHost);
    return host;
  }

 private:
  Backend* backend_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

}  // namespace packmoe
