// Backend helpers shared by every implementation.
#include "backend/backend.h"

namespace packmoe {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kQuantizeMxfp8: return "quantize_mxfp8";
    case Op::kDequantizeMxfp8: return "dequantize_mxfp8";
    case Op::kQuantizeNvfp4: return "quantize_nvfp4";
    case Op::kDequantizeNvfp4: return "dequantize_nvfp4";
    case Op::kSwizzleScales: return "swizzle_scales";
    case Op::kGroupedGemm: return "grouped_gemm";
    case Op::kRouterTopk: return "router_topk";
    case Op::kRouterTopkBackward: return "router_topk_backward";
    case Op::kAuxLoss: return "aux_loss";
    case Op::kAuxLossBackward: return "aux_loss_backward";
    case Op::kPermute: return "permute";
    case Op::kPermuteBackward: return "permute_backward";
    case Op::kSwiglu: return "swiglu";
    case Op::kSwigluBackward: return "swiglu_backward";
    case Op::kUnpermute: return "unpermute";
    case Op::kUnpermuteBackward: return "unpermute_backward";
    case Op::kRoutingPlan: return "routing_plan";
    case Op::kCastF32ToBF16: return "cast_f32_to_bf16";
    case Op::kAddF32: return "add_f32";
    case Op::kAdamW: return "adamw";
    case Op::kNvfp4DecodeScales: return "nvfp4_decode_scales";
    case Op::kSumSquares: return "sum_squares";
    case Op::kEmbedding: return "embedding";
    case Op::kEmbeddingBackward: return "embedding_backward";
    case Op::kRmsNorm: return "rms_norm";
    case Op::kRmsNormBackward: return "rms_norm_backward";
    case Op::kRope: return "rope";
    case Op::kRopeBackward: return "rope_backward";
    case Op::kAttention: return "attention";
    case Op::kAttentionBackward: return "attention_backward";
    case Op::kCrossEntropy: return "cross_entropy";
    case Op::kCrossEntropyBackward: return "cross_entropy_backward";
    case Op::kNvfp4Amax: return "nvfp4_amax";
    case Op::kWeight2dColumnwise: return "weight_2d_columnwise";
  }
  return "unknown";
}

Tensor Backend::to_device(const Tensor& host) {
  PACKMOE_CHECK(host.device() == Device::kCPU, "to_device expects a CPU tensor");
  Tensor t = Tensor::empty(*this, host.dtype(), host.shape());
  if (t.nbytes()) copy(t.data(), host.data(), t.nbytes(), CopyKind::kHostToDevice);
  return t;
}

Tensor Backend::to_host(const Tensor& dev, Allocator& host_alloc) {
  PACKMOE_CHECK(dev.device() == device(), "to_host expects a tensor of this backend");
  Tensor t = Tensor::empty(host_alloc, dev.dtype(), dev.shape());
  if (t.nbytes()) copy(t.data(), dev.data(), t.nbytes(), CopyKind::kDeviceToHost);
  return t;
}

}  // namespace packmoe
