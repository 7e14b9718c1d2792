// GroupedLinear forward / backward: activation quantization (one call over all groups), the three
// grouped GEMMs, and the wgrad's way into main_grad.
#include "nn/grouped_linear.h"

#include <numeric>

namespace packmoe {
namespace {

std::vector<const void*> to_const(const std::vector<void*>& p) { return {p.begin(), p.end()}; }

// MXFP8 copies of `in` ((M, C) BF16, rows grouped by in.rows; M == 0: copies of null pointers that
// no GEMM reads, nothing quantized). The rowwise copy, read by the fprop
// / dgrad right after, is kept as its BF16 values only (GemmOperand::values_only): the quantizer
// writes them while it has them, the GEMM reads them instead of dequantizing, and FP8 bytes
// nothing would read are never written. So is a gradient's columnwise copy (its wgrad runs in the
// same backward). An input's columnwise copy waits for the backward pass: it stays FP8, since the
// memory that saves is the point of the format.
ActivationCopies mxfp8_copies(Backend& b, const QuantRecipe& q, TensorRole role,
                              const GroupedMatrices& in, int64_t rows) {
  const int64_t c = in.cols;
  const std::vector<int64_t>& m = in.rows;
  ActivationCopies out;
  out.rowwise.format = out.columnwise.format = OperandFormat::kMxfp8;
  Mxfp8Outputs o;
  auto values = [&](std::vector<DeviceBuffer>& memory) {  // (M, C) BF16
    return carve_rows(memory.emplace_back(b, rows * c * 2).get(), m, c * 2);
  };
  o.row_bf16 = values(out.row_memory);
  out.rowwise.bf16 = to_const(o.row_bf16);
  if (role == TensorRole::kGradOutput) {
    o.col_bf16 = values(out.col_memory);
    out.columnwise.bf16 = to_const(o.col_bf16);
  } else {
    o.col_data = carve_rows(out.col_memory.emplace_back(b, rows * c).get(), m, c);  // (M, C)
    // (M/32, C): group g's scales start at row off_g / 32, i.e. byte off_g * C / 32
    o.col_scale = carve_rows(out.col_memory.emplace_back(b, rows * c / kMxfp8Block).get(), m,
                             c / kMxfp8Block);
    out.columnwise.data = to_const(o.col_data);
    out.columnwise.scale = to_const(o.col_scale);
  }
  if (rows) check_op(ops::quantize_mxfp8(b, in, mxfp8_config(q, role), o), "activation quantize (mxfp8)");
  return out;
}

// Quantizes a (M, C) BF16 activation with rows grouped by m (host counts) into its rowwise and
// columnwise copies in one call. M == 0 (no tokens for any local expert) gives operands with
// null pointers that no GEMM reads (every group is empty).
ActivationCopies quantize_activation(Backend& b, const QuantRecipe& q, TensorRole role,
                                     const Tensor& a, const std::vector<int64_t>& m,
                                     uint64_t sr_offset) {
  const int64_t rows = a.dim(0), c = a.dim(1);
  const size_t groups = m.size();
  const OperandFormat format = operand_format(q.recipe);
  ActivationCopies out;
  out.rowwise.format = out.columnwise.format = format;

  if (format == OperandFormat::kBF16) {
    // The caller's tensor, kept alive until the wgrad (GroupedLinear::forward's contract: not
    // written before then); a view of memory someone else owns gets a private copy.
    void* data = a.data();
    if (a.owns_memory()) {
      out.shared = a;
    } else {
      data = out.col_memory.emplace_back(b, a.nbytes()).get();
      if (a.nbytes()) b.copy(data, a.data(), a.nbytes(), Backend::CopyKind::kDeviceToDevice);
    }
    out.columnwise.data = to_const(carve_rows(data, m, c * 2));
    out.rowwise = out.columnwise;
    return out;
  }

  GroupedMatrices in;  // G x (m_g, C) BF16
  in.dtype = DType::kBF16;
  in.cols = c;
  in.data = to_const(carve_rows(a.data(), m, c * 2));
  in.rows = m;
  if (format == OperandFormat::kMxfp8) return mxfp8_copies(b, q, role, in, rows);

  // NVFP4: the columnwise copy per group (C, m_g/2) and (C, m_g/16), transposed.
  const std::vector<void*> cd =
      carve_rows(out.col_memory.emplace_back(b, rows * c / 2).get(), m, c / 2);
  const std::vector<void*> cs =
      carve_rows(out.col_memory.emplace_back(b, rows * c / kNvfp4Block).get(), m, c / kNvfp4Block);
  out.columnwise.data = to_const(cd);
  out.columnwise.scale = to_const(cs);
  // The rowwise copy, read by the fprop / dgrad right after, is kept as its BF16 values only
  // (without S_dec, which stays the GEMM's alpha): the quantizer writes them while it has them
  // and the GEMM reads them instead of dequantizing.
  Nvfp4Outputs o;
  o.row_bf16 = carve_rows(out.row_memory.emplace_back(b, rows * c * 2).get(), m, c * 2);  // (M, C)
  out.rowwise.bf16 = to_const(o.row_bf16);
  // Per-group amax and decode scales of both copies (the columnwise one after the RHT).
  const size_t scalar_bytes = groups * sizeof(float);
  void* row_amax = out.row_memory.emplace_back(b, scalar_bytes).get();    // (G,) F32
  void* row_decode = out.row_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  void* col_amax = out.col_memory.emplace_back(b, scalar_bytes).get();    // (G,) F32
  void* col_decode = out.col_memory.emplace_back(b, scalar_bytes).get();  // (G,) F32
  out.rowwise.decode_scale = row_decode;
  out.columnwise.decode_scale = col_decode;
  if (!rows) {  // nothing to quantize; the GEMMs read no decode scale, but they must exist
    b.fill_zero(row_decode, scalar_bytes);
    b.fill_zero(col_decode, scalar_bytes);
    return out;
  }
  o.row_amax = row_amax;
  o.col_data = cd;
  o.col_scale = cs;
  o.col_amax = col_amax;
  check_op(ops::quantize_nvfp4(b, in, nvfp4_config(q, role, sr_offset), o), "activation quantize (nvfp4)");
  const auto decode = [&](void* amax, void* scale) {
    check_op(ops::nvfp4_decode_scales(b, static_cast<const float*>(amax), static_cast<float*>(scale),
                                   static_cast<int64_t>(groups)),
             "activation decode scales (nvfp4)");
  };
  decode(row_amax, row_decode);
  decode(col_amax, col_decode);
  return out;
}

}  // namespace

void ActivationCopies::release_rowwise() {
  rowwise = GemmOperand{};
  row_memory.clear();
}

GroupedLinear::GroupedLinear(Backend& backend, const GroupedLinearConfig& cfg, const Tensor& init)
    : backend_(&backend),
      cfg_(cfg),
      param_(backend, cfg.recipe, cfg.primary, cfg.layout, init) {
  PACKMOE_CHECK(cfg.out_dtype == DType::kBF16 || cfg.out_dtype == DType::kF32,
                "GroupedLinear outputs bf16 or f32");
}

Tensor GroupedLinear::forward(const Tensor& x, const std::vector<int64_t>& m) {
  PACKMOE_CHECK(state_ != LinearState::kWgradPending,
                "forward with a delayed wgrad pending: run backward_dw first, or its gradient is "
                "lost");
  const int64_t e = param_.experts(), n = param_.n(), k = param_.k();
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(1) == k,
                "forward: x must be (M, " << k << ") bf16, got " << shape_string(x.shape()));
  PACKMOE_CHECK(x.device() == backend_->device(), "forward: x is not in the backend's memory");
  PACKMOE_CHECK(static_cast<int64_t>(m.size()) == e, "forward: " << m.size() << " token counts for "
                                                                   << e << " experts");
  const int64_t align = token_alignment(cfg_.recipe.recipe);
  for (int64_t mg : m)
    PACKMOE_CHECK(mg >= 0 && mg % align == 0,
                  "forward: " << mg << " tokens is not a multiple of " << align);
  const int64_t rows = std::accumulate(m.begin(), m.end(), int64_t{0});
  PACKMOE_CHECK(rows == x.dim(0), "forward: token counts sum to " << rows << ", x has " << x.dim(0));

