// CUDA backend: device memory, one stream for every copy, op and timing, and the op table
// (cuda_kernels.cu) whose kernels live in *_sm90.cu beside this file. Invariant: quantizers write the same bytes as the CPU
// reference (formats/*.cpp). Only backend/cuda includes this header (it pulls in the CUDA runtime).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

// Every CUDA API error after the device was found is a programmer or system error.
#define PACKMOE_CUDA_CHECK(expr)                                               \
  do {                                                                         \
    cudaError_t packmoe_cuda_err_ = (expr);                                    \
    PACKMOE_CHECK(packmoe_cuda_err_ == cudaSuccess,                            \
                  #expr << ": " << cudaGetErrorName(packmoe_cuda_err_) << ": " \
                        << cudaGetErrorString(packmoe_cuda_err_));             \
  } while (0)

// After a kernel launch: configuration errors surface here, execution errors at the next sync.
#define PACKMOE_CUDA_CHECK_LAUNCH() PACKMOE_CUDA_CHECK(cudaGetLastError())

namespace packmoe {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::kCUDA; }
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr) override;
  std::string name() const override { return name_; }

  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override;
  std::optional<MemoryUse> memory_use() const override;
  void release_unused_memory() override;
  double time_ms(const std::function<void()>& body, int warmup, int iters) override;

  const OpKernels& kernels() const override;  // backend/cuda/cuda_kernels.cu

  // ---- for the kernel files -----------------------------------------------------------------
  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_; }
  int sm_count() const { return sm_count_; }

  // Copies `bytes` of host memory (e.g. a group table) to device memory that stays valid for the
  // ops queued on stream() after this call; one async copy from a pinned staging slot. Slots are
  // recycled round-robin, each guarded by an event, so back-to-back launches never wait on the GPU.
  const void* upload(const void* host, size_t bytes);

  // Device scratch of at least `bytes`, valid until the next workspace() call (stream order makes
  // reuse safe). Growing it synchronizes the stream.
  void* workspace(size_t bytes);

 private:
  struct UploadSlot {
    void* host = nullptr;  // pinned
    void* device = nullptr;
    size_t host_capacity = 0, device_capacity = 0;
    cudaEvent_t copied = nullptr;  // recorded after the copy out of `host`
  };
  // The next slot, its last copy done, holding `bytes` of `host` in its pinned buffer.
  UploadSlot& stage(const void* host, size_t bytes);

  static constexpr int kUploadSlots = 32;
  static constexpr size_t kUploadSlotBytes = size_t{64} << 10;  // a slot's first capacity
  // Host-to-device copies up to this size go through a pinned slot without a host wait (a batch's
  // ids and targets, a RoPE table); larger ones (weights at start-up) copy directly and wait.
  static constexpr size_t kStagedCopyBytes = size_t{8} << 20;

  int device_ = 0;
  int sm_count_ = 0;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  std::vector<UploadSlot> slots_;
  int next_slot_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// The process-wide backend of the current GPU (also reached through get_backend(Device::kCUDA)),
// or an error Status when no GPU is visible.
Result<Backend*> cuda_backend_instance();

// ---- op implementations (the rows of cuda_kernels.cu), defined in the *_sm90.cu files. Their
// arguments arrive checked by the entries of backend/ops/*.h.
Status quantize_mxfp8_sm90(CudaBackend& be, const GroupedMatrices& in, const Mxfp8Config& cfg,
                           const Mxfp8Outputs& out);
Status quantize_nvfp4_sm90(CudaBackend& be, const GroupedMatrices& in, const Nvfp4Config& cfg,
                           const Nvfp4Outputs& out);
Status dequantize_mxfp8_sm90(CudaBackend& be, const Mxfp8Copy& q, DType out_dtype,
                             const std::vector<void*>& out);
Status dequantize_nvfp4_sm90(CudaBackend& be, const Nvfp4Copy& q, DType out_dtype,
                             const std::vector<void*>& out);
Status nvfp4_amax_sm90(CudaBackend& be, const GroupedMatrices& in, float* amax);
Status weight_2d_columnwise_sm90(CudaBackend& be, const Weight2dCopies& w);

