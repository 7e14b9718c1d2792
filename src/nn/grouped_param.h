// GroupedParam: the packed expert weight (E, N, K) of one grouped linear: its primary weight in the
// recipe's format, the FP32 master, the FP32 main_grad and, until the master exists, the FP32 init.
// Invariants: every low-precision copy comes from ONE quantize call over all E experts; the master
// is made once, from the original init (never from dequantized values); per-expert views are
// pointers into storage they do not own; single and discrete layouts feed the same ops.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "core/tensor.h"
#include "nn/recipe.h"

namespace packmoe {

enum class Layout {
  kSingle,    // one allocation per component, expert e at offset e * bytes_per_group
  kDiscrete,  // E allocations per component (the way most frameworks store experts)
};

// E groups of equal byte size in one backend's memory, in either layout. group(e) is a view.
class GroupedStorage {
 public:
  GroupedStorage() = default;
  GroupedStorage(Backend& memory, Layout layout, int64_t groups, size_t bytes_per_group);

  bool allocated() const { return !ptrs_.empty(); }
  Layout layout() const { return layout_; }
  int64_t groups() const { return static_cast<int64_t>(ptrs_.size()); }
  size_t bytes_per_group() const { return bytes_per_group_; }
  Backend& memory() const { return *memory_; }
  void* group(int64_t e) const { return ptrs_.at(e); }
  const std::vector<void*>& ptrs() const { return ptrs_; }  // (E,) the views
  std::vector<const void*> const_ptrs() const { return {ptrs_.begin(), ptrs_.end()}; }
  // Base of the one (E, ...) allocation; kSingle only.
  void* packed() const;

  void zero();
  void release();  // frees the memory; allocated() becomes false
  // Group-major host copy: what the packed buffer holds, whichever the layout.
  std::vector<uint8_t> download() const;
  // Group by group from `src` (same group count and size), across memories (host <-> device).
  void copy_from(const GroupedStorage& src);

 private:
  Backend* memory_ = nullptr;
  Layout layout_ = Layout::kSingle;
  size_t bytes_per_group_ = 0;
  std::vector<DeviceBuffer> buffers_;  // 1 (kSingle) or E (kDiscrete)
  std::vector<void*> ptrs_;            // (E,)
};

// The quantized copies of a packed (E, N, K) weight; the GEMM operand table in
// backend/grouped_gemm.h says which GEMM reads which. The NVFP4 per-expert scalars are one (E,)
// array in BOTH layouts: every op takes them as a single (G,) array (Nvfp4Outputs::row_amax,
// GemmOperand::decode_scale), so E separate 4-byte allocations would only add gather copies.
struct QuantizedWeight {
  GroupedStorage row_data;      // MXFP8 (N, K) E4M3       NVFP4 (N, K/2) bytes
  GroupedStorage row_scale;     // MXFP8 (N, K/32) E8M0    NVFP4 (N, K/16) E4M3
  GroupedStorage col_data;      // MXFP8 (N, K)            NVFP4 (K, N/2) bytes, transposed
  GroupedStorage col_scale;     // MXFP8 (N/32, K) E8M0    NVFP4 (K, N/16) E4M3
  GroupedStorage amax;          // NVFP4 (E,) F32; 2D weights: the same for both copies
  GroupedStorage decode_scale;  // NVFP4 (E,) F32 S_dec = nvfp4_decode_scale(amax)
};

// Where the FP32 master stands. The only transition is kInitHeld -> kMasterReady.
enum class MasterState {
  kInitHeld,     // the FP32 init is kept; no master yet
  kMasterReady,  // the master was made from the init; the init is released
};

// Whether main_grad holds every gradient the layer has computed.
enum class GradState {
  kSettled,       // nothing owed
  kWgradPending,  // a delayed wgrad is queued (GroupedLinear::backward_dw pays it)
};

// Whether the compute copies the GEMMs read match the current weight (high-precision primary
// with a quantized recipe re-quantizes at every forward; every other case is always current).
enum class ComputeCopyState { kStale, kCurrent };

struct NamedStorage {
  std::string name;
  const GroupedStorage* storage;
};

class GroupedParam {
 public:
  // init: (E, N, K) F32 on the host or in `backend`'s memory. It is copied and kept on the side
  // it came from (host keeps device memory free, like TE's CPU copy) until create_master(). The
  // primary weight is made from it now: bf16(init) (RNE), quantized once over the pack.
  GroupedParam(Backend& backend, const QuantRecipe& recipe, PrimaryWeight primary, Layout layout,
               const Tensor& init);
  GroupedParam(const GroupedParam&) = delete;
  GroupedParam& operator=(const GroupedParam&) = delete;

