// GroupedParam storage, master/grad state transitions, and the one-call weight quantization.
#include "nn/grouped_param.h"

#include <algorithm>

namespace packmoe {
namespace {

Backend::CopyKind copy_kind(Device dst, Device src) {
  if (src == Device::kCPU && dst != Device::kCPU) return Backend::CopyKind::kHostToDevice;
  if (src != Device::kCPU && dst == Device::kCPU) return Backend::CopyKind::kDeviceToHost;
  return Backend::CopyKind::kDeviceToDevice;
}

// The backend that performs a copy between two memories: the device side when there is one.
Backend& copy_engine(Backend& dst, Backend& src) {
  return dst.device() != Device::kCPU ? dst : src;
}

}  // namespace

// ---- GroupedStorage -----------------------------------------------------------------------------

GroupedStorage::GroupedStorage(Backend& memory, Layout layout, int64_t groups,
                               size_t bytes_per_group)
    : memory_(&memory), layout_(layout), bytes_per_group_(bytes_per_group) {
  PACKMOE_CHECK(groups > 0 && bytes_per_group > 0, "empty grouped storage");
  if (layout == Layout::kSingle) {
    buffers_.emplace_back(memory, groups * bytes_per_group);
    for (void* p : carve(buffers_[0].get(), groups, bytes_per_group)) ptrs_.push_back(p);
  } else {
    buffers_.reserve(groups);
    for (int64_t e = 0; e < groups; ++e) {
      buffers_.emplace_back(memory, bytes_per_group);
      ptrs_.push_back(buffers_.back().get());
    }
  }
}

GroupedStorage GroupedStorage::view(Backend& memory, Layout layout, std::vector<void*> ptrs,
                                    size_t bytes_per_group) {
  PACKMOE_CHECK(!ptrs.empty() && bytes_per_group > 0, "empty grouped view");
  for (size_t e = 0; e < ptrs.size(); ++e) {
    PACKMOE_CHECK(ptrs[e] != nullptr, "grouped view: group " << e << " is null");
    PACKMOE_CHECK(layout == Layout::kDiscrete ||
                      ptrs[e] == static_cast<uint8_t*>(ptrs[0]) + e * bytes_per_group,
                  "a single-layout view needs consecutive groups");
  }
  GroupedStorage v;
  v.memory_ = &memory;
  v.layout_ = layout;
  v.bytes_per_group_ = bytes_per_group;
  v.ptrs_ = std::move(ptrs);
  return v;
}

void* GroupedStorage::packed() const {
  PACKMOE_CHECK(allocated() && layout_ == Layout::kSingle, "packed() needs single-layout storage");
  return ptrs_[0];
}

void GroupedStorage::zero() {
  if (layout_ == Layout::kSingle && allocated()) {
    memory_->fill_zero(ptrs_[0], groups() * bytes_per_group_);
    return;
  }
  for (void* p : ptrs_) memory_->fill_zero(p, bytes_per_group_);
}

void GroupedStorage::release() {
  buffers_.clear();
  ptrs_.clear();
}

std::vector<uint8_t> GroupedStorage::download() const {
  std::vector<uint8_t> host(groups() * bytes_per_group_);
  for (int64_t e = 0; e < groups(); ++e)
    memory_->copy(host.data() + e * bytes_per_group_, ptrs_[e], bytes_per_group_,
                  Backend::CopyKind::kDeviceToHost);
  return host;
}

void GroupedStorage::copy_from(const GroupedStorage& src) {
  PACKMOE_CHECK(src.groups() == groups() && src.bytes_per_group() == bytes_per_group_,
                "copy_from: " << src.groups() << " x " << src.bytes_per_group() << " bytes into "
                              << groups() << " x " << bytes_per_group_);
  const Backend::CopyKind kind = copy_kind(memory_->device(), src.memory().device());
  Backend& engine = copy_engine(*memory_, src.memory());
  for (int64_t e = 0; e < groups(); ++e) engine.copy(ptrs_[e], src.group(e), bytes_per_group_, kind);
}

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

  // Keep the init on the side the caller had it.
  Backend& init_memory = init.device() == Device::kCPU ? cpu_backend() : backend;
  const size_t init_bytes = nk * sizeof(float);
  init_ = GroupedStorage(init_memory, layout, e_, init_bytes);
  for (int64_t e = 0; e < e_; ++e)
    init_memory.copy(init_.group(e), static_cast<const uint8_t*>(init.data()) + e * init_bytes,
                     init_bytes, Backend::CopyKind::kDeviceToDevice);

