// LinearRecipe: what one precision recipe does for a grouped linear, one class per recipe
// (nn/recipe_bf16.h, nn/recipe_mxfp8.h, nn/recipe_nvfp4.h; the two quantized ones share
// QuantizedRecipe below): the weight's quantized copies it owns,
// their quantization from a BF16 pack (one launch) or a row range of it (a data-parallel shard),
// their assembly from gathered images, the GEMM operands, and the activation copies per role.
// Invariant: GroupedParam and GroupedLinear never branch on the recipe; every quantizer setting
// comes from nn/recipe.h, so both layouts and both backends quantize alike.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "backend/ops/gemm.h"
#include "core/tensor.h"
#include "formats/weight_2d.h"
#include "nn/dispatch_payload.h"
#include "nn/grouped_storage.h"
#include "nn/recipe.h"

namespace packmoe {

// The quantized copies of a packed (E, N, K) weight; the GEMM operand table in
// backend/ops/gemm.h says which GEMM reads which. The NVFP4 per-expert scalars are one (E,)
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

// One component of a primary weight as a flat image over the (E * N) rows of the pack, row-major
// like the single layout: n elements of the pack take n * bytes_num / bytes_den bytes, so rows
// [r0, r1) occupy bytes [r0 * K * num / den, r1 * K * num / den) of the image.
struct PackedComponent {
  const char* name;
  int64_t bytes_num;
  int64_t bytes_den;
};

// The copies of one activation (M, C), rows grouped by expert, that the GEMMs read. BF16: the
// activation itself serves both operands: the caller's tensor when it owns its memory (kept
// alive here, not copied), else a private copy.
struct ActivationCopies {
  GemmOperand rowwise;     // fprop X / dgrad dY (blocks along C)
  GemmOperand columnwise;  // wgrad X / dY (blocks along the tokens)
  std::vector<DeviceBuffer> row_memory;  // what only `rowwise` reads
  std::vector<DeviceBuffer> col_memory;  // what `columnwise` reads
  Tensor shared;                         // BF16: the caller's activation, read in place

  // After fprop / dgrad: only the wgrad copy is kept (as TE does).
  void release_rowwise();
};

class LinearRecipe {
 public:
  virtual ~LinearRecipe() = default;
  LinearRecipe(const LinearRecipe&) = delete;
  LinearRecipe& operator=(const LinearRecipe&) = delete;

  const QuantRecipe& config() const { return q_; }
  // False (BF16): the GEMMs read the BF16 weight itself, and the weight calls below that take
  // or make quantized copies are PACKMOE_CHECK errors.
  virtual bool quantized() const = 0;
  // Rows of one quantization block of the weight along N (MXFP8 32, NVFP4 16, BF16 1).
  virtual int64_t shard_unit_rows() const = 0;

  // ---- the weight's quantized copies, (E, N, K) ------------------------------------------------
  // bf16: E groups of (N, K) BF16 (any layout) -> every copy, one quantize launch over the pack.
  // amax: null, or (NVFP4 only) the pack's (E,) amax already taken (the optimizer's AdamW pass
  // takes it while it writes the image), which the quantizer then does not read the pack for.
  virtual void quantize_weight(const GroupedStorage& bf16, const float* amax) = 0;
  // What a low-precision gather carries per element, in image order (GroupedParam's docs).
  virtual std::vector<PackedComponent> packed_components() const = 0;
  // NVFP4: the per-expert amax must be agreed on before rows are quantized.
  virtual bool needs_global_amax() const = 0;
  // amax[g] = the amax of rows group g (an expert's rows). One launch.
  virtual void rows_amax(const GroupedMatrices& rows, float* amax) const = 0;
  // rows (BF16, groups of whole blocks) quantized exactly as the whole pack would be (NVFP4:
  // with amax[g] of each group's expert) into outputs[c][g]: component c of packed_components(),
  // group g's first row in its image. One launch.
  virtual void quantize_rows(const GroupedMatrices& rows, const float* amax,
                             const std::vector<std::vector<void*>>& outputs) const = 0;
  // The copies from whole images (+ NVFP4's (E,) amax): copies, the columnwise copy of 2D
  // weights derived in one launch.
  virtual void write_packed(const std::vector<const void*>& images, const float* amax) = 0;
  // The grouped GEMM's weight operands (backend/ops/gemm.h): the quantized copies, or (BF16)
  // the BF16 weight `bf16`.
  virtual GemmOperand fprop_weight(const GroupedStorage& bf16) const = 0;  // W rowwise
  virtual GemmOperand dgrad_weight(const GroupedStorage& bf16) const = 0;  // W columnwise
  // The allocated copies by name, in the order row_data, row_scale, col_data, col_scale, amax,
  // decode_scale (for byte comparisons and checkpoints).
  virtual std::vector<NamedStorage> components() const = 0;

