// Per-role quantizer settings of each recipe (TE defaults).
#include "nn/recipe.h"

#include "core/check.h"

namespace packmoe {

const char* recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kBF16: return "bf16";
    case Recipe::kMxfp8: return "mxfp8";
    case Recipe::kNvfp4: return "nvfp4";
  }
  return "?";
}

OperandFormat operand_format(Recipe r) {
  switch (r) {
    case Recipe::kBF16: return OperandFormat::kBF16;
    case Recipe::kMxfp8: return OperandFormat::kMxfp8;
    case Recipe::kNvfp4: return OperandFormat::kNvfp4;
  }
  return OperandFormat::kBF16;
}

int64_t token_alignment(Recipe r) { return gemm_token_alignment(operand_format(r)); }

const char* dispatch_dtype_name(DispatchDtype d) {
  return d == DispatchDtype::kBF16 ? "bf16" : "recipe";
}

int64_t dispatch_row_bytes(Recipe r, DispatchDtype d, int64_t cols) {
  PACKMOE_CHECK(d == DispatchDtype::kBF16 || r != Recipe::kBF16,
                "dispatch dtype recipe needs a quantized recipe, not bf16");
  if (d == DispatchDtype::kBF16) return 2 * cols;
  if (r == Recipe::kMxfp8) return cols + cols / kMxfp8Block;
  return cols / 2 + cols / kNvfp4Block;
}

int64_t dispatch_group_bytes(Recipe r, DispatchDtype d) {
  return d == DispatchDtype::kRecipe && r == Recipe::kNvfp4 ? int64_t{sizeof(float)} : 0;
}

Mxfp8Config mxfp8_config(const QuantRecipe& q, TensorRole role) {
  Mxfp8Config c;
  c.element = DType::kE4M3;
  c.rowwise = true;
  c.columnwise = true;
  c.two_d = role == TensorRole::kWeight && q.mxfp8_weight_2d;
  return c;
}

Nvfp4Config nvfp4_config(const QuantRecipe& q, TensorRole role, uint64_t sr_offset) {
  Nvfp4Config c;
  c.rowwise = true;
  c.columnwise = true;
  switch (role) {
    case TensorRole::kWeight:
      c.two_d = true;  // row and column copies are exact transposes; RNE, no RHT
      break;
    case TensorRole::kInput:
      c.rht = true;  // columnwise (wgrad) copy only
      break;
    case TensorRole::kGradOutput:
      c.rht = true;
      c.stochastic_rounding = true;
      c.seed = q.sr_seed;
      c.offset = sr_offset;
      break;
  }
  return c;
}

uint64_t nvfp4_grad_sr_offset(int64_t step, int64_t index) {
  static_assert(kSrStepBits + kSrIndexBits + kSrBlockBits == 64, "the offset's 64 bits");
  PACKMOE_CHECK(step >= 1 && step < (int64_t{1} << kSrStepBits),
                "NVFP4 stochastic rounding: step " << step << " outside [1, 2^" << kSrStepBits << ")");
  PACKMOE_CHECK(index >= 0 && index < (int64_t{1} << kSrIndexBits),
                "NVFP4 stochastic rounding: " << index + 1 << " micro-batches in one step (at most 2^"
                                              << kSrIndexBits << ")");
  return (static_cast<uint64_t>(step) << (kSrIndexBits + kSrBlockBits)) |
         (static_cast<uint64_t>(index) << kSrBlockBits);
}

}  // namespace packmoe