  main_grad_ = GroupedStorage(backend, layout, e_, nk * sizeof(float));
  main_grad_.zero();
  if (keeps_bf16()) bf16_ = GroupedStorage(backend, layout, e_, nk * 2);
  if (quantized()) {
    const bool mx = recipe_.recipe == Recipe::kMxfp8;
    const size_t data = mx ? nk : nk / 2;
    const size_t scale = mx ? nk / kMxfp8Block : nk / kNvfp4Block;
    quant_.row_data = GroupedStorage(backend, layout, e_, data);
    quant_.row_scale = GroupedStorage(backend, layout, e_, scale);
    quant_.col_data = GroupedStorage(backend, layout, e_, data);
    quant_.col_scale = GroupedStorage(backend, layout, e_, scale);
    if (!mx) {
      quant_.amax = GroupedStorage(backend, Layout::kSingle, e_, sizeof(float));
      quant_.decode_scale = GroupedStorage(backend, Layout::kSingle, e_, sizeof(float));
    }
  }
  write_primary_from(init_);
}

void GroupedParam::create_master() {
  PACKMOE_CHECK(master_state_ == MasterState::kInitHeld,
                "create_master: the FP32 master is made once, from the high-precision init, which "
                "is gone (released by the first create_master); a master from the dequantized "
                "primary weight is never made");
  master_ = GroupedStorage(*backend_, layout_, e_, n_ * k_ * sizeof(float));
  master_.copy_from(init_);
  init_.release();
  master_state_ = MasterState::kMasterReady;
}

void GroupedParam::zero_grad() {
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "zero_grad with a delayed wgrad pending would lose it: run backward_dw first");
  PACKMOE_CHECK(grad_binding_ == GradBinding::kOwned,
                "zero_grad on a main_grad bound to a data-parallel grad buffer: the buffer's "
                "zeroing is a transition of its state machine (DistOptimizer::prepare_forward); "
                "zeroing it here could wipe parameters staged in it");
  main_grad_.zero();
}

void GroupedParam::requantize_from_master() {
  PACKMOE_CHECK(master_state_ != MasterState::kInitHeld,
                "requantize_from_master before create_master");
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady,
                "requantize_from_master: the master is sharded (the distributed optimizer's "
                "parameter gather writes the primary)");
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "requantize_from_master with a delayed wgrad pending: its gradient would never "
                "reach the update; run backward_dw first");
  write_primary_from(master_);
}

void GroupedParam::prepare_compute() {
  check_primary_current("prepare_compute");
  if (!quantized() || primary_ == PrimaryWeight::kLowPrecision) return;
  quantize_weight(bf16_);
  compute_state_ = ComputeCopyState::kCurrent;
}

