// GroupedParam: FP32 / grad state transitions and the primary weight's way from FP32 (or gathered
// images) into the recipe's copies (nn/linear_recipe.h does the quantization).
#include "nn/grouped_param.h"

#include <algorithm>

namespace packmoe {
// ---- GroupedParam -------------------------------------------------------------------------------

GroupedParam::GroupedParam(Backend& backend, const QuantRecipe& recipe, PrimaryWeight primary,
                           Layout layout, const Tensor& init)
    : backend_(&backend), recipe_(recipe), primary_(primary), layout_(layout) {
  PACKMOE_CHECK(init.dtype() == DType::kF32 && init.rank() == 3,
                "GroupedParam init must be (E, N, K) F32, got " << shape_string(init.shape()));
  PACKMOE_CHECK(init.device() == Device::kCPU || init.device() == backend.device(),
                "GroupedParam init must be on the host or in the backend's memory");
  e_ = init.dim(0);
  n_ = init.dim(1);
  k_ = init.dim(2);
  const int64_t nk = n_ * k_;

  // The init lives in the backend's memory: a host init is uploaded once (one copy per group), so
  // the primary and the optimizer's master are made there with no further host traffic.
  const size_t init_bytes = nk * sizeof(float);
  const Backend::CopyKind kind = copy_kind(backend.device(), init.device());
  fp32_ = GroupedStorage(backend, layout, e_, init_bytes);
  for (int64_t e = 0; e < e_; ++e)
    backend.copy(fp32_.group(e), static_cast<const uint8_t*>(init.data()) + e * init_bytes,
                 init_bytes, kind);

  main_grad_ = GroupedStorage(backend, layout, e_, nk * sizeof(float));
  main_grad_.zero();
  ops_ = make_linear_recipe(backend, recipe, layout, e_, n_, k_);
  if (keeps_bf16()) bf16_ = GroupedStorage(backend, layout, e_, nk * 2);
  write_primary_from(fp32_);
}

void GroupedParam::zero_grad() {
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "zero_grad with a delayed wgrad pending would lose it: run backward_dw first");
  PACKMOE_CHECK(grad_binding_ == GradBinding::kOwned,
                "zero_grad on a main_grad bound to an optimizer's grad buffer: the buffer's "
                "zeroing is a transition of its state machine (the optimizer's prepare_forward); "
                "zeroing it here could wipe parameters staged in it");
  main_grad_.zero();
}

void GroupedParam::expect_grad_overwrite() {
  PACKMOE_CHECK(grad_binding_ == GradBinding::kBound,
                "expect_grad_overwrite on an owned main_grad: only a grad buffer's owner leaves "
                "stale gradients in place");
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "expect_grad_overwrite with a delayed wgrad pending: it would add onto stale values");
  grad_write_ = GradWrite::kOverwrite;
}

GradWrite GroupedParam::take_grad_write() {
  const GradWrite w = grad_write_;
  grad_write_ = GradWrite::kAdd;
  return w;
}

void GroupedParam::prepare_compute() {
  check_primary_current("prepare_compute");
  if (!quantized() || primary_ == PrimaryWeight::kLowPrecision) return;
  ops_->quantize_weight(bf16_, nullptr);
  compute_state_ = ComputeCopyState::kCurrent;
}

void GroupedParam::write_primary_from(const GroupedStorage& f32) {
  if (keeps_bf16()) {
    cast_f32_to_bf16(f32, bf16_);
    // A high-precision primary under a quantized recipe needs prepare_compute() again.
    compute_state_ = quantized() ? ComputeCopyState::kStale : ComputeCopyState::kCurrent;
    primary_state_ = PrimaryState::kCurrent;
    return;
  }
  // Low-precision primary: the BF16 values exist only for the duration of the quantize call.
  GroupedStorage staging(*backend_, layout_, e_, n_ * k_ * 2);
  cast_f32_to_bf16(f32, staging);
  write_primary_from_bf16(staging);
}

