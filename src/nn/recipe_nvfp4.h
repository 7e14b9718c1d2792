// Nvfp4Recipe: E2M1 values with one E4M3 scale per 16 and an FP32 per-tensor (per-expert) scale;
// weights 2D 16x16 tiles with RNE, activations 1x16 with the RHT on the wgrad copies and
// stochastic rounding of gradients. Owns the weight's two copies and its (E,) amax and decode
// scales. Invariant: a weight's columnwise copy is the exact transpose of its rowwise one, and a
// row range is quantized with the whole expert's amax, so shards quantize as the pack does.
#pragma once

#include "nn/linear_recipe.h"

namespace packmoe {

class Nvfp4Recipe final : public QuantizedRecipe {
 public:
  // Allocates the weight's copies: (N, K/2) + (N, K/16) and (K, N/2) + (K, N/16) per expert,
  // and the (E,) amax and decode scales as one array in both layouts.
  Nvfp4Recipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e, int64_t n,
              int64_t k);

  int64_t shard_unit_rows() const override { return kNvfp4Block; }
  void quantize_weight(const GroupedStorage& bf16, const float* amax) override;
  // {row_data, row_scale}, plus the (E,) amax passed beside them.
  std::vector<PackedComponent> packed_components() const override;
  bool needs_global_amax() const override { return true; }
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

 private:
  void decode_scales();  // w_.decode_scale from w_.amax, one launch
  // The copies' memory of `rows` activation rows of C columns grouped by m: the columnwise codes
  // and scales, (C, m_g/2) and (C, m_g/16) per group (col_data, col_scale), and the rowwise copy
  // kept as its (m_g, C) BF16 values (row_bf16); the copies' formats and pointers set in `out`.
  void activation_memory(int64_t rows, int64_t c, const std::vector<int64_t>& m,
                         ActivationCopies& out, std::vector<void*>& col_data,
                         std::vector<void*>& col_scale, std::vector<void*>& row_bf16) const;
};

}  // namespace packmoe
