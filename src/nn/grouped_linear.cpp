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

namespace {

void check_forward_input(const Tensor& x, int64_t k, const Backend& b, LinearState state) {
  PACKMOE_CHECK(state != LinearState::kWgradPending,
                "forward with a delayed wgrad pending: run backward_dw first, or its gradient is "
                "lost");
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(1) == k,
                "forward: x must be (M, " << k << ") bf16, got " << shape_string(x.shape()));
  PACKMOE_CHECK(x.device() == b.device(), "forward: x is not in the backend's memory");
}

// Counts of S x E groups (S >= 1 sources of E experts), each a multiple of align, summing to at
// most `rows`.
void check_counts(const std::vector<int64_t>& m, int64_t e, int64_t align, int64_t rows) {
  PACKMOE_CHECK(!m.empty() && static_cast<int64_t>(m.size()) % e == 0,
                "forward: " << m.size() << " token counts for " << e
                            << " experts (a multiple of the experts needed)");
  for (int64_t mg : m)
    PACKMOE_CHECK(mg >= 0 && mg % align == 0,
                  "forward: " << mg << " tokens is not a multiple of " << align);
  const int64_t sum = std::accumulate(m.begin(), m.end(), int64_t{0});
  PACKMOE_CHECK(sum <= rows,
                "forward: token counts sum to " << sum << ", x has " << rows);
}

}  // namespace

Tensor GroupedLinear::forward(const Tensor& x, const std::vector<int64_t>& m) {
  check_forward_input(x, param_.k(), *backend_, state_);
  check_counts(m, param_.experts(), token_alignment(cfg_.recipe.recipe), x.dim(0));
  m_ = m;
  m_device_ = Tensor{};
  rows_ = x.dim(0);
  sources_ = static_cast<int64_t>(m.size()) / param_.experts();
  return run_forward(x);
}

Tensor GroupedLinear::forward(const Tensor& x, const Tensor& m_device) {
  check_forward_input(x, param_.k(), *backend_, state_);
  const int64_t e = param_.experts();
  PACKMOE_CHECK(m_device.dtype() == DType::kI64 && m_device.numel() == e &&
                    m_device.device() == backend_->device(),
                "forward: device token counts must be (" << e << ",) i64 in the backend's memory");
  rows_ = x.dim(0);
  sources_ = 1;
  if (param_.recipe_ops().quantized()) {
    m_.assign(e, 0);
    backend_->copy(m_.data(), m_device.data(), m_device.nbytes(), Backend::CopyKind::kDeviceToHost);
    check_counts(m_, e, token_alignment(cfg_.recipe.recipe), rows_);
    m_device_ = Tensor{};
  } else {
    m_.clear();
    m_device_ = m_device;
  }
  return run_forward(x);
}

std::vector<int64_t> GroupedLinear::token_groups() const {
  return m_device_.data() != nullptr ? std::vector<int64_t>{rows_} : m_;
}

void GroupedLinear::set_counts(GroupedGemmArgs& a) const {
  if (m_device_.data() != nullptr) {
    a.m_device = m_device_.data();
    a.groups = param_.experts();
    a.m_capacity = rows_;
  } else {
    a.m = m_;
  }
}

GemmOperand GroupedLinear::weight_for_groups(GemmOperand w) {
  if (sources_ == 1) return w;
  const size_t e = static_cast<size_t>(param_.experts());
  GemmOperand r = w;
  r.data.clear();
  r.scale.clear();
  for (int64_t s = 0; s < sources_; ++s) {
    r.data.insert(r.data.end(), w.data.begin(), w.data.end());
    r.scale.insert(r.scale.end(), w.scale.begin(), w.scale.end());
  }
  if (w.decode_scale != nullptr) {  // (E) F32 -> (S * E)
    const size_t bytes = e * sizeof(float);
    const size_t total = static_cast<size_t>(sources_) * bytes;
    if (!repeated_decode_ || repeated_decode_->size() != total)
      repeated_decode_.emplace(*backend_, total);
    for (int64_t s = 0; s < sources_; ++s)
      backend_->copy(static_cast<uint8_t*>(repeated_decode_->get()) + s * bytes, w.decode_scale,
                     bytes, Backend::CopyKind::kDeviceToDevice);
    r.decode_scale = repeated_decode_->get();
  }
  return r;
}

