// The distributed optimizer's state in a form that outlives its world size: one rank's shard as
// saved (self-describing pieces, a binary file form with magic, version and header), and the full
// per-parameter state that shards of any world size assemble into and any world size loads from.
// Invariant: a shard names exactly which elements of which parameter it holds, so a load needs
// neither the saving job's plan code nor its world size; assembly checks full, exact coverage.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "dist/shard_plan.h"

namespace packmoe {

// What rank `rank` of `world_size` holds: for each piece (in buffer order) its elements of the
// FP32 master and the two AdamW moments, concatenated without padding.
struct OptimizerShard {
  int world_size = 0;
  int rank = 0;
  int64_t steps = 0;                  // AdamW steps taken
  std::vector<ParamGeometry> params;  // every parameter, registration order
  std::vector<ShardPiece> pieces;     // this rank's (offset: position in the saving job's buffer)
  std::vector<float> master, exp_avg, exp_avg_sq;  // (sum of piece counts) each
};

// The whole state, per parameter in registration order: (E*N*K) F32 each.
struct FullOptimizerState {
  int64_t steps = 0;
  std::vector<ParamGeometry> params;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;
};

// File form, little-endian: "PKMOSHRD", u32 version 1, i32 world_size, i32 rank, i64 steps,
// i64 P, P x (i64 E, N, K, unit_rows), i64 pieces, pieces x (i64 param, begin, count, offset),
// then the master, exp_avg and exp_avg_sq arrays (F32, sum of counts each).
std::vector<uint8_t> encode_optimizer_shard(const OptimizerShard& shard);
// Errors (Status): wrong magic or version, truncated or trailing bytes, pieces outside their
// parameter, array sizes that disagree with the pieces.
Result<OptimizerShard> decode_optimizer_shard(std::span<const uint8_t> bytes);

// From every rank's shard of one save, in any order. Errors: a missing or repeated rank, shards
// that disagree on world size, steps or parameters, an element covered twice or never.
Result<FullOptimizerState> assemble_optimizer_state(const std::vector<OptimizerShard>& shards);

}  // namespace packmoe
