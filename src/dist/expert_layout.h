// ExpertLayout: which experts each rank holds under expert parallelism (EP). The world's R ranks
// form R / EP expert-parallel groups of EP consecutive ranks (ranks g*EP .. g*EP + EP - 1: the
// all-to-all stays inside a node when ranks fill nodes in order); EP rank i = rank % EP holds the
// experts [i * E / EP, (i + 1) * E / EP) of every MoE layer. Ranks with the same EP rank hold the
// same experts and form an expert-data-parallel group (rank / EP is the rank there). A pure
// function of (R, EP, E), so every rank computes the same layout.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace packmoe {

struct ExpertLayout {
  int world = 1;        // R
  int ep = 1;           // EP
  int64_t experts = 0;  // E of every MoE layer

  int64_t local_experts() const { return experts / ep; }  // E / EP
  int ep_rank(int rank) const { return rank % ep; }
  // The EP communicator's color; also the rank within the expert-data-parallel group (whose
  // color is ep_rank).
  int ep_group(int rank) const { return rank / ep; }
  int64_t first_expert(int rank) const { return ep_rank(rank) * local_experts(); }
};

// Errors (one line for the user): EP < 1, EP not dividing R or E, EP > 1 on a model without MoE
// layers (moe_layers = 0).
Result<ExpertLayout> make_expert_layout(int world, int ep, int64_t experts, int64_t moe_layers);

}  // namespace packmoe
