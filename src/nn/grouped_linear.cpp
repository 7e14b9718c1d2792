// GroupedLinear forward / backward: the recipe's activation copies (one quantize call over all
// groups, nn/linear_recipe.h), the three grouped GEMMs, and the wgrad's way into main_grad.
#include "nn/grouped_linear.h"

#include <numeric>

namespace packmoe {
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
  x_ = param_.recipe_ops().activation_copies(TensorRole::kInput, x, m, 0);
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
  dy_ = param_.recipe_ops().activation_copies(TensorRole::kGradOutput, dy, m_, grad_sr_offset_);
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
