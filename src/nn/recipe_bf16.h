// Bf16Recipe: every GEMM reads BF16 values as they are. The weight has no quantized copies (its
// operands are the BF16 param, GroupedParam's), and an activation serves both of its operands
// itself. Invariant: nothing is quantized, so nothing here depends on the layout's grouping.
#pragma once

#include "nn/linear_recipe.h"

namespace packmoe {

class Bf16Recipe final : public LinearRecipe {
 public:
  Bf16Recipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e, int64_t n,
             int64_t k)
      : LinearRecipe(backend, q, layout, e, n, k) {}

  bool quantized() const override { return false; }
  int64_t shard_unit_rows() const override { return 1; }
  void quantize_weight(const GroupedStorage& bf16, const float* amax) override;
  std::vector<PackedComponent> packed_components() const override { return {}; }
  bool needs_global_amax() const override { return false; }
  void rows_amax(const GroupedMatrices& rows, float* amax) const override;
  void quantize_rows(const GroupedMatrices& rows, const float* amax,
                     const std::vector<std::vector<void*>>& outputs) const override;
  void write_packed(const std::vector<const void*>& images, const float* amax) override;
  GemmOperand fprop_weight(const GroupedStorage& bf16) const override;
  GemmOperand dgrad_weight(const GroupedStorage& bf16) const override;
  std::vector<NamedStorage> components() const override { return {}; }
  ActivationCopies activation_copies(TensorRole role, const Tensor& a,
                                     const std::vector<int64_t>& m,
                                     uint64_t sr_offset) const override;
  DispatchPayload dispatch_payload(const Tensor& a, const std::vector<int64_t>& m) const override;
  ActivationCopies received_input_copies(const DispatchPayload& p,
                                         const std::vector<int64_t>& m) const override;
};

}  // namespace packmoe