void GroupedParam::write_primary_from_bf16(const GroupedStorage& bf16, const float* amax) {
  PACKMOE_CHECK(bf16.groups() == e_ && bf16.bytes_per_group() == static_cast<size_t>(n_ * k_ * 2) &&
                    &bf16.memory() == backend_,
                "write_primary_from_bf16: expected " << e_ << " groups of (" << n_ << ", " << k_
                                                     << ") BF16 in the param's backend memory");
  if (keeps_bf16()) {
    PACKMOE_CHECK(amax == nullptr, "write_primary_from_bf16: an amax for a BF16 primary");
    if (bf16_.ptrs() != bf16.ptrs()) bf16_.copy_from(bf16);  // bound to these views: in place
    compute_state_ = quantized() ? ComputeCopyState::kStale : ComputeCopyState::kCurrent;
  } else {
    PACKMOE_CHECK(amax == nullptr || needs_global_amax(),
                  "write_primary_from_bf16: an amax for a recipe without a per-expert one");
    ops_->quantize_weight(bf16, amax);
    compute_state_ = ComputeCopyState::kCurrent;
  }
  primary_state_ = PrimaryState::kCurrent;
}

void GroupedParam::check_primary_current(const char* what) const {
  PACKMOE_CHECK(primary_state_ == PrimaryState::kCurrent,
                what << ": the primary weight is older than the master (an optimizer step "
                        "awaits its parameter gather: call the optimizer's prepare_forward "
                        "before any forward)");
}

// ---- the optimizer's side ---------------------------------------------------------------------

std::string_view fp32_state_name(Fp32State s) {
  switch (s) {
    case Fp32State::kInitHeld: return "InitHeld (no optimizer took it yet)";
    case Fp32State::kReleased: return "Released (the optimizer holds the master)";
    case Fp32State::kReplicated: return "Replicated (the optimizer refreshes it)";
  }
  return "?";
}

int64_t GroupedParam::shard_unit_rows() const { return ops_->shard_unit_rows(); }

void GroupedParam::copy_init(int64_t begin, int64_t count, float* dst) const {
  PACKMOE_CHECK(begin >= 0 && count >= 0 && begin + count <= e_ * n_ * k_,
                "copy_init: elements [" << begin << ", " << begin + count
                                        << ") outside the pack of " << e_ * n_ * k_);
  PACKMOE_CHECK(fp32_state_ == Fp32State::kInitHeld,
                "copy_init: the init is gone (" << fp32_state_name(fp32_state_) << ")");
  const Backend::CopyKind kind = copy_kind(backend_->device(), fp32_.memory().device());
  Backend& engine = copy_engine(*backend_, fp32_.memory());
  const int64_t per_group = n_ * k_;
  // The range crosses expert boundaries: one copy per touched group (in either layout).
  for (int64_t i = begin; i < begin + count;) {
    const int64_t e = i / per_group, off = i - e * per_group;
    const int64_t n = std::min(per_group - off, begin + count - i);
    engine.copy(dst + (i - begin), static_cast<const float*>(fp32_.group(e)) + off,
                n * sizeof(float), kind);
    i += n;
  }
}

void GroupedParam::release_init() {
  PACKMOE_CHECK(fp32_state_ == Fp32State::kInitHeld,
                "release_init: the init is gone (" << fp32_state_name(fp32_state_) << ")");
  fp32_.release();
  fp32_state_ = Fp32State::kReleased;
}

void GroupedParam::keep_fp32_replica() {
  PACKMOE_CHECK(fp32_state_ == Fp32State::kInitHeld,
                "keep_fp32_replica: the init is gone (" << fp32_state_name(fp32_state_) << ")");
  fp32_state_ = Fp32State::kReplicated;
}

void GroupedParam::write_fp32_replica(const float* f32) {
  PACKMOE_CHECK(fp32_state_ == Fp32State::kReplicated,
                "write_fp32_replica: the param is " << fp32_state_name(fp32_state_));
  if (fp32_.group(0) == f32) return;  // bound: the gather wrote it in place
  const size_t bytes = n_ * k_ * sizeof(float);
  for (int64_t e = 0; e < e_; ++e)
    backend_->copy(fp32_.group(e), f32 + e * n_ * k_, bytes, Backend::CopyKind::kDeviceToDevice);
}