void GroupedParam::write_primary_from(const GroupedStorage& f32) {
  if (&f32.memory() != backend_) {  // an init kept on the host: the ops read backend memory
    GroupedStorage staged(*backend_, layout_, e_, f32.bytes_per_group());
    staged.copy_from(f32);
    write_primary_from(staged);
    return;
  }
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

void GroupedParam::write_primary_from_bf16(const GroupedStorage& bf16) {
  PACKMOE_CHECK(bf16.groups() == e_ && bf16.bytes_per_group() == static_cast<size_t>(n_ * k_ * 2) &&
                    &bf16.memory() == backend_,
                "write_primary_from_bf16: expected " << e_ << " groups of (" << n_ << ", " << k_
                                                     << ") BF16 in the param's backend memory");
  if (keeps_bf16()) {
    bf16_.copy_from(bf16);
    compute_state_ = quantized() ? ComputeCopyState::kStale : ComputeCopyState::kCurrent;
  } else {
    quantize_weight(bf16);
    compute_state_ = ComputeCopyState::kCurrent;
  }
  primary_state_ = PrimaryState::kCurrent;
}

void GroupedParam::check_primary_current(const char* what) const {
  PACKMOE_CHECK(primary_state_ == PrimaryState::kCurrent,
                what << ": the primary weight is older than the master (a distributed optimizer "
                        "step awaits its parameter gather: call DistOptimizer::prepare_forward "
                        "before any forward)");
}

// ---- sharded master and the parameter gather ---------------------------------------------------

std::string_view master_state_name(MasterState s) {
  switch (s) {
    case MasterState::kInitHeld: return "InitHeld (no master made yet)";
    case MasterState::kMasterReady: return "MasterReady";
    case MasterState::kSharded: return "Sharded (a distributed optimizer holds it)";
    case MasterState::kReplicated: return "Replicated (a distributed optimizer refreshes it)";
  }
  return "?";
}

int64_t GroupedParam::shard_unit_rows() const {
  switch (recipe_.recipe) {
    case Recipe::kBF16: return 1;
    case Recipe::kMxfp8: return kMxfp8Block;
    case Recipe::kNvfp4: return kNvfp4Block;
  }
  return 1;
}

void GroupedParam::copy_high_precision(int64_t begin, int64_t count, float* dst) const {
  PACKMOE_CHECK(begin >= 0 && count >= 0 && begin + count <= e_ * n_ * k_,
                "copy_high_precision: elements [" << begin << ", " << begin + count
                                                  << ") outside the pack of " << e_ * n_ * k_);
  PACKMOE_CHECK(master_state_ == MasterState::kInitHeld || master_state_ == MasterState::kMasterReady,
                "copy_high_precision: the master is already sharded");
  const GroupedStorage& src = master_state_ == MasterState::kInitHeld ? init_ : master_;
  const Backend::CopyKind kind = copy_kind(backend_->device(), src.memory().device());
  Backend& engine = copy_engine(*backend_, src.memory());
  const int64_t per_group = n_ * k_;
  // The range crosses expert boundaries: one copy per touched group (in either layout).
  for (int64_t i = begin; i < begin + count;) {
    const int64_t e = i / per_group, off = i - e * per_group;
    const int64_t n = std::min(per_group - off, begin + count - i);
    engine.copy(dst + (i - begin), static_cast<const float*>(src.group(e)) + off,
                n * sizeof(float), kind);
    i += n;
  }
}

void GroupedParam::release_for_sharded_master() {
  PACKMOE_CHECK(master_state_ == MasterState::kInitHeld || master_state_ == MasterState::kMasterReady,
                "the master is already sharded");
  init_.release();
  master_.release();
  master_state_ = MasterState::kSharded;
}

void GroupedParam::replicate_master() {
  PACKMOE_CHECK(master_state_ == MasterState::kInitHeld || master_state_ == MasterState::kMasterReady,
                "the master is already sharded");
  if (master_state_ == MasterState::kInitHeld) create_master();
  master_state_ = MasterState::kReplicated;
}

void GroupedParam::write_master_replica(const float* f32) {
  PACKMOE_CHECK(master_state_ == MasterState::kReplicated,
                "write_master_replica: the master is " << master_state_name(master_state_));
  const size_t bytes = n_ * k_ * sizeof(float);
  for (int64_t e = 0; e < e_; ++e)
    backend_->copy(master_.group(e), f32 + e * n_ * k_, bytes, Backend::CopyKind::kDeviceToDevice);
}

void GroupedParam::write_primary_from_replica() {
  PACKMOE_CHECK(master_state_ == MasterState::kReplicated,
                "write_primary_from_replica: the master is " << master_state_name(master_state_));
  write_primary_from(master_);
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

void GroupedParam::mark_primary_awaiting_gather() {
  PACKMOE_CHECK(master_state_ == MasterState::kSharded || master_state_ == MasterState::kReplicated,
                "only a sharded master is updated apart from its primary weight");
  primary_state_ = PrimaryState::kAwaitingGather;
}

std::vector<PackedComponent> GroupedParam::packed_components() const {
  if (keeps_bf16()) return {{"bf16", 2, 1}};
  if (recipe_.recipe == Recipe::kNvfp4) return {{"row_data", 1, 2}, {"row_scale", 1, kNvfp4Block}};
  if (recipe_.mxfp8_weight_2d) return {{"row_data", 1, 1}, {"row_scale", 1, kMxfp8Block}};
  return {{"row_data", 1, 1}, {"row_scale", 1, kMxfp8Block}, {"col_data", 1, 1},
          {"col_scale", 1, kMxfp8Block}};
}

bool GroupedParam::needs_global_amax() const {
  return !keeps_bf16() && recipe_.recipe == Recipe::kNvfp4;
}

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
  check_op(ops::nvfp4_amax(*backend_, in, amax + e0), "rows amax (nvfp4)");
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
  auto outputs = [&](size_t c) {
    std::vector<void*> out;
    int64_t row = r0;
    for (int64_t rows : in.rows) {
      out.push_back(static_cast<uint8_t*>(images[c]) +
                    row * k_ * comps[c].bytes_num / comps[c].bytes_den);
      row += rows;
    }
    return out;
  };
  if (keeps_bf16()) {
    backend_->copy(outputs(0)[0], bf16_rows, (r1 - r0) * k_ * 2,
                   Backend::CopyKind::kDeviceToDevice);
    return;
  }
  if (recipe_.recipe == Recipe::kMxfp8) {
    Mxfp8Config cfg = mxfp8_config(recipe_, TensorRole::kWeight);
    Mxfp8Outputs out{outputs(0), outputs(1), {}, {}, {}, {}};
    cfg.columnwise = !cfg.two_d;  // a 2D columnwise copy is derived after the gather
    if (cfg.columnwise) {
      out.col_data = outputs(2);
      out.col_scale = outputs(3);
    }
    check_op(ops::quantize_mxfp8(*backend_, in, cfg, out), "row-range quantize (mxfp8)");
    return;
  }
  PACKMOE_CHECK(amax != nullptr, "quantize_rows (nvfp4) needs the pack's (E,) amax");
  Nvfp4Config cfg = nvfp4_config(recipe_, TensorRole::kWeight, 0);
  cfg.columnwise = false;  // the transposed copy is derived after the gather
  cfg.amax = amax + e0;
  Nvfp4Outputs out;  // no row_amax: it would only echo the given one
  out.row_data = outputs(0);
  out.row_scale = outputs(1);
  check_op(ops::quantize_nvfp4(*backend_, in, cfg, out), "row-range quantize (nvfp4)");
}

void GroupedParam::write_primary_from_packed(const std::vector<const void*>& images,
                                             const float* amax) {
  const std::vector<PackedComponent> comps = packed_components();
  PACKMOE_CHECK(images.size() == comps.size(),
                "write_primary_from_packed: " << images.size() << " images for " << comps.size()
                                              << " components");
  // Component c of the pack into its storage: one copy (kSingle) or one per expert.
  auto fill = [&](GroupedStorage& dst, size_t c) {
    const size_t bytes = static_cast<size_t>(n_ * k_ * comps[c].bytes_num / comps[c].bytes_den);
    PACKMOE_CHECK(dst.bytes_per_group() == bytes, "component " << comps[c].name << " size");
    const uint8_t* src = static_cast<const uint8_t*>(images[c]);
    if (dst.layout() == Layout::kSingle) {
      backend_->copy(dst.packed(), src, e_ * bytes, Backend::CopyKind::kDeviceToDevice);
      return;
    }
    for (int64_t e = 0; e < e_; ++e)
      backend_->copy(dst.group(e), src + e * bytes, bytes, Backend::CopyKind::kDeviceToDevice);
  };
  if (keeps_bf16()) {
    fill(bf16_, 0);
    compute_state_ = quantized() ? ComputeCopyState::kStale : ComputeCopyState::kCurrent;
    primary_state_ = PrimaryState::kCurrent;
    return;
  }
  fill(quant_.row_data, 0);
  fill(quant_.row_scale, 1);
  const bool nv = recipe_.recipe == Recipe::kNvfp4;
  if (nv || recipe_.mxfp8_weight_2d) {
    Weight2dCopies w;
    w.format = nv ? Tiled2dFormat::kNvfp4 : Tiled2dFormat::kMxfp8;
    w.rows = n_;
    w.cols = k_;
    w.row_data = quant_.row_data.const_ptrs();
    w.row_scale = quant_.row_scale.const_ptrs();
    w.col_data = quant_.col_data.ptrs();
    w.col_scale = quant_.col_scale.ptrs();
    check_op(ops::weight_2d_columnwise(*backend_, w), "columnwise copy of a 2D weight");
  } else {
    fill(quant_.col_data, 2);
    fill(quant_.col_scale, 3);
  }
  if (nv) {
    PACKMOE_CHECK(amax != nullptr, "write_primary_from_packed (nvfp4) needs the (E,) amax");
    backend_->copy(quant_.amax.packed(), amax, e_ * sizeof(float),
                   Backend::CopyKind::kDeviceToDevice);
    check_op(ops::nvfp4_decode_scales(*backend_, static_cast<const float*>(quant_.amax.packed()),
                                           static_cast<float*>(quant_.decode_scale.packed()), e_),
             "weight decode scales (nvfp4)");
  }
  compute_state_ = ComputeCopyState::kCurrent;
  primary_state_ = PrimaryState::kCurrent;
}

void GroupedParam::quantize_weight(const GroupedStorage& bf16) {
  GroupedMatrices in;  // E x (N, K) BF16
  in.dtype = DType::kBF16;
  in.cols = k_;
  in.data = bf16.const_ptrs();
  in.rows.assign(e_, n_);
  if (recipe_.recipe == Recipe::kMxfp8) {
    Mxfp8Outputs out{quant_.row_data.ptrs(), quant_.row_scale.ptrs(), quant_.col_data.ptrs(),
                     quant_.col_scale.ptrs(), {}, {}};
    check_op(ops::quantize_mxfp8(*backend_, in, mxfp8_config(recipe_, TensorRole::kWeight), out),
             "weight quantize (mxfp8)");
    return;
  }
  // 2D tiles: the columnwise amax equals the rowwise one (formats/nvfp4.h), so it is not kept.
  DeviceBuffer col_amax(*backend_, e_ * sizeof(float));  // (E,) F32
  Nvfp4Outputs out;
  out.row_data = quant_.row_data.ptrs();
  out.row_scale = quant_.row_scale.ptrs();
  out.row_amax = quant_.amax.packed();
  out.col_data = quant_.col_data.ptrs();
  out.col_scale = quant_.col_scale.ptrs();
  out.col_amax = col_amax.get();
  check_op(ops::quantize_nvfp4(*backend_, in, nvfp4_config(recipe_, TensorRole::kWeight, 0), out),
           "weight quantize (nvfp4)");
  check_op(ops::nvfp4_decode_scales(*backend_, static_cast<const float*>(quant_.amax.packed()),
                                         static_cast<float*>(quant_.decode_scale.packed()), e_),
           "weight decode scales (nvfp4)");
}

GemmOperand GroupedParam::fprop_weight() const {
  check_primary_current("fprop_weight");
  PACKMOE_CHECK(compute_state_ == ComputeCopyState::kCurrent,
                "fprop_weight: compute copies are stale (prepare_compute not run since the weight "
                "changed)");
  GemmOperand o;
  o.format = operand_format(recipe_.recipe);
  if (!quantized()) {
    o.data = bf16_.const_ptrs();
    return o;
  }
  o.data = quant_.row_data.const_ptrs();
  o.scale = quant_.row_scale.const_ptrs();
  if (recipe_.recipe == Recipe::kNvfp4) o.decode_scale = quant_.decode_scale.packed();
  return o;
}

GemmOperand GroupedParam::dgrad_weight() const {
  check_primary_current("dgrad_weight");
  PACKMOE_CHECK(compute_state_ == ComputeCopyState::kCurrent,
                "dgrad_weight: compute copies are stale (the weight changed after forward)");
  GemmOperand o;
  o.format = operand_format(recipe_.recipe);
  if (!quantized()) {
    o.data = bf16_.const_ptrs();
    return o;
  }
  o.data = quant_.col_data.const_ptrs();
  o.scale = quant_.col_scale.const_ptrs();
  if (recipe_.recipe == Recipe::kNvfp4) o.decode_scale = quant_.decode_scale.packed();
  return o;
}

const GroupedStorage& GroupedParam::master() const {
  if (master_state_ == MasterState::kReplicated) {
    check_primary_current("master (an FP32 replica)");
    return master_;
  }
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady,
                "no full master here: the master is " << master_state_name(master_state_));
  return master_;
}

