// The CPU backend's op table: one row per op, each the reference implementation (backend/cpu/*.cpp,
// formats/*.cpp) of the op whose arguments the entry (backend/ops/*.cpp) has checked.
#include "backend/cpu/cpu_backend.h"
#include "formats/swizzle.h"

namespace packmoe {
namespace {

const QuantizeKernels kQuantize{
    [](Backend&, const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out) {
      return quantize_mxfp8_cpu(in, cfg, out);
    },
    [](Backend&, const Mxfp8Copy& q, DType t, const std::vector<void*>& out) {
      return dequantize_mxfp8_cpu(q, t, out);
    },
    [](Backend&, const GroupedMatrices& in, const Nvfp4Config& cfg, const Nvfp4Outputs& out) {
      return quantize_nvfp4_cpu(in, cfg, out);
    },
    [](Backend&, const Nvfp4Copy& q, DType t, const std::vector<void*>& out) {
      return dequantize_nvfp4_cpu(q, t, out);
    },
    [](Backend&, const GroupedMatrices& in, float* amax) { return nvfp4_amax_cpu(in, amax); },
    [](Backend&, const Weight2dCopies& w) { return weight_2d_columnwise_cpu(w); },
    [](Backend&, const void* compact, int64_t rows, int64_t cols, bool transpose, void* out) {
      swizzle_scales_cpu(static_cast<const uint8_t*>(compact), rows, cols, transpose,
                         static_cast<uint8_t*>(out));
      return Status::ok();
    },
};

const GemmKernels kGemm{
    [](Backend&, const GroupedGemmArgs& a) { return grouped_gemm_cpu(a); },
};

const MoeKernels kMoe{
    [](Backend&, const RouterTopkArgs& a) { return router_topk_cpu(a); },
    [](Backend&, const RouterTopkBackwardArgs& a) { return router_topk_backward_cpu(a); },
    [](Backend&, const AuxLossStatsArgs& a) { return aux_loss_stats_cpu(a); },
    [](Backend&, const AuxLossArgs& a) { return aux_loss_cpu(a); },
    [](Backend&, const AuxLossBackwardArgs& a) { return aux_loss_backward_cpu(a); },
    [](Backend&, const PermuteArgs& a) { return permute_cpu(a); },
    [](Backend&, const PermuteBackwardArgs& a) { return permute_backward_cpu(a); },
    [](Backend&, const SwigluArgs& a) { return swiglu_cpu(a); },
    [](Backend&, const SwigluBackwardArgs& a) { return swiglu_backward_cpu(a); },
    [](Backend&, const UnpermuteArgs& a) { return unpermute_cpu(a); },
    [](Backend&, const UnpermuteBackwardArgs& a) { return unpermute_backward_cpu(a); },
    [](Backend&, const RoutingPlanArgs& a) { return routing_plan_cpu(a); },
};

const ElementwiseKernels kElementwise{
    [](Backend&, const Segments<const float>& src, const Segments<uint16_t>& dst) {
      return cast_f32_to_bf16_cpu(src, dst);
    },
    [](Backend&, const Segments<float>& dst, const Segments<const float>& src) {
      return add_f32_cpu(dst, src);
    },
    [](Backend&, const Segments<const float>& a, const Segments<const float>& b,
       const Segments<float>& out) { return add_f32_out_cpu(a, b, out); },
    [](Backend&, const AdamWArgs& a) { return adamw_cpu(a); },
    [](Backend&, const float* amax, float* decode, int64_t groups) {
      return nvfp4_decode_scales_cpu(amax, decode, groups);
    },
    [](Backend&, const Segments<const float>& x, double* out) { return sum_squares_cpu(x, out); },
};

const ModelKernels kModel{
    [](Backend&, const EmbeddingArgs& a) { return embedding_cpu(a); },
    [](Backend&, const EmbeddingBackwardArgs& a) { return embedding_backward_cpu(a); },
    [](Backend&, const RmsNormArgs& a) { return rms_norm_cpu(a); },
    [](Backend&, const RmsNormBackwardArgs& a) { return rms_norm_backward_cpu(a); },
    [](Backend&, const RopeArgs& a) { return rope_cpu(a); },
    [](Backend&, const RopeArgs& a) { return rope_backward_cpu(a); },
    [](Backend&, const AttentionArgs& a) { return attention_cpu(a); },
    [](Backend&, const AttentionBackwardArgs& a) { return attention_backward_cpu(a); },
    [](Backend&, const CrossEntropyArgs& a) { return cross_entropy_cpu(a); },
    [](Backend&, const CrossEntropyMeanArgs& a) { return cross_entropy_mean_cpu(a); },
    [](Backend&, const AttentionKvArgs& a) { return attention_kv_cpu(a); },
};

const InitKernels kInit{
    [](Backend&, const InitNormalArgs& a) { return init_normal_cpu(a); },
    [](Backend&, const FillArgs& a) { return fill_f32_cpu(a); },
};

const OpKernels kCpuKernels{&kQuantize, &kGemm, &kMoe, &kElementwise, &kModel, &kInit};

}  // namespace

const OpKernels& CpuBackend::kernels() const { return kCpuKernels; }

}  // namespace packmoe
