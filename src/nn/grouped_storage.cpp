// GroupedStorage allocation, views, copies across memories, and the grouped elementwise ops.
#include "nn/grouped_storage.h"

namespace packmoe {

Backend::CopyKind copy_kind(Device dst, Device src) {
  if (src == Device::kCPU && dst != Device::kCPU) return Backend::CopyKind::kHostToDevice;
  if (src != Device::kCPU && dst == Device::kCPU) return Backend::CopyKind::kDeviceToHost;
  return Backend::CopyKind::kDeviceToDevice;
}

Backend& copy_engine(Backend& dst, Backend& src) {
  return dst.device() != Device::kCPU ? dst : src;
}

// ---- GroupedStorage -----------------------------------------------------------------------------

GroupedStorage::GroupedStorage(Backend& memory, Layout layout, int64_t groups,
                               size_t bytes_per_group)
    : memory_(&memory), layout_(layout), bytes_per_group_(bytes_per_group) {
  PACKMOE_CHECK(groups > 0 && bytes_per_group > 0, "empty grouped storage");
  if (layout == Layout::kSingle) {
    buffers_.emplace_back(memory, groups * bytes_per_group);
    for (void* p : carve(buffers_[0].get(), groups, bytes_per_group)) ptrs_.push_back(p);
  } else {
    buffers_.reserve(groups);
    for (int64_t e = 0; e < groups; ++e) {
      buffers_.emplace_back(memory, bytes_per_group);
      ptrs_.push_back(buffers_.back().get());
    }
  }
}

GroupedStorage GroupedStorage::view(Backend& memory, Layout layout, std::vector<void*> ptrs,
                                    size_t bytes_per_group) {
  PACKMOE_CHECK(!ptrs.empty() && bytes_per_group > 0, "empty grouped view");
  for (size_t e = 0; e < ptrs.size(); ++e) {
    PACKMOE_CHECK(ptrs[e] != nullptr, "grouped view: group " << e << " is null");
    PACKMOE_CHECK(layout == Layout::kDiscrete ||
                      ptrs[e] == static_cast<uint8_t*>(ptrs[0]) + e * bytes_per_group,
                  "a single-layout view needs consecutive groups");
  }
  GroupedStorage v;
  v.memory_ = &memory;
  v.layout_ = layout;
  v.bytes_per_group_ = bytes_per_group;
  v.ptrs_ = std::move(ptrs);
  return v;
}

void* GroupedStorage::packed() const {
  PACKMOE_CHECK(allocated() && layout_ == Layout::kSingle, "packed() needs single-layout storage");
  return ptrs_[0];
}

void GroupedStorage::zero() {
  if (layout_ == Layout::kSingle && allocated()) {
    memory_->fill_zero(ptrs_[0], groups() * bytes_per_group_);
    return;
  }
  for (void* p : ptrs_) memory_->fill_zero(p, bytes_per_group_);
}

void GroupedStorage::release() {
  buffers_.clear();
  ptrs_.clear();
}

std::vector<uint8_t> GroupedStorage::download() const {
  std::vector<uint8_t> host(groups() * bytes_per_group_);
  for (int64_t e = 0; e < groups(); ++e)
    memory_->copy(host.data() + e * bytes_per_group_, ptrs_[e], bytes_per_group_,
                  Backend::CopyKind::kDeviceToHost);
  return host;
}

void GroupedStorage::copy_from(const GroupedStorage& src) {
  PACKMOE_CHECK(src.groups() == groups() && src.bytes_per_group() == bytes_per_group_,
                "copy_from: " << src.groups() << " x " << src.bytes_per_group() << " bytes into "
                              << groups() << " x " << bytes_per_group_);
  const Backend::CopyKind kind = copy_kind(memory_->device(), src.memory().device());
  Backend& engine = copy_engine(*memory_, src.memory());
  if (layout_ == Layout::kSingle && src.layout() == Layout::kSingle && groups() > 0) {
    engine.copy(packed(), src.packed(), groups() * bytes_per_group_, kind);  // one copy, same bytes
    return;
  }
  for (int64_t e = 0; e < groups(); ++e) engine.copy(ptrs_[e], src.group(e), bytes_per_group_, kind);
}

// ---- elementwise ops on grouped storage ---------------------------------------------------------

void cast_f32_to_bf16(const GroupedStorage& src, const GroupedStorage& dst) {
  PACKMOE_CHECK(&src.memory() == &dst.memory(), "cast_f32_to_bf16: operands in different memories");
  check_op(ops::cast_f32_to_bf16(dst.memory(), segments<const float>(src), segments<uint16_t>(dst)),
           "cast_f32_to_bf16");
}

void add_f32(const GroupedStorage& dst, const GroupedStorage& src) {
  PACKMOE_CHECK(&src.memory() == &dst.memory(), "add_f32: operands in different memories");
  check_op(ops::add_f32(dst.memory(), segments<float>(dst), segments<const float>(src)), "add_f32");
}

void check_op(const Status& s, const char* what) {
  PACKMOE_CHECK(s.is_ok(), what << ": " << s.message());
}

}  // namespace packmoe
