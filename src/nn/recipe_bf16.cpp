// Bf16Recipe: BF16 operands, read in place.
#include "nn/recipe_bf16.h"

namespace packmoe {
namespace {

[[noreturn]] void no_copies(const char* what) {
  PACKMOE_CHECK(false, what << ": the bf16 recipe has no quantized weight copies (its GEMMs read "
                               "the BF16 param)");
  std::abort();
}

GemmOperand bf16_operand(const GroupedStorage& bf16) {
  GemmOperand o;
  o.format = OperandFormat::kBF16;
  o.data = bf16.const_ptrs();
  return o;
}

}  // namespace

void Bf16Recipe::quantize_weight(const GroupedStorage&, const float*) { no_copies("quantize_weight"); }
void Bf16Recipe::rows_amax(const GroupedMatrices&, float*) const { no_copies("rows_amax"); }
void Bf16Recipe::quantize_rows(const GroupedMatrices&, const float*,
                               const std::vector<std::vector<void*>>&) const {
  no_copies("quantize_rows");
}
void Bf16Recipe::write_packed(const std::vector<const void*>&, const float*) {
  no_copies("write_packed");
}

DispatchPayload Bf16Recipe::dispatch_payload(const Tensor&, const std::vector<int64_t>&) const {
  PACKMOE_CHECK(false, "dispatch_payload: the bf16 recipe's rows travel as they are (--dispatch-dtype "
                       "recipe needs mxfp8 or nvfp4)");
  std::abort();
}
ActivationCopies Bf16Recipe::received_input_copies(const DispatchPayload&,
                                                   const std::vector<int64_t>&) const {
  PACKMOE_CHECK(false, "received_input_copies: the bf16 recipe has no quantized payload");
  std::abort();
}

GemmOperand Bf16Recipe::fprop_weight(const GroupedStorage& bf16) const { return bf16_operand(bf16); }
GemmOperand Bf16Recipe::dgrad_weight(const GroupedStorage& bf16) const { return bf16_operand(bf16); }

ActivationCopies Bf16Recipe::activation_copies(TensorRole, const Tensor& a,
                                               const std::vector<int64_t>& m, uint64_t) const {
  ActivationCopies out;
  out.rowwise.format = out.columnwise.format = OperandFormat::kBF16;
  // The caller's tensor, kept alive until the wgrad (GroupedLinear::forward's contract: not
  // written before then); a view of memory someone else owns gets a private copy.
  void* data = a.data();
  if (a.owns_memory()) {
    out.shared = a;
  } else {
    data = out.col_memory.emplace_back(*backend_, a.nbytes()).get();
    if (a.nbytes()) backend_->copy(data, a.data(), a.nbytes(), Backend::CopyKind::kDeviceToDevice);
  }
  const std::vector<void*> rows = carve_rows(data, m, a.dim(1) * 2);
  out.columnwise.data = {rows.begin(), rows.end()};
  out.rowwise = out.columnwise;
  return out;
}

}  // namespace packmoe