  param_.prepare_compute();
  x_ = quantize_activation(*backend_, cfg_.recipe, TensorRole::kInput, x, m, 0);
  Tensor y = Tensor::empty(*backend_, cfg_.out_dtype, {rows, n});  // (M, N)
  GroupedGemmArgs a;
  a.op = GemmOp::kFprop;
  a.n = n;
  a.k = k;
  a.m = m;
  a.lhs = x_.rowwise;
  a.rhs = param_.fprop_weight();
  a.out_dtype = cfg_.out_dtype;
  a.out = carve_rows(y.data(), m, dtype_bytes_for(cfg_.out_dtype, n));
  check_op(ops::grouped_gemm(*backend_, a), "fprop");
  x_.release_rowwise();
  m_ = m;
  state_ = LinearState::kForwardDone;
  return y;
}

Tensor GroupedLinear::backward(const Tensor& dy, GradAccum accum) {
  PACKMOE_CHECK(state_ == LinearState::kForwardDone,
                "backward needs a forward first (and runs once per forward)");
  const int64_t n = param_.n(), k = param_.k();
  const int64_t rows = std::accumulate(m_.begin(), m_.end(), int64_t{0});
  PACKMOE_CHECK(dy.dtype() == DType::kBF16 && dy.rank() == 2 && dy.dim(0) == rows && dy.dim(1) == n,
                "backward: dy must be (" << rows << ", " << n << ") bf16, got "
                                         << shape_string(dy.shape()));
  PACKMOE_CHECK(dy.device() == backend_->device(), "backward: dy is not in the backend's memory");

  const int64_t draws = rows * n / kNvfp4Block;  // blocks of 16 SR draws (NVFP4)
  PACKMOE_CHECK(draws < (int64_t{1} << kSrBlockBits),
                "backward: dy of " << rows << " x " << n
                                   << " needs more SR draws than a micro-batch has (2^"
                                   << kSrBlockBits << " blocks)");
  dy_ = quantize_activation(*backend_, cfg_.recipe, TensorRole::kGradOutput, dy, m_,
                            grad_sr_offset_);
  grad_sr_offset_ += static_cast<uint64_t>(draws);
  Tensor dx = Tensor::empty(*backend_, cfg_.out_dtype, {rows, k});  // (M, K)
  GroupedGemmArgs a;
  a.op = GemmOp::kDgrad;
  a.n = n;
  a.k = k;
  a.m = m_;
  a.lhs = dy_.rowwise;
  a.rhs = param_.dgrad_weight();
  a.out_dtype = cfg_.out_dtype;
  a.out = carve_rows(dx.data(), m_, dtype_bytes_for(cfg_.out_dtype, k));
  check_op(ops::grouped_gemm(*backend_, a), "dgrad");
  dy_.release_rowwise();

  if (cfg_.delay_wgrad) {
    pending_accum_ = accum;
    param_.mark_wgrad_pending();
    state_ = LinearState::kWgradPending;
  } else {
    run_wgrad(accum);
    state_ = LinearState::kIdle;
  }
  return dx;
}

