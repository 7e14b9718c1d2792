// The CUDA backend's op table: one row per op, each the *_sm90 implementation (declared in
// cuda_backend.h) of the op whose arguments the entry (backend/ops/*.cpp) has checked.
#include "backend/cuda/cuda_backend.h"

namespace packmoe {
namespace {

CudaBackend& cuda(Backend& b) { return static_cast<CudaBackend&>(b); }

const QuantizeKernels kQuantize{
    [](Backend& b, const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out) {
      return quantize_mxfp8_sm90(cuda(b), in, cfg, out);
    },
    [](Backend& b, const Mxfp8Copy& q, DType t, const std::vector<void*>& out) {
      return dequantize_mxfp8_sm90(cuda(b), q, t, out);
    },
    [](Backend& b, const GroupedMatrices& in, const Nvfp4Config& cfg, const Nvfp4Outputs& out) {
      return quantize_nvfp4_sm90(cuda(b), in, cfg, out);
    },
    [](Backend& b, const Nvfp4Copy& q, DType t, const std::vector<void*>& out) {
      return dequantize_nvfp4_sm90(cuda(b), q, t, out);
    },
    [](Backend& b, const GroupedMatrices& in, float* amax) {
      return nvfp4_amax_sm90(cuda(b), in, amax);
    },
    [](Backend& b, const Weight2dCopies& w) { return weight_2d_columnwise_sm90(cuda(b), w); },
    [](Backend& b, const void* compact, int64_t rows, int64_t cols, bool transpose, void* out) {
      return swizzle_scales_sm90(cuda(b), compact, rows, cols, transpose, out);
    },
};

const GemmKernels kGemm{
    [](Backend& b, const GroupedGemmArgs& a) { return grouped_gemm_cuda(cuda(b), a); },
};

const MoeKernels kMoe{
    [](Backend& b, const RouterTopkArgs& a) { return router_topk_sm90(cuda(b), a); },
    [](Backend& b, const RouterTopkBackwardArgs& a) {
      return router_topk_backward_sm90(cuda(b), a);
    },
    [](Backend& b, const AuxLossStatsArgs& a) { return aux_loss_stats_sm90(cuda(b), a); },
    [](Backend& b, const AuxLossArgs& a) { return aux_loss_sm90(cuda(b), a); },
    [](Backend& b, const AuxLossBackwardArgs& a) { return aux_loss_backward_sm90(cuda(b), a); },
    [](Backend& b, const PermuteArgs& a) { return permute_sm90(cuda(b), a); },
    [](Backend& b, const PermuteBackwardArgs& a) { return permute_backward_sm90(cuda(b), a); },
    [](Backend& b, const SwigluArgs& a) { return swiglu_sm90(cuda(b), a); },
    [](Backend& b, const SwigluBackwardArgs& a) { return swiglu_backward_sm90(cuda(b), a); },
    [](Backend& b, const UnpermuteArgs& a) { return unpermute_sm90(cuda(b), a); },
    [](Backend& b, const UnpermuteBackwardArgs& a) { return unpermute_backward_sm90(cuda(b), a); },
    [](Backend& b, const RoutingPlanArgs& a) { return routing_plan_sm90(cuda(b), a); },
};

const ElementwiseKernels kElementwise{
    [](Backend& b, const Segments<const float>& src, const Segments<uint16_t>& dst) {
      return cast_f32_to_bf16_sm90(cuda(b), src, dst);
    },
    [](Backend& b, const Segments<float>& dst, const Segments<const float>& src) {
      return add_f32_sm90(cuda(b), dst, src);
    },
    [](Backend& be, const Segments<const float>& a, const Segments<const float>& b,
       const Segments<float>& out) { return add_f32_out_sm90(cuda(be), a, b, out); },
    [](Backend& b, const AdamWArgs& a) { return adamw_sm90(cuda(b), a); },
    [](Backend& b, const float* amax, float* decode, int64_t groups) {
      return nvfp4_decode_scales_sm90(cuda(b), amax, decode, groups);
    },
    [](Backend& b, const Segments<const float>& x, double* out) {
      return sum_squares_sm90(cuda(b), x, out);
    },
};

const ModelKernels kModel{
    [](Backend& b, const EmbeddingArgs& a) { return embedding_sm90(cuda(b), a); },
    [](Backend& b, const EmbeddingBackwardArgs& a) { return embedding_backward_sm90(cuda(b), a); },
    [](Backend& b, const RmsNormArgs& a) { return rms_norm_sm90(cuda(b), a); },
    [](Backend& b, const RmsNormBackwardArgs& a) { return rms_norm_backward_sm90(cuda(b), a); },
    [](Backend& b, const RopeArgs& a) { return rope_sm90(cuda(b), a, /*inverse=*/false); },
    [](Backend& b, const RopeArgs& a) { return rope_sm90(cuda(b), a, /*inverse=*/true); },
    [](Backend& b, const AttentionArgs& a) { return attention_sm90(cuda(b), a); },
    [](Backend& b, const AttentionBackwardArgs& a) { return attention_backward_sm90(cuda(b), a); },
    [](Backend& b, const CrossEntropyArgs& a) { return cross_entropy_sm90(cuda(b), a); },
    [](Backend& b, const CrossEntropyMeanArgs& a) { return cross_entropy_mean_sm90(cuda(b), a); },
    [](Backend& b, const AttentionKvArgs& a) { return attention_kv_sm90(cuda(b), a); },
};

const InitKernels kInit{
    [](Backend& b, const InitNormalArgs& a) { return init_normal_sm90(cuda(b), a); },
    [](Backend& b, const FillArgs& a) { return fill_f32_sm90(cuda(b), a); },
};

const OpKernels kCudaKernels{&kQuantize, &kGemm, &kMoe, &kElementwise, &kModel, &kInit};

}  // namespace

const OpKernels& CudaBackend::kernels() const { return kCudaKernels; }

}  // namespace packmoe
