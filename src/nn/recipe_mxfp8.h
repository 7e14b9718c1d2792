// Mxfp8Recipe: E4M3 values with one E8M0 scale per 32 along the reduction dimension (weights
// optionally 2D 32x32 tiles), rowwise and columnwise copies of every operand. Owns the weight's
// four copies. Invariant: a 2D weight's columnwise copy is derived from its rowwise one, so a
// data-parallel gather carries only the rowwise bytes.
#pragma once

#include "nn/linear_recipe.h"

namespace packmoe {

class Mxfp8Recipe final : public QuantizedRecipe {
 public:
  // Allocates the weight's copies: data (N, K) and scales (N, K/32) | (N/32, K) per expert.
  Mxfp8Recipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e, int64_t n,
              int64_t k);

  int64_t shard_unit_rows() const override { return kMxfp8Block; }
  void quantize_weight(const GroupedStorage& bf16, const float* amax) override;
  // 2D: {row_data, row_scale}; 1D: {row_data, row_scale, col_data, col_scale}.
  std::vector<PackedComponent> packed_components() const override;
  bool needs_global_amax() const override { return false; }
  void rows_amax(const GroupedMatrices& rows, float* amax) const override;
  void quantize_rows(const GroupedMatrices& rows, const float* amax,
                     const std::vector<std::vector<void*>>& outputs) const override;
  void write_packed(const std::vector<const void*>& images, const float* amax) override;
  ActivationCopies activation_copies(TensorRole role, const Tensor& a,
                                     const std::vector<int64_t>& m,
                                     uint64_t sr_offset) const override;
  DispatchPayload dispatch_payload(const Tensor& a, const std::vector<int64_t>& m) const override;
  ActivationCopies received_input_copies(const DispatchPayload& p,
                                         const std::vector<int64_t>& m) const override;
};

}  // namespace packmoe
