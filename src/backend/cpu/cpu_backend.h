// CPU backend: host memory and the reference implementation of every op (formats/ *_cpu).
#pragma once

#include "backend/backend.h"

namespace packmoe {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr) override;
  std::string name() const override { return "cpu"; }

  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}
  double time_ms(const std::function<void()>& body, int warmup, int iters) override;

  bool supports(Op op) const override { return true; }
  Status quantize_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg,
                        const Mxfp8Outputs& out) override;
  Status dequantize_mxfp8(const Mxfp8Copy& q, DType out_dtype,
                          const std::vector<void*>& out) override;
  Status quantize_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg,
                        const Nvfp4Outputs& out) override;
  Status dequantize_nvfp4(const Nvfp4Copy& q, DType out_dtype,
                          const std::vector<void*>& out) override;
  Status nvfp4_amax(const GroupedMatrices& in, float* amax) override;
  Status weight_2d_columnwise(const Weight2dCopies& w) override;
  Status swizzle_scales(const void* compact, int64_t rows, int64_t cols, bool transpose,
                        void* swizzled) override;
  Status grouped_gemm(const GroupedGemmArgs& args) override;
  Status router_topk(const RouterTopkArgs& args) override;
  Status router_topk_backward(const RouterTopkBackwardArgs& args) override;
  Status aux_loss(const AuxLossArgs& args) override;
  Status aux_loss_backward(const AuxLossBackwardArgs& args) override;
  Status permute(const PermuteArgs& args) override;
  Status permute_backward(const PermuteBackwardArgs& args) override;
  Status swiglu(const SwigluArgs& args) override;
  Status swiglu_backward(const SwigluBackwardArgs& args) override;
  Status unpermute(const UnpermuteArgs& args) override;
  Status unpermute_backward(const UnpermuteBackwardArgs& args) override;
  Status routing_plan(const RoutingPlanArgs& args) override;
  Status cast_f32_to_bf16(const Segments<const float>& src, const Segments<uint16_t>& dst) override;
  Status add_f32(const Segments<float>& dst, const Segments<const float>& src) override;
  Status adamw(const AdamWArgs& args) override;
  Status nvfp4_decode_scales(const float* amax, float* decode, int64_t groups) override;
  Status sum_squares(const Segments<const float>& x, double* out) override;
  Status embedding(const EmbeddingArgs& args) override;
  Status embedding_backward(const EmbeddingBackwardArgs& args) override;
  Status rms_norm(const RmsNormArgs& args) override;
  Status rms_norm_backward(const RmsNormBackwardArgs& args) override;
  Status rope(const RopeArgs& args) override;
  Status rope_backward(const RopeArgs& args) override;
  Status attention(const AttentionArgs& args) override;
  Status attention_backward(const AttentionBackwardArgs& args) override;
  Status cross_entropy(const CrossEntropyArgs& args) override;
  Status cross_entropy_backward(const CrossEntropyBackwardArgs& args) override;
};

// CPU reference of the grouped GEMM (backend/cpu/grouped_gemm_cpu.cpp): dequantize tile by tile
// to FP32, multiply with OpenBLAS.
Status grouped_gemm_cpu(const GroupedGemmArgs& args);

}  // namespace packmoe