Tensor GroupedLinear::forward_received(const DispatchPayload& p, const std::vector<int64_t>& m) {
  PACKMOE_CHECK(state_ != LinearState::kWgradPending,
                "forward with a delayed wgrad pending: run backward_dw first, or its gradient is "
                "lost");
  PACKMOE_CHECK(param_.recipe_ops().quantized(),
                "forward_received: the bf16 recipe has no quantized payload");
  PACKMOE_CHECK(p.rows.rank() == 2 && p.rows.device() == backend_->device(),
                "forward_received: the payload must be (M, W) in the backend's memory");
  check_counts(m, param_.experts(), token_alignment(cfg_.recipe.recipe), p.rows.dim(0));
  m_ = m;
  m_device_ = Tensor{};
  rows_ = p.rows.dim(0);
  sources_ = static_cast<int64_t>(m.size()) / param_.experts();
  param_.prepare_compute();
  x_ = param_.recipe_ops().received_input_copies(p, m);
  input_received_ = true;
  return run_fprop();
}

Tensor GroupedLinear::run_forward(const Tensor& x) {
  param_.prepare_compute();
  x_ = param_.recipe_ops().activation_copies(TensorRole::kInput, x, token_groups(), 0);
  input_received_ = false;
  return run_fprop();
}

Tensor GroupedLinear::run_fprop() {
  const int64_t n = param_.n(), k = param_.k();
  const std::vector<int64_t> groups = token_groups();
  Tensor y = Tensor::empty(*backend_, cfg_.out_dtype, {rows_, n});  // (M, N)
  GroupedGemmArgs a;
  a.op = GemmOp::kFprop;
  a.n = n;
  a.k = k;
  set_counts(a);
  a.lhs = x_.rowwise;
  a.rhs = weight_for_groups(param_.fprop_weight());
  a.out_dtype = cfg_.out_dtype;
  a.out = carve_rows(y.data(), groups, dtype_bytes_for(cfg_.out_dtype, n));
  check_op(ops::grouped_gemm(*backend_, a), "fprop");
  x_.release_rowwise();
  input_released_ = false;
  state_ = LinearState::kForwardDone;
  return y;
}

void GroupedLinear::release_input() {
  PACKMOE_CHECK(state_ == LinearState::kForwardDone, "release_input needs a forward first");
  x_ = ActivationCopies{};
  input_released_ = true;
}

void GroupedLinear::restore_input(const Tensor& x) {
  PACKMOE_CHECK(state_ == LinearState::kForwardDone && input_released_,
                "restore_input needs a forward whose input was released");
  PACKMOE_CHECK(!input_received_,
                "restore_input after forward_received: its copy came from a payload, not from x");
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(0) == rows_ &&
                    x.dim(1) == param_.k() && x.device() == backend_->device(),
                "restore_input: x must be the forward's (" << rows_ << ", " << param_.k()
                                                           << ") bf16, got "
                                                           << shape_string(x.shape()));
  x_ = param_.recipe_ops().activation_copies(TensorRole::kInput, x, token_groups(), 0);
  x_.release_rowwise();
  input_released_ = false;
}