void GroupedParam::bind_fp32_replica(const std::vector<void*>& views) {
  PACKMOE_CHECK(fp32_state_ == Fp32State::kReplicated,
                "bind_fp32_replica: the param is " << fp32_state_name(fp32_state_));
  PACKMOE_CHECK(primary_state_ == PrimaryState::kAwaitingGather,
                "bind_fp32_replica: only a replica awaiting its gather (its bytes would be lost)");
  PACKMOE_CHECK(static_cast<int64_t>(views.size()) == e_,
                "bind_fp32_replica: " << views.size() << " views for " << e_ << " experts");
  fp32_ = GroupedStorage::view(*backend_, layout_, views, n_ * k_ * sizeof(float));
}

void GroupedParam::write_primary_from_replica() {
  PACKMOE_CHECK(fp32_state_ == Fp32State::kReplicated,
                "write_primary_from_replica: the param is " << fp32_state_name(fp32_state_));
  write_primary_from(fp32_);
}

void GroupedParam::bind_main_grad(const std::vector<void*>& views) {
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "bind_main_grad with a delayed wgrad pending would lose it");
  PACKMOE_CHECK(grad_binding_ == GradBinding::kOwned, "main_grad is already bound");
  PACKMOE_CHECK(static_cast<int64_t>(views.size()) == e_,
                "bind_main_grad: " << views.size() << " views for " << e_ << " experts");
  main_grad_ = GroupedStorage::view(*backend_, layout_, views, n_ * k_ * sizeof(float));
  grad_binding_ = GradBinding::kBound;
}

void GroupedParam::bind_bf16_primary(const std::vector<void*>& views) {
  PACKMOE_CHECK(keeps_bf16(), "bind_bf16_primary: the primary is not the BF16 param");
  PACKMOE_CHECK(primary_state_ == PrimaryState::kAwaitingGather,
                "bind_bf16_primary: only a primary awaiting its gather (its bytes would be lost)");
  PACKMOE_CHECK(static_cast<int64_t>(views.size()) == e_,
                "bind_bf16_primary: " << views.size() << " views for " << e_ << " experts");
  bf16_ = GroupedStorage::view(*backend_, layout_, views, n_ * k_ * sizeof(uint16_t));
  compute_state_ = ComputeCopyState::kStale;
}

void GroupedParam::mark_primary_awaiting_gather() {
  PACKMOE_CHECK(fp32_state_ != Fp32State::kInitHeld,
                "only a master the optimizer holds is updated apart from its primary weight");
  primary_state_ = PrimaryState::kAwaitingGather;
}

std::vector<PackedComponent> GroupedParam::packed_components() const {
  if (keeps_bf16()) return {{"bf16", 2, 1}};
  return ops_->packed_components();
}

bool GroupedParam::needs_global_amax() const { return !keeps_bf16() && ops_->needs_global_amax(); }

GroupedMatrices GroupedParam::row_groups(const void* bf16_rows, int64_t r0, int64_t r1,
                                         int64_t& first_expert) const {
  const int64_t unit = shard_unit_rows();
  PACKMOE_CHECK(0 <= r0 && r0 < r1 && r1 <= e_ * n_ && r0 % unit == 0 && r1 % unit == 0,
                "rows [" << r0 << ", " << r1 << ") of a pack of " << e_ * n_
                         << " rows are not whole blocks of " << unit << " rows");
  GroupedMatrices in;  // experts first_expert.., each (rows_g, K) BF16
  in.dtype = DType::kBF16;
  in.cols = k_;
  first_expert = r0 / n_;
  for (int64_t r = r0; r < r1;) {
    const int64_t end = std::min(r1, (r / n_ + 1) * n_);
    in.data.push_back(static_cast<const uint8_t*>(bf16_rows) + (r - r0) * k_ * 2);
    in.rows.push_back(end - r);
    r = end;
  }
  return in;
}

void GroupedParam::rows_amax(const void* bf16_rows, int64_t r0, int64_t r1, float* amax) const {
  PACKMOE_CHECK(needs_global_amax(), "rows_amax: only NVFP4 primaries have a per-expert amax");
  int64_t e0 = 0;
  const GroupedMatrices in = row_groups(bf16_rows, r0, r1, e0);
  ops_->rows_amax(in, amax + e0);
}

