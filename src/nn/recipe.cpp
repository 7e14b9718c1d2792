// Per-role quantizer settings of each recipe (TE defaults).
#include "nn/recipe.h"

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

}  // namespace packmoe
