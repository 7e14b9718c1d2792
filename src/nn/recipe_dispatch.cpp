// The quantized recipes' side of `--dispatch-dtype recipe` (nn/dispatch_payload.h): the sender's
// rowwise copy as a payload, and the receiver's activation copies from it. Invariant: the
// receiver's rowwise operand holds the values the sender's rows would have had as their rowwise
// copy (the dequantize ops write f32_to_bf16 of the format's decode, what the quantizers' row_bf16
// outputs hold), so the FC1 fprop is bitwise the BF16 dispatch's; only the wgrad copy differs.
#include <vector>

#include "backend/ops/elementwise.h"
#include "backend/ops/quantize.h"
#include "nn/recipe_mxfp8.h"
#include "nn/recipe_nvfp4.h"

namespace packmoe {
namespace {

int64_t total(const std::vector<int64_t>& m) {
  int64_t t = 0;
  for (int64_t r : m) t += r;
  return t;
}

void check_payload(const DispatchPayload& p, const std::vector<int64_t>& m, int64_t row_bytes,
                   bool amax) {
  PACKMOE_CHECK(p.rows.dtype() == DType::kU8 && p.rows.rank() == 2 &&
                    p.rows.dim(1) == row_bytes && p.rows.dim(0) >= total(m),
                "received_input_copies: the payload must be (>= " << total(m) << ", " << row_bytes
                                                                  << ") u8, got "
                                                                  << shape_string(p.rows.shape()));
  PACKMOE_CHECK(!amax || (p.amax.dtype() == DType::kF32 &&
                          p.amax.numel() == static_cast<int64_t>(m.size())),
                "received_input_copies: NVFP4 needs one F32 amax per group (" << m.size() << ")");
}

}  // namespace

DispatchPayload Mxfp8Recipe::dispatch_payload(const Tensor& a, const std::vector<int64_t>& m) const {
  const int64_t c = a.dim(1);
  DispatchPayload p;
  p.rows = Tensor::empty(*backend_, DType::kU8,
                         {a.dim(0), dispatch_row_bytes(Recipe::kMxfp8, DispatchDtype::kRecipe, c)});
  const PayloadGroups g = carve_payload(p.rows.data(), m, c, c / kMxfp8Block);
  Mxfp8Config cfg = mxfp8_config(q_, TensorRole::kInput);
  cfg.columnwise = false;
  Mxfp8Outputs o;
  o.row_data = g.data;
  o.row_scale = g.scale;
  if (total(m) > 0)
    check_op(ops::quantize_mxfp8(*backend_, activation_rows(a, m), cfg, o),
             "dispatch quantize (mxfp8)");
  return p;
}

// The values land in row_memory (read by the fprop right after, as activation_copies keeps
// them); the columnwise copy, from those values (exact in BF16), stays FP8 for the wgrad.
ActivationCopies Mxfp8Recipe::received_input_copies(const DispatchPayload& p,
                                                    const std::vector<int64_t>& m) const {
  const int64_t c = k_, rows = p.rows.dim(0);
  check_payload(p, m, dispatch_row_bytes(Recipe::kMxfp8, DispatchDtype::kRecipe, c), false);
  Backend& b = *backend_;
  ActivationCopies out;
  out.rowwise.format = out.columnwise.format = OperandFormat::kMxfp8;
  void* values = out.row_memory.emplace_back(b, rows * c * 2).get();  // (M, C) BF16
  const std::vector<void*> row_bf16 = carve_rows(values, m, c * 2);
  out.rowwise.bf16 = const_ptrs(row_bf16);
  Mxfp8Outputs o;
  o.col_data = carve_rows(out.col_memory.emplace_back(b, rows * c).get(), m, c);  // (M, C)
  o.col_scale = carve_rows(out.col_memory.emplace_back(b, rows * c / kMxfp8Block).get(), m,
                           c / kMxfp8Block);  // (M/32, C)
  out.columnwise.data = const_ptrs(o.col_data);
  out.columnwise.scale = const_ptrs(o.col_scale);
  if (total(m) == 0) return out;
  const PayloadGroups g = carve_payload(p.rows.data(), m, c, c / kMxfp8Block);
  Mxfp8Copy q;
  q.element = DType::kE4M3;
  q.columnwise = false;
  q.cols = c;
  q.rows = m;
  q.data = const_ptrs(g.data);
  q.scale = const_ptrs(g.scale);
  check_op(ops::dequantize_mxfp8(b, q, DType::kBF16, row_bf16), "dispatch dequantize (mxfp8)");
  Mxfp8Config cfg = mxfp8_config(q_, TensorRole::kInput);
  cfg.rowwise = false;
  check_op(ops::quantize_mxfp8(b, activation_rows(Tensor::view(values, DType::kBF16, {rows, c},
                                                               b.device()),
                                                  m),
                               cfg, o),
           "dispatch columnwise quantize (mxfp8)");
  return out;
}

DispatchPayload Nvfp4Recipe::dispatch_payload(const Tensor& a, const std::vector<int64_t>& m) const {
  const int64_t c = a.dim(1);
  DispatchPayload p;
  p.rows = Tensor::empty(*backend_, DType::kU8,
                         {a.dim(0), dispatch_row_bytes(Recipe::kNvfp4, DispatchDtype::kRecipe, c)});
  p.amax = Tensor::empty(*backend_, DType::kF32, {static_cast<int64_t>(m.size())});
  const PayloadGroups g = carve_payload(p.rows.data(), m, c / 2, c / kNvfp4Block);
  Nvfp4Config cfg = nvfp4_config(q_, TensorRole::kInput, 0);  // rowwise: RNE
  cfg.columnwise = false;
  Nvfp4Outputs o;
  o.row_data = g.data;
  o.row_scale = g.scale;
  o.row_amax = p.amax.data();
  if (total(m) > 0)
    check_op(ops::quantize_nvfp4(*backend_, activation_rows(a, m), cfg, o),
             "dispatch quantize (nvfp4)");
  else
    backend_->fill_zero(p.amax.data(), p.amax.nbytes());
  return p;
}

// Rowwise: the values without S_dec (dequantized with decode scale 1: e2m1 x e4m3 is exact in
// BF16) and S_dec from the received amax by the op activation_copies uses. Columnwise: x_hat =
// bf16(values x S_dec), then the input's columnwise quantizer (RHT, its own amax after the RHT).
ActivationCopies Nvfp4Recipe::received_input_copies(const DispatchPayload& p,
                                                    const std::vector<int64_t>& m) const {
  const int64_t c = k_, rows = p.rows.dim(0);
  const int64_t groups = static_cast<int64_t>(m.size());
  check_payload(p, m, dispatch_row_bytes(Recipe::kNvfp4, DispatchDtype::kRecipe, c), true);
  Backend& b = *backend_;
  ActivationCopies out;
  std::vector<void*> cd, cs, row_bf16;
  activation_memory(rows, c, m, out, cd, cs, row_bf16);
  const size_t scalar_bytes = static_cast<size_t>(groups) * sizeof(float);
  void* row_decode = out.row_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  void* col_amax = out.col_memory.emplace_back(b, scalar_bytes).get();    // (G,) F32
  void* col_decode = out.col_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  out.rowwise.decode_scale = row_decode;
  out.columnwise.decode_scale = col_decode;
  if (total(m) == 0) {
    b.fill_zero(row_decode, scalar_bytes);
    b.fill_zero(col_decode, scalar_bytes);
    return out;
  }
  check_op(ops::nvfp4_decode_scales(b, p.amax.data_as<const float>(),
                                    static_cast<float*>(row_decode), groups),
           "dispatch decode scales (nvfp4)");
  const PayloadGroups g = carve_payload(p.rows.data(), m, c / 2, c / kNvfp4Block);
  Nvfp4Copy q;
  q.cols = c;
  q.rows = m;
  q.data = const_ptrs(g.data);
  q.scale = const_ptrs(g.scale);
  const std::vector<float> ones(static_cast<size_t>(groups), 1.0f);
  DeviceBuffer unit(b, scalar_bytes);  // (G,) F32 decode scales of 1: the values without S_dec
  b.copy(unit.get(), ones.data(), scalar_bytes, Backend::CopyKind::kHostToDevice);
  q.decode_scale = unit.get();
  check_op(ops::dequantize_nvfp4(b, q, DType::kBF16, row_bf16), "dispatch dequantize (nvfp4)");
  DeviceBuffer x_hat(b, static_cast<size_t>(rows * c * 2));  // (M, C) BF16, with S_dec
  const std::vector<void*> x_hat_rows = carve_rows(x_hat.get(), m, c * 2);
  q.decode_scale = row_decode;
  check_op(ops::dequantize_nvfp4(b, q, DType::kBF16, x_hat_rows), "dispatch dequantize (nvfp4)");
  Nvfp4Config cfg = nvfp4_config(q_, TensorRole::kInput, 0);
  cfg.rowwise = false;
  Nvfp4Outputs o;
  o.col_data = cd;
  o.col_scale = cs;
  o.col_amax = col_amax;
  check_op(ops::quantize_nvfp4(b, activation_rows(Tensor::view(x_hat.get(), DType::kBF16, {rows, c},
                                                               b.device()),
                                                  m),
                               cfg, o),
           "dispatch columnwise quantize (nvfp4)");
  check_op(ops::nvfp4_decode_scales(b, static_cast<const float*>(col_amax),
                                    static_cast<float*>(col_decode), groups),
           "dispatch decode scales (nvfp4)");
  return out;
}

}  // namespace packmoe