  Backend& backend() const { return *backend_; }
  const QuantRecipe& recipe() const { return recipe_; }
  PrimaryWeight primary() const { return primary_; }
  Layout layout() const { return layout_; }
  int64_t experts() const { return e_; }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  MasterState master_state() const { return master_state_; }
  GradState grad_state() const { return grad_state_; }
  ComputeCopyState compute_state() const { return compute_state_; }

  // kInitHeld -> kMasterReady: master (E, N, K) F32 = the init's bytes; the init is released.
  // A second call (or any call once the init is gone) is a PACKMOE_CHECK error.
  void create_master();
  // main_grad = 0. A pending delayed wgrad would be lost: PACKMOE_CHECK error.
  void zero_grad();
  // After an optimizer step: master -> BF16 (RNE) -> the primary weight (one quantize call for a
  // low-precision primary; the BF16 param itself for a high-precision one). Needs the master and
  // no pending wgrad.
  void requantize_from_master();
  // Called by forward: a high-precision primary under a quantized recipe is quantized for compute
  // (one call over the pack); otherwise nothing to do.
  void prepare_compute();

  // Per-expert operands of the grouped GEMM (table in backend/grouped_gemm.h). Need current
  // compute copies. The pointers stay valid until the next requantize_from_master / prepare_compute.
  GemmOperand fprop_weight() const;  // W rowwise
  GemmOperand dgrad_weight() const;  // W columnwise

  const GroupedStorage& init() const { return init_; }    // (E, N, K) F32, until create_master
  const GroupedStorage& master() const;                  // (E, N, K) F32, after create_master
  GroupedStorage& master();
  const GroupedStorage& main_grad() const { return main_grad_; }  // (E, N, K) F32
  // The primary weight's components (the BF16 param, or the quantized copies of a low-precision
  // primary) plus a high-precision primary's compute copies while they are current; for byte
  // comparisons and checkpoints.
  std::vector<NamedStorage> weight_components() const;

 private:
  friend class GroupedLinear;  // the only writer of main_grad and producer of delayed wgrads
  void mark_wgrad_pending();
  void mark_wgrad_settled();

  bool quantized() const { return recipe_.recipe != Recipe::kBF16; }
  bool keeps_bf16() const { return !quantized() || primary_ == PrimaryWeight::kHighPrecision; }
  void write_primary_from(const GroupedStorage& f32);  // (E, N, K) F32 -> primary weight
  void quantize_weight(const GroupedStorage& bf16);    // (E, N, K) BF16 -> quant_, one call

  Backend* backend_;
  QuantRecipe recipe_;
  PrimaryWeight primary_;
  Layout layout_;
  int64_t e_, n_, k_;
  MasterState master_state_ = MasterState::kInitHeld;
  GradState grad_state_ = GradState::kSettled;
  ComputeCopyState compute_state_ = ComputeCopyState::kStale;

  GroupedStorage init_;       // (E, N, K) F32, host or device
  GroupedStorage master_;     // (E, N, K) F32
  GroupedStorage main_grad_;  // (E, N, K) F32
  GroupedStorage bf16_;       // (E, N, K) BF16 param (bf16 recipe or high-precision primary)
  QuantizedWeight quant_;     // primary (low precision) or compute copies (high precision)
};

// ---- Elementwise ops on grouped storage --------------------------------------------------------
// Adapters from GroupedStorage to the backend's segment-list ops (backend/elementwise.h): one call
// over all E groups, whichever the layout. Both operands must live in the same backend's memory.

// The groups of `s` as a segment list of T elements (bytes_per_group / sizeof(T) each).
template <typename T>
Segments<T> segments(const GroupedStorage& s) {
  Segments<T> out;
  out.n = static_cast<int64_t>(s.bytes_per_group() / sizeof(T));
  for (void* p : s.ptrs()) out.ptr.push_back(static_cast<T*>(p));
  return out;
}

// dst = bf16(src) (RNE); src (G, n) F32, dst (G, n) BF16.
void cast_f32_to_bf16(const GroupedStorage& src, const GroupedStorage& dst);
// dst += src, (G, n) F32 each.
void add_f32(const GroupedStorage& dst, const GroupedStorage& src);
// PACKMOE_CHECK that an op the layer issued with checked shapes succeeded.
void check_op(const Status& s, const char* what);

}  // namespace packmoe
