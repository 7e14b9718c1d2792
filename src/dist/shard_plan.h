// ShardPlan: where every parameter lives in the one flat FP32 gradient buffer of data parallelism,
// the buckets the buffer is reduce-scattered in, and the one contiguous shard each rank owns.
// Invariants: a pure function of (parameter geometries, world size, bucket size), so every rank
// computes the same plan; parameters are laid out in REVERSE order (backward fills the buffer
// front to back), each starting at a multiple of kParamAlign elements; a bucket never splits a
// parameter; every shard boundary inside a parameter falls on a whole quantization block of rows
// (unit_rows x K elements), so each rank can quantize its own shard with no data from others.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/status.h"

namespace packmoe {

// A packed parameter (E, N, K), flattened row-major to E*N*K elements.
struct ParamGeometry {
  int64_t experts = 0;    // E
  int64_t rows = 0;       // N
  int64_t cols = 0;       // K
  int64_t unit_rows = 1;  // rows of one quantization block along N (MXFP8 32, NVFP4 16, BF16 1)

  int64_t numel() const { return experts * rows * cols; }
  int64_t unit() const { return unit_rows * cols; }  // elements between legal shard boundaries
  bool operator==(const ParamGeometry&) const = default;
};

// Elements [offset, offset + numel) of the flat buffer hold the parameter.
struct ParamSlot {
  int64_t offset = 0;
  int64_t numel = 0;
};

// Elements [begin, end) of the flat buffer.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// The part of parameter `param` (registration index) inside one rank's shard: its elements
// [begin, begin + count), at flat buffer position offset = slot.offset + begin.
struct ShardPiece {
  int param = 0;
  int64_t begin = 0;
  int64_t count = 0;
  int64_t offset = 0;
  bool operator==(const ShardPiece&) const = default;
};

// Parameter starts are multiples of this many elements: 256 bytes of FP32, 128 of the BF16
// image, so every view handed to a kernel allows 16-byte accesses.
inline constexpr int64_t kParamAlign = 64;

class ShardPlan {
 public:
  // params in registration order. Errors (Status): no params, a non-positive dimension, N not a
  // multiple of unit_rows, world_size < 1, bucket_elems < 1.
  static Result<ShardPlan> make(std::vector<ParamGeometry> params, int world_size,
                                int64_t bucket_elems);

  int world_size() const { return world_size_; }
  int64_t total() const { return total_; }  // buffer length in elements, padding included
  int64_t bucket_elems() const { return bucket_elems_; }
  int params() const { return static_cast<int>(geometry_.size()); }
  const std::vector<ParamGeometry>& geometries() const { return geometry_; }
  const ParamGeometry& geometry(int p) const { return geometry_.at(p); }
  const ParamSlot& slot(int p) const { return slot_.at(p); }
  // Parameter indices in buffer order (the reverse of registration order).
  const std::vector<int>& buffer_order() const { return order_; }
  int64_t param_elements() const;  // sum of numel, no padding

  // Shard of `rank`: boundaries are the legal cut nearest to rank * total / world_size (ties
  // to the lower one); a shard may be empty.
  FlatRange shard(int rank) const { return {bounds_.at(rank), bounds_.at(rank + 1)}; }
  std::vector<int64_t> shard_sizes() const;  // (world_size)
  // The parameter pieces of a shard, in buffer order.
  std::vector<ShardPiece> pieces(int rank) const;

  // Buckets in buffer order: whole parameters (with the padding after each), closed once they
  // reach bucket_elems; together they cover [0, total).
  const std::vector<FlatRange>& buckets() const { return buckets_; }
  // |bucket b ∩ shard(r)| for every rank r: the reduce_scatterv counts of bucket b.
  std::vector<int64_t> bucket_counts(size_t b) const;

 private:
  int64_t snap(int64_t target) const;  // the legal cut nearest to target

  int world_size_ = 1;
  int64_t bucket_elems_ = 1;
  int64_t total_ = 0;
  std::vector<ParamGeometry> geometry_;
  std::vector<ParamSlot> slot_;
  std::vector<int> order_;
  std::vector<int64_t> bounds_;  // (world_size + 1) shard boundaries
  std::vector<FlatRange> buckets_;
};

// A gather buffer's layout (dist/dist_optimizer.h): one component of the params that have it, as
// flat images in buffer order, param p taking numel(p) * ratio[p].first / ratio[p].second bytes
// (ratio {0, 1}: p has none), each slot's start `align`-byte aligned, so each rank's bytes are one
// contiguous range. DistOptimizer allocates by it and train::plan_memory counts by it.
inline constexpr int64_t kGatherImageAlign = 16;  // lowp and FP32 images
// A BF16 image slot bound as a param's primary is a GEMM operand: aligned as an allocation is.
inline constexpr int64_t kBoundGatherImageAlign = 256;
struct GatherSlots {
  std::vector<int64_t> offset;    // (P) image start of param p, bytes; -1 when p lacks it
  std::vector<int64_t> num, den;  // (P) bytes per element of p's component: num / den
  int64_t bytes = 0;              // the whole buffer
};
GatherSlots gather_slots(const ShardPlan& plan,
                         const std::vector<std::pair<int64_t, int64_t>>& ratio, int64_t align);

}  // namespace packmoe