GroupedStorage& GroupedParam::master() {
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady,
                "no full master here: the master is " << master_state_name(master_state_));
  return master_;
}

std::vector<NamedStorage> GroupedParam::weight_components() const {
  std::vector<NamedStorage> out;
  const NamedStorage all[] = {{"bf16", &bf16_},
                              {"row_data", &quant_.row_data},
                              {"row_scale", &quant_.row_scale},
                              {"col_data", &quant_.col_data},
                              {"col_scale", &quant_.col_scale},
                              {"amax", &quant_.amax},
                              {"decode_scale", &quant_.decode_scale}};
  // Compute copies of a high-precision primary hold nothing meaningful while stale.
  const bool quant_meaningful = primary_ == PrimaryWeight::kLowPrecision ||
                                compute_state_ == ComputeCopyState::kCurrent;
  for (const NamedStorage& s : all)
    if (s.storage->allocated() && (s.storage == &bf16_ || quant_meaningful)) out.push_back(s);
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

// ---- elementwise ops on grouped storage ---------------------------------------------------------

void cast_f32_to_bf16(const GroupedStorage& src, const GroupedStorage& dst) {
  PACKMOE_CHECK(&src.memory() == &dst.memory(), "cast_f32_to_bf16: operands in different memories");
  check_op(ops::cast_f32_to_bf16(dst.memory(), segments<const float>(src), segments<uint16_t>(dst)),
           "cast_f32_to_bf16");
}

void add_f32(const GroupedStorage& dst, const GroupedStorage& src) {
  PACKMOE_CHECK(&src.memory() == &dst.memory(), "add_f32: operands in different memories");
  check_op(ops::add_f32(dst.memory(), segments<float>(dst), segments<const float>(src)), "add_f32");
}

void check_op(const Status& s, const char* what) {
  PACKMOE_CHECK(s.is_ok(), what << ": " << s.message());
}

}  // namespace packmoe
