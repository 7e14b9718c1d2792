// plan_memory: the Trainer's parameters, optimizers and gather buffers rebuilt from the model's
// parameter specs (train/memory_plan.h); each figure mirrors the code that allocates it, named
// beside it.
#include "train/memory_plan.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "backend/ops/moe.h"
#include "dist/expert_layout.h"
#include "dist/shard_plan.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "nn/recipe.h"

namespace packmoe::train {
namespace {

// One parameter as the Model makes it (nn/model.cpp) and the Trainer hands it to its optimizer
// (train/trainer.cpp optimizer_params).
struct PlannedParam {
  ParamGeometry geometry;
  QuantRecipe recipe;
  PrimaryWeight primary = PrimaryWeight::kHighPrecision;
  bool fp32_form = false;  // WeightForm::kFp32: the embedding table and every norm

  bool quantized() const { return recipe.recipe != Recipe::kBF16; }
  bool keeps_bf16() const { return !quantized() || primary == PrimaryWeight::kHighPrecision; }
};

// LinearRecipe::shard_unit_rows (nn/recipe_bf16.h, recipe_mxfp8.h, recipe_nvfp4.h).
int64_t unit_rows(Recipe r) {
  switch (r) {
    case Recipe::kBF16:
      return 1;
    case Recipe::kMxfp8:
      return kMxfp8Block;
    case Recipe::kNvfp4:
      return kNvfp4Block;
  }
  return 1;
}

// What GroupedParam allocates for its primary weight (nn/grouped_param.cpp weight_components):
// the BF16 param when it keeps one, and the recipe's quantized copies, all four of them, since a
// weight needs its rowwise copy for fprop and its columnwise one for dgrad (the Mxfp8Recipe and
// Nvfp4Recipe constructors, nn/recipe_mxfp8.cpp and nn/recipe_nvfp4.cpp).
int64_t weight_bytes(const PlannedParam& p) {
  const int64_t e = p.geometry.experts, nk = p.geometry.rows * p.geometry.cols;
  int64_t bytes = p.keeps_bf16() ? e * nk * 2 : 0;
  switch (p.recipe.recipe) {
    case Recipe::kBF16:
      break;
    case Recipe::kMxfp8:  // {row,col}_data E4M3, {row,col}_scale E8M0 per 32 elements
      bytes += 2 * e * (nk + nk / kMxfp8Block);
      break;
    case Recipe::kNvfp4:  // {row,col}_data 2 elements a byte, E4M3 scales per 16; (E,) amax and
                          // decode scale F32
      bytes += 2 * e * (nk / 2 + nk / kNvfp4Block) + 2 * e * 4;
      break;
  }
  return bytes;
}

// What a lowp gather carries per element, {num, den} bytes, in image order
// (GroupedParam::packed_components: Mxfp8Recipe / Nvfp4Recipe::packed_components).
std::vector<std::pair<int64_t, int64_t>> packed_components(const PlannedParam& p) {
  if (p.keeps_bf16()) return {{2, 1}};
  if (p.recipe.recipe == Recipe::kNvfp4) return {{1, 2}, {1, kNvfp4Block}};
  if (p.recipe.mxfp8_weight_2d) return {{1, 1}, {1, kMxfp8Block}};
  return {{1, 1}, {1, kMxfp8Block}, {1, 1}, {1, kMxfp8Block}};
}

// The parts of one DistOptimizer that are the same on all its ranks.
struct OptimizerLayout {
  ShardPlan plan;
  int64_t all_gather_bytes = 0;
  int64_t fp32_gather_bytes = 0;
  int64_t gather_buffer_bytes = 0;  // without lowp's per-rank shard of BF16 rows
};

// DistOptimizer's constructor over `params` on `ranks` ranks in mode `gather`.
Result<OptimizerLayout> optimizer_layout(const std::vector<PlannedParam>& params, int ranks,
                                         GatherMode gather, int64_t bucket_elems) {
  std::vector<ParamGeometry> geometries;
  for (const PlannedParam& p : params) geometries.push_back(p.geometry);
  Result<ShardPlan> plan = ShardPlan::make(std::move(geometries), ranks, bucket_elems);
  if (!plan) return plan.status();
  OptimizerLayout o{std::move(plan).value()};
  const size_t count = params.size();
  std::vector<std::pair<int64_t, int64_t>> none(count, {0, 1});
  // NVFP4 low-precision primaries: the (E,) amax agreed before quantizing (lowp) or taken by
  // AdamW's pass over the image (bf16).
  int64_t amax = 0;
  for (const PlannedParam& p : params)
    if (!p.fp32_form && !p.keeps_bf16() && p.recipe.recipe == Recipe::kNvfp4)
      amax += p.geometry.experts;
  if (gather == GatherMode::kLowp) {
    size_t classes = 0;
    for (const PlannedParam& p : params)
      if (!p.fp32_form)  // only its replica travels
        classes = std::max(classes, packed_components(p).size());
    for (size_t c = 0; c < classes; ++c) {
      std::vector<std::pair<int64_t, int64_t>> ratio = none;
      for (size_t p = 0; p < count; ++p) {
        if (params[p].fp32_form) continue;
        const std::vector<std::pair<int64_t, int64_t>> comps = packed_components(params[p]);
        if (c < comps.size()) ratio[p] = comps[c];
      }
      const int64_t bytes = gather_slots(o.plan, ratio, kGatherImageAlign).bytes;
      o.all_gather_bytes += bytes;
      o.gather_buffer_bytes += bytes;
    }
    o.gather_buffer_bytes += amax * 4;
  } else {
    std::vector<std::pair<int64_t, int64_t>> bf16 = none;
    int64_t bound = 0;  // BF16 primaries that are views of the image (kBf16 only)
    for (size_t p = 0; p < count; ++p) {
      if (params[p].fp32_form) continue;
      bf16[p] = {2, 1};
      if (params[p].keeps_bf16()) bound += 2 * params[p].geometry.numel();
    }
    const bool own_buffer = gather == GatherMode::kBf16;
    o.all_gather_bytes =
        gather_slots(o.plan, bf16, own_buffer ? kBoundGatherImageAlign : kGatherImageAlign).bytes;
    // reuse-grad-buffer: the image lies in the gradient buffer's memory.
    if (own_buffer) o.gather_buffer_bytes = o.all_gather_bytes - bound + amax * 4;
  }
  std::vector<std::pair<int64_t, int64_t>> fp32 = none;
  for (size_t p = 0; p < count; ++p)
    if (params[p].fp32_form) fp32[p] = {4, 1};
  o.fp32_gather_bytes = gather_slots(o.plan, fp32, kGatherImageAlign).bytes;
  o.all_gather_bytes += o.fp32_gather_bytes;
  return o;
}

OptimizerMemory rank_part(const OptimizerLayout& o, int rank, GatherMode gather) {
  OptimizerMemory m;
  m.ranks = o.plan.world_size();
  m.grad_elements = o.plan.total();
  m.master_elements = o.plan.shard(rank).size();
  m.gather_buffer_bytes = o.gather_buffer_bytes;
  if (gather == GatherMode::kLowp) m.gather_buffer_bytes += 2 * m.master_elements;
  m.fp32_gather_bytes = o.fp32_gather_bytes;
  m.fp32_replica_bytes = m.ranks > 1 ? o.fp32_gather_bytes : 0;
  m.all_gather_bytes = o.all_gather_bytes;
  m.reduce_scatter_bytes = 4 * o.plan.total();
  return m;
}

}  // namespace

const RankMemory& MemoryPlan::largest() const {
  return *std::max_element(
      ranks.begin(), ranks.end(),
      [](const RankMemory& a, const RankMemory& b) { return a.total_bytes() < b.total_bytes(); });
}

Result<MemoryPlan> plan_memory(const ModelConfig& model, const ModelPrecision& experts,
                               GatherMode gather, int world, int ep, int64_t bucket_elems) {
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) moe_layers += model.is_moe_layer(i);
  Result<ExpertLayout> layout = make_expert_layout(world, ep, model.num_experts, moe_layers);
  if (!layout) return layout.status();
  // The parameters in model_param_specs order, as the Model holds them: dense weights as one
  // group (nn/layer_ops.cpp as_single_group: (N, K) -> (1, N, K), (D) -> (1, 1, D)), BF16 with a
  // BF16 primary; experts (E / EP, N, K) in the expert precision.
  std::vector<PlannedParam> dense, local;
  int64_t dense_params = 0, expert_params = 0, weights = 0;
  const std::vector<ParamSpec> specs = model_param_specs(model);
  for (size_t i = 0; i < specs.size(); ++i) {
    const Shape& s = specs[i].shape;
    PlannedParam p;
    const bool expert = s.size() == 3;
    if (expert) {
      p.geometry = {layout.value().local_experts(), s[1], s[2], unit_rows(experts.recipe.recipe)};
      p.recipe = experts.recipe;
      p.primary = experts.primary;
      expert_params += p.geometry.numel();
    } else {
      p.geometry = {1, s.size() == 2 ? s[0] : 1, s.back(), 1};
      // Model::params(): the embedding table (or the tied LM head it reads) and every norm.
      p.fp32_form = i == 0 || s.size() == 1;
      dense_params += p.geometry.numel();
    }
    weights += weight_bytes(p);
    (expert && ep > 1 ? local : dense).push_back(p);
  }
  Result<OptimizerLayout> all_ranks = optimizer_layout(dense, world, gather, bucket_elems);
  if (!all_ranks) return all_ranks.status();
  std::optional<OptimizerLayout> edp;
  if (ep > 1) {
    Result<OptimizerLayout> o = optimizer_layout(local, world / ep, gather, bucket_elems);
    if (!o) return o.status();
    edp = std::move(o).value();
  }
  MemoryPlan plan;
  plan.world = world;
  plan.ep = ep;
  for (int r = 0; r < world; ++r) {
    RankMemory m;
    m.rank = r;
    m.dense_params = dense_params;
    m.expert_params = expert_params;
    m.weight_bytes = weights;
    m.dense = rank_part(all_ranks.value(), r, gather);
    // The expert-data-parallel group's rank (dist/expert_layout.h ep_group).
    if (edp) m.experts = rank_part(*edp, layout.value().ep_group(r), gather);
    plan.ranks.push_back(m);
  }
  return plan;
}

