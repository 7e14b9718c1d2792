// LinearRecipe's and QuantizedRecipe's shared parts and the factory: the only place that maps a
// Recipe to its class.
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

GroupedMatrices QuantizedRecipe::weight_rows(const GroupedStorage& bf16) const {
  GroupedMatrices in;  // E x (N, K) BF16
  in.dtype = DType::kBF16;
  in.cols = k_;
  in.data = bf16.const_ptrs();
  in.rows.assign(e_, n_);
  return in;
}

void QuantizedRecipe::write_rowwise_and_derive_columnwise(const std::vector<const void*>& images,
                                                          Tiled2dFormat format) {
  fill(w_.row_data, images[0]);
  fill(w_.row_scale, images[1]);
  Weight2dCopies c;
  c.format = format;
  c.rows = n_;
  c.cols = k_;
  c.row_data = w_.row_data.const_ptrs();
  c.row_scale = w_.row_scale.const_ptrs();
  c.col_data = w_.col_data.ptrs();
  c.col_scale = w_.col_scale.ptrs();
  check_op(ops::weight_2d_columnwise(*backend_, c), "columnwise copy of a 2D weight");
}

GemmOperand QuantizedRecipe::weight_operand(const GroupedStorage& data,
                                            const GroupedStorage& scale) const {
  GemmOperand o;
  o.format = format_;
  o.data = data.const_ptrs();
  o.scale = scale.const_ptrs();
  if (w_.decode_scale.allocated()) o.decode_scale = w_.decode_scale.packed();
  return o;
}

GemmOperand QuantizedRecipe::fprop_weight(const GroupedStorage&) const {
  return weight_operand(w_.row_data, w_.row_scale);
}

GemmOperand QuantizedRecipe::dgrad_weight(const GroupedStorage&) const {
  return weight_operand(w_.col_data, w_.col_scale);
}

std::vector<NamedStorage> QuantizedRecipe::components() const {
  std::vector<NamedStorage> out = {{"row_data", &w_.row_data},
                                   {"row_scale", &w_.row_scale},
                                   {"col_data", &w_.col_data},
                                   {"col_scale", &w_.col_scale}};
  if (w_.amax.allocated()) out.push_back({"amax", &w_.amax});
  if (w_.decode_scale.allocated()) out.push_back({"decode_scale", &w_.decode_scale});
  return out;
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