void GroupedLinear::set_grad_sr_offset(uint64_t offset) { grad_sr_offset_ = offset; }

void GroupedLinear::backward_dw() {
  PACKMOE_CHECK(state_ == LinearState::kWgradPending,
                "backward_dw without a queued wgrad (a wgrad runs once per backward, and is only "
                "queued with delay_wgrad)");
  run_wgrad(pending_accum_);
  param_.mark_wgrad_settled();
  state_ = LinearState::kIdle;
}

void GroupedLinear::run_wgrad(GradAccum accum) {
  GroupedStorage& main_grad = param_.main_grad_;  // (E, N, K) F32
  GroupedGemmArgs a;
  a.op = GemmOp::kWgrad;
  a.n = param_.n();
  a.k = param_.k();
  a.m = m_;
  a.lhs = dy_.columnwise;
  a.rhs = x_.columnwise;
  a.out_dtype = DType::kF32;
  if (cfg_.grad_accum_fusion) {
    a.out = main_grad.ptrs();
    a.accumulate = accum == GradAccum::kAccumulate;
    check_op(ops::grouped_gemm(*backend_, a), "wgrad into main_grad");
  } else {
    // The unfused path's separate gradient, in the param's layout (E buffers when discrete).
    GroupedStorage grad(*backend_, param_.layout(), param_.experts(), main_grad.bytes_per_group());
    a.out = grad.ptrs();
    check_op(ops::grouped_gemm(*backend_, a), "wgrad");
    if (accum == GradAccum::kAccumulate)
      add_f32(main_grad, grad);
    else
      main_grad.copy_from(grad);
  }
  x_ = ActivationCopies{};
  dy_ = ActivationCopies{};
}

}  // namespace packmoe