// MoE block ops (moe_ops_sm90.cu, routing_plan_sm90.cu).
Status router_topk_sm90(CudaBackend& be, const RouterTopkArgs& a);
Status router_topk_backward_sm90(CudaBackend& be, const RouterTopkBackwardArgs& a);
Status aux_loss_stats_sm90(CudaBackend& be, const AuxLossStatsArgs& a);
Status aux_loss_sm90(CudaBackend& be, const AuxLossArgs& a);
Status aux_loss_backward_sm90(CudaBackend& be, const AuxLossBackwardArgs& a);
Status permute_sm90(CudaBackend& be, const PermuteArgs& a);
Status permute_backward_sm90(CudaBackend& be, const PermuteBackwardArgs& a);
Status swiglu_sm90(CudaBackend& be, const SwigluArgs& a);
Status swiglu_backward_sm90(CudaBackend& be, const SwigluBackwardArgs& a);
Status unpermute_sm90(CudaBackend& be, const UnpermuteArgs& a);
Status unpermute_backward_sm90(CudaBackend& be, const UnpermuteBackwardArgs& a);
Status routing_plan_sm90(CudaBackend& be, const RoutingPlanArgs& a);

// Elementwise ops (elementwise_sm90.cu).
Status cast_f32_to_bf16_sm90(CudaBackend& be, const Segments<const float>& src,
                             const Segments<uint16_t>& dst);
Status add_f32_sm90(CudaBackend& be, const Segments<float>& dst, const Segments<const float>& src);
Status add_f32_out_sm90(CudaBackend& be, const Segments<const float>& a,
                        const Segments<const float>& b, const Segments<float>& out);
Status adamw_sm90(CudaBackend& be, const AdamWArgs& a);
Status sum_squares_sm90(CudaBackend& be, const Segments<const float>& x, double* out);
Status nvfp4_decode_scales_sm90(CudaBackend& be, const float* amax, float* decode, int64_t groups);
Status swizzle_scales_sm90(CudaBackend& be, const void* compact, int64_t rows, int64_t cols,
                           bool transpose, void* swizzled);
// Init ops (init_sm90.cu).
Status init_normal_sm90(CudaBackend& be, const InitNormalArgs& a);
Status fill_f32_sm90(CudaBackend& be, const FillArgs& a);
// Grouped GEMM entry point (grouped_gemm_cuda.cu): operands dequantized exactly to BF16, then
// the sm_90a wgmma kernel over all groups in one launch, or cuBLASLt per group (choose_path).
Status grouped_gemm_cuda(CudaBackend& be, const GroupedGemmArgs& args);

// The E4M3/E5M2 conversion the MXFP8 kernels use (hardware cvt.rn.satfinite) is bitwise equal to
// the shared software codec over all FP32 inputs on this device (selftest.cu). Checked once per
// process and element type; kernels fall back to the software codec if it ever is not, after one
// warning line on stderr.
bool cuda_fp8_hw_conversion_ok(CudaBackend& be, DType element);

// The E2M1 encoders of kernels_common.cuh (e2m1_rn_fast, e2m1_sr_fast) agree with f32_to_e2m1 /
// f32_to_e2m1_sr on this device (selftest.cu), and the hardware E4M3 cvt with f32_to_e4m3. Checked
// once per process; the NVFP4 kernels fall back to the shared codecs, after one warning line on
// stderr, if not.
bool cuda_nvfp4_fast_codecs_ok(CudaBackend& be);

// The branch-free E8M0 scale code and reciprocal of kernels_common.cuh agree with
// mxfp8_scale_code / e8m0_reciprocal for every amax >= 0 (never NaN) and both FP8 elements.
// Checked once per process; the MXFP8 kernels fall back to the shared functions (with a warning
// line on stderr) if not.
bool cuda_mxfp8_fast_scale_ok(CudaBackend& be);

// Dense decoder ops (model_ops_sm90.cu): the CPU reference's bytes. Embedding ids and
// cross-entropy targets are range-checked by a kernel whose flag is read back (one stream sync per
// call) before any output is written. Attention (attention_sm90.cu): the tensor-core kernels of
// flash_attention_sm90.h, deterministic and batch-invariant, not the CPU's bytes.
Status embedding_sm90(CudaBackend& be, const EmbeddingArgs& a);
Status embedding_backward_sm90(CudaBackend& be, const EmbeddingBackwardArgs& a);
Status rms_norm_sm90(CudaBackend& be, const RmsNormArgs& a);
Status rms_norm_backward_sm90(CudaBackend& be, const RmsNormBackwardArgs& a);
Status rope_sm90(CudaBackend& be, const RopeArgs& a, bool inverse);  // inverse: the backward
Status attention_sm90(CudaBackend& be, const AttentionArgs& a);
Status attention_backward_sm90(CudaBackend& be, const AttentionBackwardArgs& a);
Status cross_entropy_sm90(CudaBackend& be, const CrossEntropyArgs& a);
Status cross_entropy_mean_sm90(CudaBackend& be, const CrossEntropyMeanArgs& a);
// Attention of new queries over a KV cache (attention_kv_sm90.cu): the CPU reference's bytes.
Status attention_kv_sm90(CudaBackend& be, const AttentionKvArgs& a);

}  // namespace packmoe
