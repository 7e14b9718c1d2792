// plan_memory: what every rank of a training job holds, computed from the model's shape alone
// (no Model, optimizer or data is built: `packmoe train --dry-run RANKS` sizes a job larger than
// the machine it runs on). It follows the Trainer's split exactly: without expert parallelism one
// DistOptimizer over all ranks holds every parameter; with EP > 1 the dense parameters' runs over
// all ranks and the experts' (E / EP per rank) over the expert-data-parallel group of rank r
// (world / EP ranks; rank r / EP there), each laid out by ShardPlan::make with the trainer's
// bucket size (dist/parallel_optimizer.h, dist/shard_plan.h). Invariant: the gradient and master
// elements equal the real optimizers' plan().total() and shard().size() on every rank, the weight
// bytes the params' weight_components(), the all-gather and reduce-scatter bytes their traffic()
// (tests/dist/test_memory_plan.cpp). Not counted: activations, GEMM and attention workspace, the
// CUDA context, allocator slack, the communicators' staging (docs/dist.md).
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "dist/dist_optimizer.h"
#include "nn/model.h"

namespace packmoe::train {

// One DistOptimizer's part of a rank (the dense parameters', or the experts').
struct OptimizerMemory {
  int ranks = 0;                // the optimizer's communicator size (0: no such optimizer)
  int64_t grad_elements = 0;    // the FP32 gradient buffer, padding included: plan().total()
  int64_t master_elements = 0;  // this rank's FP32 master shard: shard().size()
  // The gather mode's staging beyond the weights themselves: bf16, the BF16 image of the
  // quantized params (the BF16 params' slots ARE their primaries) and NVFP4's amax; lowp, the
  // quantized images of every param, the shard's BF16 rows and NVFP4's amax; reuse-grad-buffer,
  // none (the grad buffer).
  int64_t gather_buffer_bytes = 0;
  int64_t fp32_gather_bytes = 0;  // the FP32 replicas' part of all_gather_bytes
  // The FP32 gather buffer that the replicas are views of; none on one rank, where they view the
  // master (dist/dist_optimizer.cpp).
  int64_t fp32_replica_bytes = 0;
  int64_t all_gather_bytes = 0;      // per step, all ranks together: traffic().all_gather_bytes
  int64_t reduce_scatter_bytes = 0;  // per step: traffic().reduce_scatter_bytes
};

struct RankMemory {
  int rank = 0;
  int64_t dense_params = 0;   // elements of the dense parameters (every rank holds them all)
  int64_t expert_params = 0;  // elements of this rank's experts (E / EP of every MoE layer)
  // The primary weights as the params hold them (GroupedParam::weight_components): BF16 params
  // 2 B/element; a quantized expert keeps BOTH its rowwise and columnwise copies (MXFP8 data and
  // E8M0 scales: 2 x (1 + 1/32) B/element; NVFP4 2 x (1/2 + 1/16) B/element plus the (E,) amax and
  // decode scales), plus the BF16 param with --primary high.
  int64_t weight_bytes = 0;
  OptimizerMemory dense;    // every parameter without expert parallelism
  OptimizerMemory experts;  // ranks = 0 without expert parallelism

  int64_t params() const { return dense_params + expert_params; }
  int64_t grad_bytes() const { return 4 * (dense.grad_elements + experts.grad_elements); }
  int64_t master_bytes() const { return 4 * (dense.master_elements + experts.master_elements); }
  int64_t moment_bytes() const { return 2 * master_bytes(); }  // AdamW exp_avg and exp_avg_sq
  int64_t fp32_replica_bytes() const {
    return dense.fp32_replica_bytes + experts.fp32_replica_bytes;
  }
  int64_t gather_buffer_bytes() const {
    return dense.gather_buffer_bytes + experts.gather_buffer_bytes;
  }
  int64_t total_bytes() const {
    return weight_bytes + fp32_replica_bytes() + grad_bytes() + master_bytes() + moment_bytes() +
           gather_buffer_bytes();
  }
};

struct MemoryPlan {
  int world = 1;
  int ep = 1;
  std::vector<RankMemory> ranks;  // (world), rank order
  // The rank with the most bytes (the lowest of equals).
  const RankMemory& largest() const;
};

// The plan of a job of `world` ranks with expert parallelism `ep`, the experts in `experts`'
// recipe and primary weight, every other parameter BF16 (nn/model.h), the optimizers' buckets of
// `bucket_elems` and gather mode `gather`. Errors: make_expert_layout's (EP not dividing the
// ranks or the experts, EP > 1 without MoE layers), a bucket size < 1.
Result<MemoryPlan> plan_memory(const ModelConfig& model, const ModelPrecision& experts,
                               GatherMode gather, int world, int ep, int64_t bucket_elems);

// Expert parallelism's all-to-all rows of one rank (dist/ep_token_dispatcher.h), H columns each.
// In every MoE layer and micro-batch the rank sends its own routed rows twice (the forward's
// dispatch in the dispatch dtype: row_bytes, or dispatch_row_bytes with --dispatch-dtype recipe
// plus dispatch_group_bytes per expert (NVFP4's amax); the backward's dY rows in BF16: T x k,
// each expert's padded to the recipe's token alignment, at most routing_plan_max_rows(T, E, k,
// align)) and the rows it received twice in BF16 (sent back by the forward's combine and as dX
// rows in backward: at most EP times that maximum, every peer's rows for its experts). The rows of
// its own experts stay on the rank (a local copy).
struct AllToAllPlan {
  int64_t moe_layers = 0;
  int64_t row_bytes = 0;             // 2 H: a BF16 row (dY dispatch, both combines)
  int64_t dispatch_row_bytes = 0;    // a row of the forward's dispatch (nn/recipe.h)
  int64_t dispatch_group_bytes = 0;  // per expert beside the forward's rows, to each holder
  int64_t max_bytes_per_step = 0;  // every row padded as far as a plan can, all sent to this rank
  int64_t even_remote_bytes_per_step = 0;  // even routing: T k rows each way, (EP - 1) / EP to peers
  int64_t max_receive_bytes = 0;   // the largest receive buffer of one dispatch (backward's dY)
};
// tokens: of one micro-batch on one rank (micro-batch rows x sequence length). All zero with
// EP = 1 (nothing travels).
AllToAllPlan plan_all_to_all(const ModelConfig& model, Recipe recipe, DispatchDtype dispatch,
                             int ep, int64_t tokens, int64_t grad_accum);

}  // namespace packmoe::train
