// Backend interface: memory, copies, synchronisation, timing and the op table. CPU is the
// reference semantics; CUDA must match it (quantizers bitwise). Pointers passed to ops address
// this backend's memory. Ops check their shapes and return a Status before touching memory.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "backend/elementwise.h"
#include "backend/grouped_gemm.h"
#include "backend/model_ops.h"
#include "backend/moe_ops.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/weight_2d.h"

namespace packmoe {

enum class Op {
  kQuantizeMxfp8,
  kDequantizeMxfp8,
  kQuantizeNvfp4,
  kDequantizeNvfp4,
  kSwizzleScales,
  kGroupedGemm,
  kRouterTopk,
  kRouterTopkBackward,
  kAuxLoss,
  kAuxLossBackward,
  kPermute,
  kPermuteBackward,
  kSwiglu,
  kSwigluBackward,
  kUnpermute,
  kUnpermuteBackward,
  kCastF32ToBF16,
  kAddF32,
  kAdamW,
  kNvfp4DecodeScales,
  kSumSquares,
  kEmbedding,
  kEmbeddingBackward,
  kRmsNorm,
  kRmsNormBackward,
  kRope,
  kRopeBackward,
  kAttention,
  kAttentionBackward,
  kCrossEntropy,
  kCrossEntropyBackward,
  kNvfp4Amax,
  kWeight2dColumnwise,
  kRoutingPlan,
};
std::string_view op_name(Op op);

class Backend : public Allocator {
 public:
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"

  // ---- memory ------------------------------------------------------------------------------
  // Copies between host memory and this backend's memory (either side may be either).
  enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
  virtual void copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // Median milliseconds of `body` over `iters` runs after `warmup` runs, measured with the
  // device's own clock (CUDA events on GPU).
  virtual double time_ms(const std::function<void()>& body, int warmup, int iters) = 0;

  // ---- op table ----------------------------------------------------------------------------
  virtual bool supports(Op op) const = 0;

  virtual Status quantize_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg,
                                const Mxfp8Outputs& out) = 0;
  virtual Status dequantize_mxfp8(const Mxfp8Copy& q, DType out_dtype,
                                  const std::vector<void*>& out) = 0;
  virtual Status quantize_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg,
                                const Nvfp4Outputs& out) = 0;
  virtual Status dequantize_nvfp4(const Nvfp4Copy& q, DType out_dtype,
                                  const std::vector<void*>& out) = 0;
  // amax (G,) = each group's NaN-ignoring amax (formats/nvfp4.h nvfp4_amax_cpu).
  virtual Status nvfp4_amax(const GroupedMatrices& in, float* amax) = 0;
  // The columnwise copy of 2D-scaled weights from their rowwise copy (formats/weight_2d.h).
  virtual Status weight_2d_columnwise(const Weight2dCopies& w) = 0;
  // Compact (rows, cols) scales -> swizzled (formats/swizzle.h); `transpose` swizzles S^T.
  virtual Status swizzle_scales(const void* compact, int64_t rows, int64_t cols, bool transpose,
                                void* swizzled) = 0;

  // Grouped GEMM (backend/grouped_gemm.h): fprop / dgrad / wgrad over G groups.
  virtual Status grouped_gemm(const GroupedGemmArgs& args) = 0;

  // MoE block ops (backend/moe_ops.h): exact FP32 arithmetic, the same bits on every backend.
  virtual Status router_topk(const RouterTopkArgs& args) = 0;
  virtual Status router_topk_backward(const RouterTopkBackwardArgs& args) = 0;
  virtual Status aux_loss(const AuxLossArgs& args) = 0;
  virtual Status aux_loss_backward(const AuxLossBackwardArgs& args) = 0;
  virtual Status permute(const PermuteArgs& args) = 0;
  virtual Status permute_backward(const PermuteBackwardArgs& args) = 0;
  virtual Status swiglu(const SwigluArgs& args) = 0;
  virtual Status swiglu_backward(const SwigluBackwardArgs& args) = 0;
  virtual Status unpermute(const UnpermuteArgs& args) = 0;
  virtual Status unpermute_backward(const UnpermuteBackwardArgs& args) = 0;
  virtual Status routing_plan(const RoutingPlanArgs& args) = 0;

  // Elementwise ops over segment lists (backend/elementwise.h).
  virtual Status cast_f32_to_bf16(const Segments<const float>& src,
                                  const Segments<uint16_t>& dst) = 0;
  virtual Status add_f32(const Segments<float>& dst, const Segments<const float>& src) = 0;
  virtual Status adamw(const AdamWArgs& args) = 0;
  virtual Status nvfp4_decode_scales(const float* amax, float* decode, int64_t groups) = 0;
  // out[0] (this backend's memory) = sum of x^2 in the order of elementwise.h's sum_squares.
  virtual Status sum_squares(const Segments<const float>& x, double* out) = 0;

  // Dense decoder ops (backend/model_ops.h): exact FP32 arithmetic, the same bits on every
  // backend. ids / targets are range-checked on the host side of the call where the backend
  // can (CPU) and by the kernel otherwise (CUDA returns the error Status after a sync).
  virtual Status embedding(const EmbeddingArgs& args) = 0;
  virtual Status embedding_backward(const EmbeddingBackwardArgs& args) = 0;
  virtual Status rms_norm(const RmsNormArgs& args) = 0;
  virtual Status rms_norm_backward(const RmsNormBackwardArgs& args) = 0;
  virtual Status rope(const RopeArgs& args) = 0;
  virtual Status rope_backward(const RopeArgs& args) = 0;  // in = dout, out = din
  virtual Status attention(const AttentionArgs& args) = 0;
  virtual Status attention_backward(const AttentionBackwardArgs& args) = 0;
  virtual Status cross_entropy(const CrossEntropyArgs& args) = 0;
  virtual Status cross_entropy_backward(const CrossEntropyBackwardArgs& args) = 0;

  // ---- helpers over the primitives above ---------------------------------------------------
  Tensor to_device(const Tensor& host);  // copy of a CPU tensor into this backend's memory
  Tensor to_host(const Tensor& dev, Allocator& host_alloc);
};

// The process-wide backend of a device. CUDA returns an error Status when the build has no CUDA
// backend or no GPU is visible.
Result<Backend*> get_backend(Device device);
Backend& cpu_backend();
bool cuda_available();

}  // namespace packmoe
