// GroupedStorage: E groups of equal byte size in one backend's memory, in the single (one
// allocation) or discrete (E allocations) layout, and the adapters that run one backend op over
// all groups. Invariant: group(e) is a view; whichever the layout, the groups hold the same bytes
// and every op over them is one call, so both layouts give bitwise equal results.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"

namespace packmoe {

// The kind of a copy from memory on `src` to memory on `dst`, and the backend that performs it
// (the device side when there is one).
Backend::CopyKind copy_kind(Device dst, Device src);
Backend& copy_engine(Backend& dst, Backend& src);

enum class Layout {
  kSingle,    // one allocation per component, expert e at offset e * bytes_per_group
  kDiscrete,  // E allocations per component (the way most frameworks store experts)
};

// E groups of equal byte size in one backend's memory, in either layout. group(e) is a view.
class GroupedStorage {
 public:
  GroupedStorage() = default;
  GroupedStorage(Backend& memory, Layout layout, int64_t groups, size_t bytes_per_group);
  // E views of `memory` owned elsewhere (a data-parallel grad buffer): nothing is allocated or
  // freed. kSingle views must be consecutive (group e at ptrs[0] + e * bytes_per_group).
  static GroupedStorage view(Backend& memory, Layout layout, std::vector<void*> ptrs,
                             size_t bytes_per_group);

  bool allocated() const { return !ptrs_.empty(); }
  Layout layout() const { return layout_; }
  int64_t groups() const { return static_cast<int64_t>(ptrs_.size()); }
  size_t bytes_per_group() const { return bytes_per_group_; }
  Backend& memory() const { return *memory_; }
  void* group(int64_t e) const { return ptrs_.at(e); }
  const std::vector<void*>& ptrs() const { return ptrs_; }  // (E,) the views
  std::vector<const void*> const_ptrs() const { return {ptrs_.begin(), ptrs_.end()}; }
  // Base of the one (E, ...) allocation (or consecutive views); kSingle only.
  void* packed() const;

  void zero();
  void release();  // frees the memory (views: forgets them); allocated() becomes false
  // Group-major host copy: what the packed buffer holds, whichever the layout.
  std::vector<uint8_t> download() const;
  // Group by group from `src` (same group count and size), across memories (host <-> device).
  void copy_from(const GroupedStorage& src);

 private:
  Backend* memory_ = nullptr;
  Layout layout_ = Layout::kSingle;
  size_t bytes_per_group_ = 0;
  std::vector<DeviceBuffer> buffers_;  // 1 (kSingle) or E (kDiscrete); none for views
  std::vector<void*> ptrs_;            // (E,)
};

struct NamedStorage {
  std::string name;
  const GroupedStorage* storage;
};

// ---- Elementwise ops on grouped storage --------------------------------------------------------
// Adapters from GroupedStorage to the backend's segment-list ops (backend/ops/elementwise.h): one call
// over all E groups, whichever the layout. Both operands must live in the same backend's memory.

// The groups of `s` as a segment list of T elements (bytes_per_group / sizeof(T) each).
template <typename T>
Segments<T> segments(const GroupedStorage& s) {
  Segments<T> out;
  out.n = static_cast<int64_t>(s.bytes_per_group() / sizeof(T));
  for (void* p : s.ptrs()) out.ptr.push_back(static_cast<T*>(p));
  return out;
}

// dst = bf16(src) (RNE); src (G, n) F32, dst (G, n) BF16.
void cast_f32_to_bf16(const GroupedStorage& src, const GroupedStorage& dst);
// dst += src, (G, n) F32 each.
void add_f32(const GroupedStorage& dst, const GroupedStorage& src);
// PACKMOE_CHECK that an op the layer issued with checked shapes succeeded.
void check_op(const Status& s, const char* what);

}  // namespace packmoe
