// ShardPlan: reverse-order layout with aligned starts, buckets of whole parameters, and shard
// boundaries snapped to quantization blocks.
#include "dist/shard_plan.h"

#include <algorithm>
#include <string>

namespace packmoe {

Result<ShardPlan> ShardPlan::make(std::vector<ParamGeometry> params, int world_size,
                                  int64_t bucket_elems) {
  if (params.empty()) return Status::error("shard plan: no parameters");
  if (world_size < 1) return Status::error("shard plan: world size " + std::to_string(world_size));
  if (bucket_elems < 1)
    return Status::error("shard plan: bucket size " + std::to_string(bucket_elems) + " elements");
  for (size_t p = 0; p < params.size(); ++p) {
    const ParamGeometry& g = params[p];
    const std::string name = "shard plan: parameter " + std::to_string(p) + " (" +
                             std::to_string(g.experts) + ", " + std::to_string(g.rows) + ", " +
                             std::to_string(g.cols) + ")";
    if (g.experts < 1 || g.rows < 1 || g.cols < 1 || g.unit_rows < 1)
      return Status::error(name + " has a non-positive dimension or block");
    if (g.rows % g.unit_rows != 0)
      return Status::error(name + ": N is not a multiple of its " + std::to_string(g.unit_rows) +
                           "-row quantization block");
  }
  ShardPlan plan;
  plan.world_size_ = world_size;
  plan.bucket_elems_ = bucket_elems;
  plan.geometry_ = std::move(params);
  const int count = plan.params();
  plan.slot_.resize(count);
  for (int p = count - 1; p >= 0; --p) plan.order_.push_back(p);
  int64_t offset = 0;
  int64_t bucket_begin = 0;
  for (int p : plan.order_) {
    plan.slot_[p] = {offset, plan.geometry_[p].numel()};
    offset = (offset + plan.geometry_[p].numel() + kParamAlign - 1) / kParamAlign * kParamAlign;
    if (offset - bucket_begin >= bucket_elems) {
      plan.buckets_.push_back({bucket_begin, offset});
      bucket_begin = offset;
    }
  }
  plan.total_ = offset;
  if (bucket_begin < offset) plan.buckets_.push_back({bucket_begin, offset});
  plan.bounds_.push_back(0);
  for (int r = 1; r < world_size; ++r)
    plan.bounds_.push_back(plan.snap(plan.total_ * r / world_size));
  plan.bounds_.push_back(plan.total_);
  return plan;
}

int64_t ShardPlan::snap(int64_t target) const {
  for (int p : order_) {
    const ParamSlot& s = slot_[p];
    if (target < s.offset || target >= s.offset + s.numel) continue;
    const int64_t unit = geometry_[p].unit();  // numel is a multiple of it
    const int64_t down = s.offset + (target - s.offset) / unit * unit;
    return target - down <= down + unit - target ? down : down + unit;
  }
  return target;  // padding, or the end: any position there is a legal cut
}

int64_t ShardPlan::param_elements() const {
  int64_t n = 0;
  for (const ParamGeometry& g : geometry_) n += g.numel();
  return n;
}

std::vector<int64_t> ShardPlan::shard_sizes() const {
  std::vector<int64_t> out;
  for (int r = 0; r < world_size_; ++r) out.push_back(shard(r).size());
  return out;
}

std::vector<ShardPiece> ShardPlan::pieces(int rank) const {
  const FlatRange sh = shard(rank);
  std::vector<ShardPiece> out;
  for (int p : order_) {
    const ParamSlot& s = slot_[p];
    const int64_t begin = std::max(sh.begin, s.offset), end = std::min(sh.end, s.offset + s.numel);
    if (begin < end) out.push_back({p, begin - s.offset, end - begin, begin});
  }
  return out;
}

std::vector<int64_t> ShardPlan::bucket_counts(size_t b) const {
  const FlatRange& bk = buckets_.at(b);
  std::vector<int64_t> out;
  for (int r = 0; r < world_size_; ++r) {
    const FlatRange sh = shard(r);
    out.push_back(std::max<int64_t>(0, std::min(bk.end, sh.end) - std::max(bk.begin, sh.begin)));
  }
  return out;
}

GatherSlots gather_slots(const ShardPlan& plan,
                         const std::vector<std::pair<int64_t, int64_t>>& ratio, int64_t align) {
  GatherSlots g;
  const int count = plan.params();
  g.offset.assign(count, -1);
  g.num.assign(count, 0);
  g.den.assign(count, 1);
  int64_t at = 0;
  for (int p : plan.buffer_order()) {
    if (ratio[p].first == 0) continue;
    at = (at + align - 1) / align * align;
    g.offset[p] = at;
    g.num[p] = ratio[p].first;
    g.den[p] = ratio[p].second;
    at += plan.geometry(p).numel() * g.num[p] / g.den[p];
  }
  g.bytes = at;
  return g;
}

}  // namespace packmoe
