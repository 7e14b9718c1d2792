// GroupedParam storage, master/grad state transitions, and the one-call weight quantization.
#include "nn/grouped_param.h"

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

void* GroupedStorage::packed() const {
  PACKMOE_CHECK(allocated() && layout_ == Layout::kSingle, "packed() needs single-layout storage");
  return buffers_[0].get();
}

void GroupedStorage::zero() {
  for (DeviceBuffer& b : buffers_) memory_->fill_zero(b.get(), b.size());
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
  main_grad_.zero();
}

void GroupedParam::requantize_from_master() {
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady,
                "requantize_from_master before create_master");
  PACKMOE_CHECK(grad_state_ == GradState::kSettled,
                "requantize_from_master with a delayed wgrad pending: its gradient would never "
                "reach the update; run backward_dw first");
  write_primary_from(master_);
}

void GroupedParam::prepare_compute() {
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
    return;
  }
  // Low-precision primary: the BF16 values exist only for the duration of the quantize call.
  GroupedStorage staging(*backend_, layout_, e_, n_ * k_ * 2);
  cast_f32_to_bf16(f32, staging);
  quantize_weight(staging);
  compute_state_ = ComputeCopyState::kCurrent;
}

void GroupedParam::quantize_weight(const GroupedStorage& bf16) {
  GroupedMatrices in;  // E x (N, K) BF16
  in.dtype = DType::kBF16;
  in.cols = k_;
  in.data = bf16.const_ptrs();
  in.rows.assign(e_, n_);
  if (recipe_.recipe == Recipe::kMxfp8) {
    Mxfp8Outputs out{quant_.row_data.ptrs(), quant_.row_scale.ptrs(), quant_.col_data.ptrs(),
                     quant_.col_scale.ptrs()};
    check_op(backend_->quantize_mxfp8(in, mxfp8_config(recipe_, TensorRole::kWeight), out),
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
  check_op(backend_->quantize_nvfp4(in, nvfp4_config(recipe_, TensorRole::kWeight, 0), out),
           "weight quantize (nvfp4)");
  check_op(backend_->nvfp4_decode_scales(static_cast<const float*>(quant_.amax.packed()),
                                         static_cast<float*>(quant_.decode_scale.packed()), e_),
           "weight decode scales (nvfp4)");
}

GemmOperand GroupedParam::fprop_weight() const {
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
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady, "no master before create_master");
  return master_;
}

GroupedStorage& GroupedParam::master() {
  PACKMOE_CHECK(master_state_ == MasterState::kMasterReady, "no master before create_master");
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
  check_op(dst.memory().cast_f32_to_bf16(segments<const float>(src), segments<uint16_t>(dst)),
           "cast_f32_to_bf16");
}

void add_f32(const GroupedStorage& dst, const GroupedStorage& src) {
  PACKMOE_CHECK(&src.memory() == &dst.memory(), "add_f32: operands in different memories");
  check_op(dst.memory().add_f32(segments<float>(dst), segments<const float>(src)), "add_f32");
}

void check_op(const Status& s, const char* what) {
  PACKMOE_CHECK(s.is_ok(), what << ": " << s.message());
}

}  // namespace packmoe
