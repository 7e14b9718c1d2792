// Mxfp8Recipe: the weight's copies (pack, row range, gathered images) and the activation copies.
#include "nn/recipe_mxfp8.h"

namespace packmoe {

Mxfp8Recipe::Mxfp8Recipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e,
                         int64_t n, int64_t k)
    : QuantizedRecipe(backend, q, layout, e, n, k, OperandFormat::kMxfp8) {
  const size_t nk = static_cast<size_t>(n * k);
  w_.row_data = GroupedStorage(backend, layout, e, nk);
  w_.row_scale = GroupedStorage(backend, layout, e, nk / kMxfp8Block);
  w_.col_data = GroupedStorage(backend, layout, e, nk);
  w_.col_scale = GroupedStorage(backend, layout, e, nk / kMxfp8Block);
}

void Mxfp8Recipe::quantize_weight(const GroupedStorage& bf16, const float* amax) {
  PACKMOE_CHECK(amax == nullptr, "quantize_weight (mxfp8): MXFP8 has no per-expert amax");
  Mxfp8Outputs out{w_.row_data.ptrs(), w_.row_scale.ptrs(), w_.col_data.ptrs(),
                   w_.col_scale.ptrs(), {}, {}};
  check_op(ops::quantize_mxfp8(*backend_, weight_rows(bf16), mxfp8_config(q_, TensorRole::kWeight),
                               out),
           "weight quantize (mxfp8)");
}

std::vector<PackedComponent> Mxfp8Recipe::packed_components() const {
  if (q_.mxfp8_weight_2d) return {{"row_data", 1, 1}, {"row_scale", 1, kMxfp8Block}};
  return {{"row_data", 1, 1}, {"row_scale", 1, kMxfp8Block}, {"col_data", 1, 1},
          {"col_scale", 1, kMxfp8Block}};
}

void Mxfp8Recipe::rows_amax(const GroupedMatrices&, float*) const {
  PACKMOE_CHECK(false, "rows_amax: only NVFP4 primaries have a per-expert amax");
}

void Mxfp8Recipe::quantize_rows(const GroupedMatrices& rows, const float*,
                                const std::vector<std::vector<void*>>& outputs) const {
  Mxfp8Config cfg = mxfp8_config(q_, TensorRole::kWeight);
  Mxfp8Outputs out{outputs[0], outputs[1], {}, {}, {}, {}};
  cfg.columnwise = !cfg.two_d;  // a 2D columnwise copy is derived after the gather
  if (cfg.columnwise) {
    out.col_data = outputs[2];
    out.col_scale = outputs[3];
  }
  check_op(ops::quantize_mxfp8(*backend_, rows, cfg, out), "row-range quantize (mxfp8)");
}

void Mxfp8Recipe::write_packed(const std::vector<const void*>& images, const float*) {
  if (q_.mxfp8_weight_2d) {
    write_rowwise_and_derive_columnwise(images, Tiled2dFormat::kMxfp8);
    return;
  }
  fill(w_.row_data, images[0]);  // 1D: both copies travel
  fill(w_.row_scale, images[1]);
  fill(w_.col_data, images[2]);
  fill(w_.col_scale, images[3]);
}

// The rowwise copy, read by the fprop / dgrad right after, is kept as its BF16 values only
// (GemmOperand::values_only): the quantizer writes them while it has them, the GEMM reads them
// instead of dequantizing, and FP8 bytes nothing would read are never written. So is a gradient's
// columnwise copy (its wgrad runs in the same backward). An input's columnwise copy waits for the
// backward pass: it stays FP8, since the memory that saves is the point of the format. M == 0:
// copies of null pointers that no GEMM reads, nothing quantized.
ActivationCopies Mxfp8Recipe::activation_copies(TensorRole role, const Tensor& a,
                                                const std::vector<int64_t>& m, uint64_t) const {
  const GroupedMatrices in = activation_rows(a, m);
  const int64_t rows = a.dim(0), c = in.cols;
  Backend& b = *backend_;
  ActivationCopies out;
  out.rowwise.format = out.columnwise.format = OperandFormat::kMxfp8;
  Mxfp8Outputs o;
  auto values = [&](std::vector<DeviceBuffer>& memory) {  // (M, C) BF16
    return carve_rows(memory.emplace_back(b, rows * c * 2).get(), m, c * 2);
  };
  o.row_bf16 = values(out.row_memory);
  out.rowwise.bf16 = const_ptrs(o.row_bf16);
  if (role == TensorRole::kGradOutput) {
    o.col_bf16 = values(out.col_memory);
    out.columnwise.bf16 = const_ptrs(o.col_bf16);
  } else {
    o.col_data = carve_rows(out.col_memory.emplace_back(b, rows * c).get(), m, c);  // (M, C)
    // (M/32, C): group g's scales start at row off_g / 32, i.e. byte off_g * C / 32
    o.col_scale = carve_rows(out.col_memory.emplace_back(b, rows * c / kMxfp8Block).get(), m,
                             c / kMxfp8Block);
    out.columnwise.data = const_ptrs(o.col_data);
    out.columnwise.scale = const_ptrs(o.col_scale);
  }
  if (rows) check_op(ops::quantize_mxfp8(b, in, mxfp8_config(q_, role), o), "activation quantize (mxfp8)");
  return out;
}

}  // namespace packmoe
