// The CPU-vs-CUDA comparison harness of the byte-for-byte tests in tests/cuda (header-only): the
// GPU backend or a skip, byte images mirrored on the host (the CPU reference writes there) and on
// the device (CUDA writes there), and a per-op tally of compared and mismatching bytes. Invariant:
// both images of a Mirror start with the same bytes (sentinels in every gap and a tail) and are
// compared whole, so a write outside a region is a mismatch too.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace packmoe::test {

inline constexpr uint8_t kSentinel = 0xA5;  // every byte no op has written

// The CUDA backend, or null when no usable GPU is visible (the reason: gpu_missing_reason()).
inline Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}
inline std::string gpu_missing_reason() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? std::string() : b.status().message();
}

// Declares `Backend* gpu` in a test body, or skips the test when there is no GPU.
#define PACKMOE_SKIP_WITHOUT_GPU()                 \
  Backend* gpu = ::packmoe::test::gpu_or_null();   \
  if (gpu == nullptr)                              \
  GTEST_SKIP() << "no usable GPU: " << ::packmoe::test::gpu_missing_reason()

// One line per op at the end of its test: cases run, bytes compared, mismatching bytes (which
// must be none).
struct Tally {
  std::string op;
  int cases = 0;
  size_t bytes = 0;
  size_t mismatches = 0;
  explicit Tally(std::string name) : op(std::move(name)) {}
  ~Tally() {
    std::printf("[cuda==cpu] %-50s cases=%-4d bytes=%-11zu mismatches=%zu\n", op.c_str(), cases,
                bytes, mismatches);
    std::fflush(stdout);
    EXPECT_EQ(mismatches, 0u) << op;
  }
  Tally(const Tally&) = delete;
  Tally& operator=(const Tally&) = delete;
};

enum class Placement {
  kPacked,      // regions back to back (a packed tensor; odd sizes leave later regions unaligned)
  kDiscrete,    // 256-byte aligned regions with gaps, like separate allocations
  kMisaligned,  // discrete, each region shifted by `shift` bytes (scalar kernel paths)
};

inline const char* placement_name(Placement p) {
  return p == Placement::kPacked ? "packed" : p == Placement::kDiscrete ? "discrete" : "misaligned";
}

// One byte image on the host and one on the device, same layout: regions of the given sizes;
// gaps and a 64-byte tail start as kSentinel like the regions.
class Mirror {
 public:
  Mirror(Backend& gpu, const std::vector<size_t>& bytes, Placement pl = Placement::kDiscrete,
         size_t shift = 0)
      : gpu_(&gpu) {
    size_t at = 0;
    for (size_t b : bytes) {
      if (pl != Placement::kPacked)
        at = (at + 64 + 255) / 256 * 256 + (pl == Placement::kMisaligned ? shift : 0);
      offsets_.push_back(at);
      at += b;
    }
    total_ = at + 64;  // the tail: writes past the last region show up
    host_.assign(total_, kSentinel);
    dev_ = gpu.allocate(total_);
    upload();
  }
  // One region of `bytes`, shifted off alignment by `shift` bytes when shift > 0.
  Mirror(Backend& gpu, size_t bytes, size_t shift = 0)
      : Mirror(gpu, std::vector<size_t>{bytes},
               shift ? Placement::kMisaligned : Placement::kDiscrete, shift) {}
  ~Mirror() { gpu_->deallocate(dev_); }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;

  template <typename T = void>
  T* h(size_t g = 0) {
    return reinterpret_cast<T*>(host_.data() + offsets_[g]);
  }
  template <typename T = void>
  T* d(size_t g = 0) {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(dev_) + offsets_[g]);
  }
  template <typename T = void>
  std::vector<T*> h_all() {
    std::vector<T*> v;
    for (size_t g = 0; g < offsets_.size(); ++g) v.push_back(h<T>(g));
    return v;
  }
  template <typename T = void>
  std::vector<T*> d_all() {
    std::vector<T*> v;
    for (size_t g = 0; g < offsets_.size(); ++g) v.push_back(d<T>(g));
    return v;
  }
  std::vector<uint8_t>& host_bytes() { return host_; }
  // Copies `bytes` into region g of the host image (upload() sends it to the device).
  void set(const void* src, size_t bytes, size_t g = 0) {
    if (bytes) std::memcpy(host_.data() + offsets_[g], src, bytes);
  }
  void upload() { gpu_->copy(dev_, host_.data(), total_, Backend::CopyKind::kHostToDevice); }

  // Whole-image comparison into `t`; prints the first few differing bytes; returns their count.
  size_t compare(Tally& t, const std::string& what) {
    std::vector<uint8_t> dv(total_);
    gpu_->copy(dv.data(), dev_, total_, Backend::CopyKind::kDeviceToHost);
    size_t bad = 0;
    for (size_t i = 0; i < total_; ++i)
      if (dv[i] != host_[i]) {
        if (bad < 4)
          std::printf("  mismatch %s / %s at byte %zu of %zu: cpu 0x%02x cuda 0x%02x\n",
                      t.op.c_str(), what.c_str(), i, total_, host_[i], dv[i]);
        ++bad;
      }
    t.bytes += total_;
    t.mismatches += bad;
    return bad;
  }

 private:
  Backend* gpu_;
  std::vector<size_t> offsets_;
  size_t total_ = 0;
  std::vector<uint8_t> host_;
  void* dev_ = nullptr;
};

// One typed buffer of n elements as a Mirror: the given values on both sides, or (an output)
// sentinel bytes.
template <typename T>
class Twin : public Mirror {
 public:
  Twin(Backend& gpu, const std::vector<T>& values) : Mirror(gpu, values.size() * sizeof(T)) {
    set(values.data(), values.size() * sizeof(T));
    upload();
  }
  Twin(Backend& gpu, size_t n) : Mirror(gpu, n * sizeof(T)) {}
  T* h() { return Mirror::h<T>(0); }
  T* d() { return Mirror::d<T>(0); }
};

inline std::vector<const void*> const_ptrs(const std::vector<void*>& v) {
  return std::vector<const void*>(v.begin(), v.end());
}

}  // namespace packmoe::test
