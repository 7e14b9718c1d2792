// make_expert_layout: the checks of an expert-parallel layout (dist/expert_layout.h).
#include "dist/expert_layout.h"

#include <string>

namespace packmoe {

Result<ExpertLayout> make_expert_layout(int world, int ep, int64_t experts, int64_t moe_layers) {
  const std::string eps = "--expert-parallel " + std::to_string(ep);
  if (ep < 1) return Status::error(eps + ": expert parallelism needs EP >= 1");
  if (world < 1 || world % ep != 0)
    return Status::error(eps + " does not divide the " + std::to_string(world) +
                         " ranks: EP ranks form each expert-parallel group");
  if (ep > 1 && moe_layers == 0)
    return Status::error(eps + " on a model without MoE layers: there are no experts to shard");
  if (ep > 1 && experts % ep != 0)
    return Status::error(eps + " does not divide the " + std::to_string(experts) +
                         " experts per layer: each rank holds E / EP of them");
  ExpertLayout l;
  l.world = world;
  l.ep = ep;
  l.experts = experts;
  return l;
}

}  // namespace packmoe