void GroupedParam::quantize_rows(const void* bf16_rows, int64_t r0, int64_t r1, const float* amax,
                                 const std::vector<void*>& images) const {
  const std::vector<PackedComponent> comps = packed_components();
  PACKMOE_CHECK(images.size() == comps.size(),
                "quantize_rows: " << images.size() << " images for " << comps.size()
                                  << " components");
  int64_t e0 = 0;
  const GroupedMatrices in = row_groups(bf16_rows, r0, r1, e0);
  // Output pointer of group g in image c: the group's first row at its offset in the pack.
  std::vector<std::vector<void*>> outputs(comps.size());
  for (size_t c = 0; c < comps.size(); ++c) {
    int64_t row = r0;
    for (int64_t rows : in.rows) {
      outputs[c].push_back(static_cast<uint8_t*>(images[c]) +
                           row * k_ * comps[c].bytes_num / comps[c].bytes_den);
      row += rows;
    }
  }
  if (keeps_bf16()) {
    backend_->copy(outputs[0][0], bf16_rows, (r1 - r0) * k_ * 2,
                   Backend::CopyKind::kDeviceToDevice);
    return;
  }
  ops_->quantize_rows(in, amax ? amax + e0 : nullptr, outputs);
}

void GroupedParam::write_primary_from_packed(const std::vector<const void*>& images,
                                             const float* amax) {
  const std::vector<PackedComponent> comps = packed_components();
  PACKMOE_CHECK(images.size() == comps.size(),
                "write_primary_from_packed: " << images.size() << " images for " << comps.size()
                                              << " components");
  if (keeps_bf16()) {
    if (bf16_.layout() == Layout::kSingle)  // the image is (E, N, K) packed too: one copy
      backend_->copy(bf16_.packed(), images[0], e_ * n_ * k_ * 2, Backend::CopyKind::kDeviceToDevice);
    else
      for (int64_t e = 0; e < e_; ++e)
        backend_->copy(bf16_.group(e), static_cast<const uint8_t*>(images[0]) + e * n_ * k_ * 2,
                       n_ * k_ * 2, Backend::CopyKind::kDeviceToDevice);
    compute_state_ = quantized() ? ComputeCopyState::kStale : ComputeCopyState::kCurrent;
    primary_state_ = PrimaryState::kCurrent;
    return;
  }
  ops_->write_packed(images, amax);
  compute_state_ = ComputeCopyState::kCurrent;
  primary_state_ = PrimaryState::kCurrent;
}

GemmOperand GroupedParam::fprop_weight() const {
  check_primary_current("fprop_weight");
  PACKMOE_CHECK(compute_state_ == ComputeCopyState::kCurrent,
                "fprop_weight: compute copies are stale (prepare_compute not run since the weight "
                "changed)");
  return ops_->fprop_weight(bf16_);
}

GemmOperand GroupedParam::dgrad_weight() const {
  check_primary_current("dgrad_weight");
  PACKMOE_CHECK(compute_state_ == ComputeCopyState::kCurrent,
                "dgrad_weight: compute copies are stale (the weight changed after forward)");
  return ops_->dgrad_weight(bf16_);
}

const GroupedStorage& GroupedParam::fp32_weight() const {
  if (fp32_state_ == Fp32State::kReplicated) check_primary_current("fp32_weight (a replica)");
  PACKMOE_CHECK(fp32_state_ != Fp32State::kReleased,
                "no FP32 weight here: the param is " << fp32_state_name(fp32_state_));
  return fp32_;
}

std::vector<NamedStorage> GroupedParam::weight_components() const {
  std::vector<NamedStorage> out;
  if (bf16_.allocated()) out.push_back({"bf16", &bf16_});
  // Compute copies of a high-precision primary hold nothing meaningful while stale.
  if (primary_ == PrimaryWeight::kLowPrecision || compute_state_ == ComputeCopyState::kCurrent)
    for (const NamedStorage& s : ops_->components()) out.push_back(s);
  return out;
}

void GroupedParam::mark_wgrad_pending() {
  PACKMOE_CHECK(grad_state_ == GradState::kSettled, "a second delayed wgrad queued on one param");
  grad_state_ = GradState::kWgradPending;
}

void GroupedParam::mark_wgrad_settled() {
  PACKMOE_CHECK(grad_state_ == GradState::kWgradPending, "no delayed wgrad to settle");
  grad_state_ = GradState::kSettled;
}

}  // namespace packmoe