  // ---- activations -----------------------------------------------------------------------------
  // a: (M, C) BF16 in the backend's memory, rows grouped by m (host counts); its rowwise and
  // columnwise copies for `role`, one quantize call. M == 0 gives operands of null pointers that
  // no GEMM reads. sr_offset: NVFP4 gradients' stochastic rounding (ignored otherwise).
  virtual ActivationCopies activation_copies(TensorRole role, const Tensor& a,
                                             const std::vector<int64_t>& m,
                                             uint64_t sr_offset) const = 0;

  // ---- an input that travels quantized (--dispatch-dtype recipe, nn/dispatch_payload.h) --------
  // a: (M, C) BF16 rows grouped by m (host counts): their kInput rowwise copy as a payload, one
  // quantize call; group g's codes and scales are those activation_copies gives group g of the
  // same rows (RNE: an input is never stochastically rounded). The BF16 recipe: PACKMOE_CHECK.
  virtual DispatchPayload dispatch_payload(const Tensor& a, const std::vector<int64_t>& m) const = 0;
  // The kInput copies of the rows a payload holds (groups m, C = the weight's K): the rowwise
  // operand the payload's values, bitwise activation_copies' rowwise operand of the rows it was
  // made from (the same codes, scales and NVFP4 decode scales); the columnwise (wgrad) copy
  // quantized from the dequantized rows, x_hat in BF16, not from the rows themselves (they never
  // arrived), so it differs from theirs by the rowwise copy's error (docs/dist.md).
  virtual ActivationCopies received_input_copies(const DispatchPayload& p,
                                                 const std::vector<int64_t>& m) const = 0;

 protected:
  LinearRecipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e, int64_t n,
               int64_t k)
      : backend_(&backend), q_(q), layout_(layout), e_(e), n_(n), k_(k) {}
  // Image `src` (E groups of dst.bytes_per_group(), group-major) into dst: one copy (single
  // layout) or one per expert.
  void fill(GroupedStorage& dst, const void* src) const;
  // An activation a (M, C) BF16 as the groups of rows m: the quantizers' input.
  static GroupedMatrices activation_rows(const Tensor& a, const std::vector<int64_t>& m);
  static std::vector<const void*> const_ptrs(const std::vector<void*>& p) {
    return {p.begin(), p.end()};
  }

  Backend* backend_;
  QuantRecipe q_;
  Layout layout_;
  int64_t e_, n_, k_;
};

// What the quantized recipes (MXFP8, NVFP4) do alike: they own the weight's copies
// (QuantizedWeight), the GEMMs read the rowwise copy in fprop and the columnwise one in dgrad
// (with NVFP4's per-expert decode scales), and a 2D weight's columnwise copy is derived from the
// rowwise images a gather brings. What differs by format (block sizes, the amax, rounding, which
// copies travel, the activation copies) stays in each recipe's class, so their overrides of the
// remaining LinearRecipe calls are declared alike but written apart.
class QuantizedRecipe : public LinearRecipe {
 public:
  bool quantized() const final { return true; }
  GemmOperand fprop_weight(const GroupedStorage& bf16) const final;  // row_data, row_scale
  GemmOperand dgrad_weight(const GroupedStorage& bf16) const final;  // col_data, col_scale
  // The allocated copies: row_data, row_scale, col_data, col_scale, then NVFP4's amax and
  // decode_scale.
  std::vector<NamedStorage> components() const final;

 protected:
  QuantizedRecipe(Backend& backend, const QuantRecipe& q, Layout layout, int64_t e, int64_t n,
                  int64_t k, OperandFormat format)
      : LinearRecipe(backend, q, layout, e, n, k), format_(format) {}
  // The pack as the weight quantizers' input: E groups of (N, K) BF16 (any layout).
  GroupedMatrices weight_rows(const GroupedStorage& bf16) const;
  // The rowwise copy from whole images {row_data, row_scale}, and the columnwise copy of a 2D
  // weight derived from it (one launch).
  void write_rowwise_and_derive_columnwise(const std::vector<const void*>& images,
                                           Tiled2dFormat format);

  QuantizedWeight w_;

 private:
  GemmOperand weight_operand(const GroupedStorage& data, const GroupedStorage& scale) const;
  OperandFormat format_;
};

// The recipe q.recipe names, for an (E, N, K) weight in `backend`'s memory and `layout` (its
// quantized copies are allocated now).
std::unique_ptr<LinearRecipe> make_linear_recipe(Backend& backend, const QuantRecipe& q,
                                                 Layout layout, int64_t e, int64_t n, int64_t k);

}  // namespace packmoe