Tensor GroupedLinear::backward(const Tensor& dy, GradAccum accum, Wgrad wgrad) {
  PACKMOE_CHECK(state_ == LinearState::kForwardDone,
                "backward needs a forward first (and runs once per forward)");
  PACKMOE_CHECK(!input_released_, "backward: the forward's input was released (restore_input)");
  const int64_t n = param_.n(), k = param_.k();
  PACKMOE_CHECK(dy.dtype() == DType::kBF16 && dy.rank() == 2 && dy.dim(0) == rows_ && dy.dim(1) == n,
                "backward: dy must be (" << rows_ << ", " << n << ") bf16, got "
                                         << shape_string(dy.shape()));
  PACKMOE_CHECK(dy.device() == backend_->device(), "backward: dy is not in the backend's memory");

  // Host counts: the rows in use, so the SR stream does not depend on the capacity.
  const int64_t used =
      m_device_.data() != nullptr ? rows_ : std::accumulate(m_.begin(), m_.end(), int64_t{0});
  const int64_t draws = used * n / kNvfp4Block;  // blocks of 16 SR draws (NVFP4)
  PACKMOE_CHECK(draws < (int64_t{1} << kSrBlockBits),
                "backward: dy of " << used << " x " << n
                                   << " needs more SR draws than a micro-batch has (2^"
                                   << kSrBlockBits << " blocks)");
  const std::vector<int64_t> groups = token_groups();
  dy_ = param_.recipe_ops().activation_copies(TensorRole::kGradOutput, dy, groups, grad_sr_offset_);
  grad_sr_offset_ += static_cast<uint64_t>(draws);
  Tensor dx = Tensor::empty(*backend_, cfg_.out_dtype, {rows_, k});  // (M, K)
  GroupedGemmArgs a;
  a.op = GemmOp::kDgrad;
  a.n = n;
  a.k = k;
  set_counts(a);
  a.lhs = dy_.rowwise;
  a.rhs = weight_for_groups(param_.dgrad_weight());
  a.out_dtype = cfg_.out_dtype;
  a.out = carve_rows(dx.data(), groups, dtype_bytes_for(cfg_.out_dtype, k));
  check_op(ops::grouped_gemm(*backend_, a), "dgrad");
  dy_.release_rowwise();

  if (cfg_.delay_wgrad || wgrad == Wgrad::kQueued) {
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

namespace {

// Groups [first, first + count) of a token-side operand with host counts (G pointers each).
GemmOperand slice_groups(const GemmOperand& o, size_t first, size_t count) {
  GemmOperand r = o;
  auto cut = [&](std::vector<const void*>& v) {
    if (!v.empty()) v = std::vector<const void*>(v.begin() + first, v.begin() + first + count);
  };
  cut(r.data);
  cut(r.scale);
  cut(r.bf16);
  if (o.decode_scale != nullptr) r.decode_scale = static_cast<const float*>(o.decode_scale) + first;
  return r;
}

}  // namespace

void GroupedLinear::run_wgrad(GradAccum accum) {
  GroupedStorage& main_grad = param_.main_grad_;  // (E, N, K) F32
  const size_t e = static_cast<size_t>(param_.experts());
  // Stale values left in a bound main_grad (GradWrite::kOverwrite) are overwritten, whatever
  // `accum` says.
  if (param_.take_grad_write() == GradWrite::kOverwrite) accum = GradAccum::kOverwrite;
  // One wgrad per source (their outputs are the same E experts): source 0 as `accum` says, the
  // others add to it in order.
  for (int64_t s = 0; s < sources_; ++s) {
    const GradAccum source_accum = s == 0 ? accum : GradAccum::kAccumulate;
    GroupedGemmArgs a;
    a.op = GemmOp::kWgrad;
    a.n = param_.n();
    a.k = param_.k();
    if (sources_ == 1) {
      set_counts(a);
      a.lhs = dy_.columnwise;
      a.rhs = x_.columnwise;
    } else {
      a.m.assign(m_.begin() + s * e, m_.begin() + (s + 1) * e);
      a.lhs = slice_groups(dy_.columnwise, s * e, e);
      a.rhs = slice_groups(x_.columnwise, s * e, e);
    }
    a.out_dtype = DType::kF32;
    if (cfg_.grad_accum_fusion) {
      a.out = main_grad.ptrs();
      a.accumulate = source_accum == GradAccum::kAccumulate;
      check_op(ops::grouped_gemm(*backend_, a), "wgrad into main_grad");
    } else {
      // The unfused path's separate gradient, in the param's layout (E buffers when discrete).
      GroupedStorage grad(*backend_, param_.layout(), param_.experts(),
                          main_grad.bytes_per_group());
      a.out = grad.ptrs();
      check_op(ops::grouped_gemm(*backend_, a), "wgrad");
      if (source_accum == GradAccum::kAccumulate)
        add_f32(main_grad, grad);
      else
        main_grad.copy_from(grad);
    }
  }
  x_ = ActivationCopies{};
  dy_ = ActivationCopies{};
}

}  // namespace packmoe