AllToAllPlan plan_all_to_all(const ModelConfig& model, Recipe recipe, DispatchDtype dispatch,
                             int ep, int64_t tokens, int64_t grad_accum) {
  AllToAllPlan p;
  if (ep <= 1) return p;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) p.moe_layers += model.is_moe_layer(i);
  const int64_t row_bytes = model.hidden_size * 2;  // BF16
  p.row_bytes = row_bytes;
  p.dispatch_row_bytes = dispatch_row_bytes(recipe, dispatch, model.hidden_size);
  p.dispatch_group_bytes = dispatch_group_bytes(recipe, dispatch);
  const int64_t k = model.num_experts_per_tok, e = model.num_experts;
  const int64_t max_rows = routing_plan_max_rows(tokens, e, k, token_alignment(recipe));
  // Each pass: own rows in the dispatch dtype and in BF16, received rows twice in BF16, and the
  // per-expert bytes to every holder (E in all, E (EP - 1) / EP of them to peers).
  const int64_t passes = p.moe_layers * grad_accum;
  p.max_bytes_per_step = passes * (max_rows * (p.dispatch_row_bytes + row_bytes) +
                                   2 * ep * max_rows * row_bytes + e * p.dispatch_group_bytes);
  p.even_remote_bytes_per_step =
      passes * (tokens * k * (p.dispatch_row_bytes + 3 * row_bytes) + e * p.dispatch_group_bytes) *
      (ep - 1) / ep;
  p.max_receive_bytes = ep * max_rows * row_bytes;
  return p;
}

}  // namespace packmoe::train
