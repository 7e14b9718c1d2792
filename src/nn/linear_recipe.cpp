// LinearRecipe's shared helpers and the factory: the only place that maps a Recipe to its class.
#include "nn/linear_recipe.h"

#include "nn/recipe_bf16.h"
#include "nn/recipe_mxfp8.h"
#include "nn/recipe_nvfp4.h"

namespace packmoe {

void ActivationCopies::release_rowwise() {
  rowwise = GemmOperand{};
  row_memory.clear();
}

void LinearRecipe::fill(GroupedStorage& dst, const void* src) const {
  const size_t bytes = dst.bytes_per_group();
  const auto* from = static_cast<const uint8_t*>(src);
  if (dst.layout() == Layout::kSingle) {
    backend_->copy(dst.packed(), from, e_ * bytes, Backend::CopyKind::kDeviceToDevice);
    return;
  }
  for (int64_t e = 0; e < e_; ++e)
    backend_->copy(dst.group(e), from + e * bytes, bytes, Backend::CopyKind::kDeviceToDevice);
}

GroupedMatrices LinearRecipe::activation_rows(const Tensor& a, const std::vector<int64_t>& m) {
  const std::vector<void*> rows = carve_rows(a.data(), m, a.dim(1) * 2);
  GroupedMatrices in;  // G x (m_g, C) BF16
  in.dtype = DType::kBF16;
  in.cols = a.dim(1);
  in.data = {rows.begin(), rows.end()};
  in.rows = m;
  return in;
}

std::unique_ptr<LinearRecipe> make_linear_recipe(Backend& backend, const QuantRecipe& q,
                                                 Layout layout, int64_t e, int64_t n, int64_t k) {
  switch (q.recipe) {
    case Recipe::kBF16: return std::make_unique<Bf16Recipe>(backend, q, layout, e, n, k);
    case Recipe::kMxfp8: return std::make_unique<Mxfp8Recipe>(backend, q, layout, e, n, k);
    case Recipe::kNvfp4: return std::make_unique<Nvfp4Recipe>(backend, q, layout, e, n, k);
  }
  PACKMOE_CHECK(false, "unknown recipe");
  return nullptr;
}

}  // namespace packmoe
