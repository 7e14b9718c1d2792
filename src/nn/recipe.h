// Precision recipes: which format each GEMM operand of a grouped linear uses and how it is
// quantized (TransformerEngine's defaults: docs/formats.md, "Which copy ...", "Recipes").
// Invariant: every quantizer setting of a layer comes from these functions, so the packed and the
// discrete layout, and the CPU and CUDA backends, quantize with the same configuration.
#pragma once

#include <cstdint>

#include "backend/ops/gemm.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace packmoe {

enum class Recipe { kBF16, kMxfp8, kNvfp4 };

// Where the weight's parameter lives between optimizer steps.
enum class PrimaryWeight {
  kHighPrecision,  // BF16 param, quantized for compute at every forward
  kLowPrecision,   // the quantized bytes ARE the param (no BF16 copy is kept)
};

// The three tensor roles of a linear layer, each with its own quantizer.
enum class TensorRole {
  kWeight,      // W (N, K): fprop rowwise, dgrad columnwise
  kInput,       // X (M, K): fprop rowwise, wgrad columnwise
  kGradOutput,  // dY (M, N): dgrad rowwise, wgrad columnwise
};

struct QuantRecipe {
  Recipe recipe = Recipe::kBF16;
  // MXFP8 weights: one E8M0 scale per 32x32 tile instead of 1x32 blocks (TE's
  // enable_2d_quantization, off by default).
  bool mxfp8_weight_2d = false;
  // NVFP4 stochastic rounding of gradients: Philox seed. The offset is advanced by the layer at
  // every call (formats/nvfp4.h numbers the draws), so no two calls reuse random bits; a trainer
  // sets it per micro-batch (nvfp4_grad_sr_offset).
  uint64_t sr_seed = 0;
};

// NVFP4 gradient SR: where the Philox stream of every GroupedLinear (each has its own seed) starts
// for micro-batch `index` of optimizer step `step` (1-based). `index` numbers the step's
// micro-batches in the sampler's order (micro * world + rank), so the offset is a function of the
// rows, not of the rank that processes them: the ranks of a data-parallel job draw different
// bits, and a run resumed on any number of ranks that splits the step alike draws the bits the
// uninterrupted run drew. Layout of the 64-bit offset: step (24 bits) | index (12) | the
// micro-batch's own 2^28 blocks of 16 draws. A step from 2^24 or an index from 2^12 on is a
// programming error: validate() and Trainer::create refuse such NVFP4 runs first.
uint64_t nvfp4_grad_sr_offset(int64_t step, int64_t index);
constexpr int kSrStepBits = 24, kSrIndexBits = 12, kSrBlockBits = 28;

const char* recipe_name(Recipe r);
OperandFormat operand_format(Recipe r);
// Tokens of every group must be a multiple of this (gemm_token_alignment of the format).
int64_t token_alignment(Recipe r);

// How expert parallelism's forward dispatch carries the FC1 input rows (--dispatch-dtype): BF16,
// or the expert recipe's quantized rowwise copy, which the FC1 GEMM reads anyway
// (nn/dispatch_payload.h). The backward's dY rows and every combine stay BF16.
enum class DispatchDtype { kBF16, kRecipe };
const char* dispatch_dtype_name(DispatchDtype d);
// Bytes one row of `cols` BF16 values takes in the forward dispatch: 2 cols (BF16), or the
// recipe's rowwise codes and block scales, MXFP8 cols (1 + 1/32), NVFP4 cols (1/2 + 1/16).
int64_t dispatch_row_bytes(Recipe r, DispatchDtype d, int64_t cols);
// Bytes each expert group adds beside its rows: NVFP4's FP32 amax with kRecipe, else 0.
int64_t dispatch_group_bytes(Recipe r, DispatchDtype d);

// MXFP8: E4M3 for every role, rowwise + columnwise (both copies are always produced: a weight
// needs both for fprop/dgrad, an activation both for fprop-or-dgrad and wgrad). Only weights
// may use 2D tiles.
Mxfp8Config mxfp8_config(const QuantRecipe& q, TensorRole role);

// NVFP4 (docs/formats.md): weights 2D 16x16 with RNE; inputs 1x16 rowwise + columnwise with the RHT
// on the columnwise copy; gradients the same plus stochastic rounding of both copies from
// (q.sr_seed, sr_offset). sr_offset is ignored for the other roles.
Nvfp4Config nvfp4_config(const QuantRecipe& q, TensorRole role, uint64_t sr_offset);

}  // namespace packmoe
