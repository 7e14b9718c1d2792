// Nvfp4Recipe: the weight's copies (pack, row range, gathered images) and the activation copies.
#include "nn/recipe_nvfp4.h"

#include <optional>

namespace packmoe {

Nvfp4Recipe::Nvfp4Recipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e,
                         int64_t n, int64_t k)
    : QuantizedRecipe(backend, q, layout, e, n, k, OperandFormat::kNvfp4) {
  const size_t nk = static_cast<size_t>(n * k);
  w_.row_data = GroupedStorage(backend, layout, e, nk / 2);
  w_.row_scale = GroupedStorage(backend, layout, e, nk / kNvfp4Block);
  w_.col_data = GroupedStorage(backend, layout, e, nk / 2);
  w_.col_scale = GroupedStorage(backend, layout, e, nk / kNvfp4Block);
  w_.amax = GroupedStorage(backend, Layout::kSingle, e, sizeof(float));
  w_.decode_scale = GroupedStorage(backend, Layout::kSingle, e, sizeof(float));
}

void Nvfp4Recipe::decode_scales() {
  check_op(ops::nvfp4_decode_scales(*backend_, static_cast<const float*>(w_.amax.packed()),
                                         static_cast<float*>(w_.decode_scale.packed()), e_),
           "weight decode scales (nvfp4)");
}

void Nvfp4Recipe::quantize_weight(const GroupedStorage& bf16, const float* amax) {
  Nvfp4Config cfg = nvfp4_config(q_, TensorRole::kWeight, 0);
  Nvfp4Outputs out;
  out.row_data = w_.row_data.ptrs();
  out.row_scale = w_.row_scale.ptrs();
  out.col_data = w_.col_data.ptrs();
  out.col_scale = w_.col_scale.ptrs();
  std::optional<DeviceBuffer> col_amax;
  if (amax) {  // the quantizer scales with it and skips its amax pass
    cfg.amax = amax;
    backend_->copy(w_.amax.packed(), amax, e_ * sizeof(float), Backend::CopyKind::kDeviceToDevice);
  } else {
    // 2D tiles: the columnwise amax equals the rowwise one (formats/nvfp4.h), so it is not kept.
    col_amax.emplace(*backend_, e_ * sizeof(float));  // (E,) F32
    out.row_amax = w_.amax.packed();
    out.col_amax = col_amax->get();
  }
  check_op(ops::quantize_nvfp4(*backend_, weight_rows(bf16), cfg, out), "weight quantize (nvfp4)");
  decode_scales();
}

std::vector<PackedComponent> Nvfp4Recipe::packed_components() const {
  return {{"row_data", 1, 2}, {"row_scale", 1, kNvfp4Block}};
}

void Nvfp4Recipe::rows_amax(const GroupedMatrices& rows, float* amax) const {
  check_op(ops::nvfp4_amax(*backend_, rows, amax), "rows amax (nvfp4)");
}

void Nvfp4Recipe::quantize_rows(const GroupedMatrices& rows, const float* amax,
                                const std::vector<std::vector<void*>>& outputs) const {
  PACKMOE_CHECK(amax != nullptr, "quantize_rows (nvfp4) needs the pack's (E,) amax");
  Nvfp4Config cfg = nvfp4_config(q_, TensorRole::kWeight, 0);
  cfg.columnwise = false;  // the transposed copy is derived after the gather
  cfg.amax = amax;
  Nvfp4Outputs out;  // no row_amax: it would only echo the given one
  out.row_data = outputs[0];
  out.row_scale = outputs[1];
  check_op(ops::quantize_nvfp4(*backend_, rows, cfg, out), "row-range quantize (nvfp4)");
}

void Nvfp4Recipe::write_packed(const std::vector<const void*>& images, const float* amax) {
  PACKMOE_CHECK(amax != nullptr, "write_primary_from_packed (nvfp4) needs the (E,) amax");
  write_rowwise_and_derive_columnwise(images, Tiled2dFormat::kNvfp4);
  backend_->copy(w_.amax.packed(), amax, e_ * sizeof(float), Backend::CopyKind::kDeviceToDevice);
  decode_scales();
}


void Nvfp4Recipe::activation_memory(int64_t rows, int64_t c, const std::vector<int64_t>& m,
                                    ActivationCopies& out, std::vector<void*>& col_data,
                                    std::vector<void*>& col_scale,
                                    std::vector<void*>& row_bf16) const {
  Backend& b = *backend_;
  out.rowwise.format = out.columnwise.format = OperandFormat::kNvfp4;
  col_data = carve_rows(out.col_memory.emplace_back(b, rows * c / 2).get(), m, c / 2);
  col_scale =
      carve_rows(out.col_memory.emplace_back(b, rows * c / kNvfp4Block).get(), m, c / kNvfp4Block);
  out.columnwise.data = const_ptrs(col_data);
  out.columnwise.scale = const_ptrs(col_scale);
  row_bf16 = carve_rows(out.row_memory.emplace_back(b, rows * c * 2).get(), m, c * 2);  // (M, C)
  out.rowwise.bf16 = const_ptrs(row_bf16);
}

// The columnwise copy per group (C, m_g/2) and (C, m_g/16), transposed. The rowwise copy, read by
// the fprop / dgrad right after, is kept as its BF16 values only (without S_dec, which stays the
// GEMM's alpha): the quantizer writes them while it has them and the GEMM reads them instead of
// dequantizing. M == 0: null pointers no GEMM reads, zero decode scales that must still exist.
ActivationCopies Nvfp4Recipe::activation_copies(TensorRole role, const Tensor& a,
                                                const std::vector<int64_t>& m,
                                                uint64_t sr_offset) const {
  const GroupedMatrices in = activation_rows(a, m);
  const int64_t rows = a.dim(0), c = in.cols;
  const size_t groups = m.size();
  Backend& b = *backend_;
  ActivationCopies out;
  std::vector<void*> cd, cs;
  Nvfp4Outputs o;
  activation_memory(rows, c, m, out, cd, cs, o.row_bf16);
  // Per-group amax and decode scales of both copies (the columnwise one after the RHT).
  const size_t scalar_bytes = groups * sizeof(float);
  void* row_amax = out.row_memory.emplace_back(b, scalar_bytes).get();    // (G,) F32
  void* row_decode = out.row_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  void* col_amax = out.col_memory.emplace_back(b, scalar_bytes).get();    // (G,) F32
  void* col_decode = out.col_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  out.rowwise.decode_scale = row_decode;
  out.columnwise.decode_scale = col_decode;
  if (!rows) {
    b.fill_zero(row_decode, scalar_bytes);
    b.fill_zero(col_decode, scalar_bytes);
    return out;
  }
  o.row_amax = row_amax;
  o.col_data = cd;
  o.col_scale = cs;
  o.col_amax = col_amax;
  check_op(ops::quantize_nvfp4(b, in, nvfp4_config(q_, role, sr_offset), o), "activation quantize (nvfp4)");
  const auto decode = [&](void* amax, void* scale) {
    check_op(ops::nvfp4_decode_scales(b, static_cast<const float*>(amax), static_cast<float*>(scale),
                                   static_cast<int64_t>(groups)),
             "activation decode scales (nvfp4)");
  };
  decode(row_amax, row_decode);
  decode(col_amax, col_decode);
  return out;
}

}  // namespace packmoe
