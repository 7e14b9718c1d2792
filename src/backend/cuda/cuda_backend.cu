// CUDA backend: memory, copies, timing and op dispatch on one stream of one device.
// Invariant: everything this backend queues goes to stream_, so stream order alone makes buffer
// reuse (workspace, uploaded group tables, pool allocations) safe; the host waits only in copy-to-host,
// synchronize, time_ms and when a staging slot is recycled.
#include <algorithm>
#include <cstring>

#include "backend/cuda/cuda_backend.h"

namespace packmoe {

CudaBackend::CudaBackend(int device) : device_(device) {
  PACKMOE_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  PACKMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  sm_count_ = prop.multiProcessorCount;
  name_ = "cuda:" + std::to_string(device_) + " (" + prop.name + ")";
  // A non-blocking stream: nothing else in the process (legacy default stream users) can
  // serialise with it implicitly.
  PACKMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cudaMemPool_t pool = nullptr;
  PACKMOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  uint64_t keep_all = UINT64_MAX;
  PACKMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  slots_.resize(kUploadSlots);
  for (UploadSlot& s : slots_) {
    PACKMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
  }
}

// The process-wide instance is never destroyed (see cuda_backend_instance), so this runs only for
// explicitly constructed backends; errors are ignored because the runtime may be shutting down.
CudaBackend::~CudaBackend() {
  for (UploadSlot& s : slots_)
    if (s.device) cudaFreeAsync(s.device, stream_);  // stream-ordered allocations
  cudaStreamSynchronize(stream_);
  for (UploadSlot& s : slots_) {
    if (s.host) cudaFreeHost(s.host);
    if (s.copied) cudaEventDestroy(s.copied);
  }
  if (workspace_) cudaFree(workspace_);
  cudaStreamDestroy(stream_);
}

// Stream-ordered allocation from the device's memory pool: freed blocks are reused by later work
// on stream_ without a device synchronisation (cudaFree would wait for the whole device), and the
// pool keeps its memory (release threshold: unlimited) so steady-state steps allocate nothing new.
void* CudaBackend::allocate(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return nullptr;
  cudaError_t err = cudaMallocAsync(&p, bytes, stream_);
  PACKMOE_CHECK(err == cudaSuccess, "cudaMallocAsync of " << bytes << " bytes on " << name_
                                                          << ": " << cudaGetErrorString(err));
  return p;
}

void CudaBackend::deallocate(void* ptr) {
  if (!ptr) return;
  cudaError_t err = cudaFreeAsync(ptr, stream_);
  // Tensors held by static objects may be freed after the runtime has unloaded at exit.
  if (err == cudaErrorCudartUnloading) return;
  PACKMOE_CUDA_CHECK(err);
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return;
  cudaMemcpyKind k = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                     : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                                       : cudaMemcpyDeviceToDevice;
  PACKMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, stream_));
  // Host memory must be reusable (H2D) or readable (D2H) when copy returns; D2D stays ordered.
  if (kind != CopyKind::kDeviceToDevice) PACKMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) PACKMOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
}

void CudaBackend::synchronize() { PACKMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

double CudaBackend::time_ms(const std::function<void()>& body, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) body();
  if (iters <= 0) {
    synchronize();
    return 0.0;
  }
  // One event pair per iteration, read after a single sync: no host round trip between runs.
  std::vector<cudaEvent_t> start(iters), stop(iters);
  for (int i = 0; i < iters; ++i) {
    PACKMOE_CUDA_CHECK(cudaEventCreate(&start[i]));
    PACKMOE_CUDA_CHECK(cudaEventCreate(&stop[i]));
  }
  for (int i = 0; i < iters; ++i) {
    PACKMOE_CUDA_CHECK(cudaEventRecord(start[i], stream_));
    body();
    PACKMOE_CUDA_CHECK(cudaEventRecord(stop[i], stream_));
  }
  synchronize();
  std::vector<double> ms(iters);
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    PACKMOE_CUDA_CHECK(cudaEventElapsedTime(&t, start[i], stop[i]));
    ms[i] = t;
    PACKMOE_CUDA_CHECK(cudaEventDestroy(start[i]));
    PACKMOE_CUDA_CHECK(cudaEventDestroy(stop[i]));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

const void* CudaBackend::upload(const void* host, size_t bytes) {
  UploadSlot& s = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kUploadSlots;
  // The previous copy out of this pinned buffer must be done before we overwrite it. With 32
  // slots this only waits when 32 uploads are still queued.
  PACKMOE_CUDA_CHECK(cudaEventSynchronize(s.copied));
  if (s.capacity < bytes) {
    // Rare: slots start at kUploadSlotBytes (the tables of a few hundred groups) and double. The
    // old pinned buffer is no longer read (its copy is done); the old device buffer may still be
    // read by queued kernels, so it is freed in stream order: no device synchronisation.
    size_t cap = std::max(s.capacity * 2, kUploadSlotBytes);
    while (cap < bytes) cap *= 2;
    if (s.host) PACKMOE_CUDA_CHECK(cudaFreeHost(s.host));
    if (s.device) PACKMOE_CUDA_CHECK(cudaFreeAsync(s.device, stream_));
    PACKMOE_CUDA_CHECK(cudaMallocHost(&s.host, cap));
    PACKMOE_CUDA_CHECK(cudaMallocAsync(&s.device, cap, stream_));
    s.capacity = cap;
  }
  std::memcpy(s.host, host, bytes);
  PACKMOE_CUDA_CHECK(cudaMemcpyAsync(s.device, s.host, bytes, cudaMemcpyHostToDevice, stream_));
  PACKMOE_CUDA_CHECK(cudaEventRecord(s.copied, stream_));
  return s.device;
}

void* CudaBackend::workspace(size_t bytes) {
  if (bytes > workspace_bytes_) {
    synchronize();  // queued kernels may still use the old buffer
    if (workspace_) PACKMOE_CUDA_CHECK(cudaFree(workspace_));
    size_t cap = std::max<size_t>(bytes, 1 << 16);
    PACKMOE_CUDA_CHECK(cudaMalloc(&workspace_, cap));
    workspace_bytes_ = cap;
  }
  return workspace_;
}

Status CudaBackend::quantize_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg,
                                   const Mxfp8Outputs& out) {
  return quantize_mxfp8_sm90(*this, in, cfg, out);
}

Status CudaBackend::dequantize_mxfp8(const Mxfp8Copy& q, DType out_dtype,
                                     const std::vector<void*>& out) {
  return dequantize_mxfp8_sm90(*this, q, out_dtype, out);
}

Status CudaBackend::quantize_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg,
                                   const Nvfp4Outputs& out) {
  return quantize_nvfp4_sm90(*this, in, cfg, out);
}

Status CudaBackend::dequantize_nvfp4(const Nvfp4Copy& q, DType out_dtype,
                                     const std::vector<void*>& out) {
  return dequantize_nvfp4_sm90(*this, q, out_dtype, out);
}

Status CudaBackend::swizzle_scales(const void* compact, int64_t rows, int64_t cols, bool transpose,
                                   void* swizzled) {
  return swizzle_scales_sm90(*this, compact, rows, cols, transpose, swizzled);
}

Status CudaBackend::grouped_gemm(const GroupedGemmArgs& args) {
  return grouped_gemm_cuda(*this, args);
}

Status CudaBackend::embedding(const EmbeddingArgs& args) { return embedding_sm90(*this, args); }

Status CudaBackend::embedding_backward(const EmbeddingBackwardArgs& args) {
  return embedding_backward_sm90(*this, args);
}

Status CudaBackend::rms_norm(const RmsNormArgs& args) { return rms_norm_sm90(*this, args); }

Status CudaBackend::rms_norm_backward(const RmsNormBackwardArgs& args) {
  return rms_norm_backward_sm90(*this, args);
}

Status CudaBackend::rope(const RopeArgs& args) { return rope_sm90(*this, args, false); }

Status CudaBackend::rope_backward(const RopeArgs& args) { return rope_sm90(*this, args, true); }

Status CudaBackend::attention(const AttentionArgs& args) { return attention_sm90(*this, args); }

Status CudaBackend::attention_backward(const AttentionBackwardArgs& args) {
  return attention_backward_sm90(*this, args);
}

Status CudaBackend::cross_entropy(const CrossEntropyArgs& args) {
  return cross_entropy_sm90(*this, args);
}

Status CudaBackend::cross_entropy_backward(const CrossEntropyBackwardArgs& args) {
  return cross_entropy_backward_sm90(*this, args);
}

Result<Backend*> cuda_backend_instance() {
  // Decided once: the device set of a process does not change.
  static Result<Backend*> instance = []() -> Result<Backend*> {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so later calls start clean
      return Status::error(std::string("no CUDA device is visible (cudaGetDeviceCount: ") +
                           cudaGetErrorString(err) + ")");
    }
    if (count == 0) return Status::error("no CUDA device is visible (0 devices)");
    int device = 0;
    PACKMOE_CUDA_CHECK(cudaGetDevice(&device));
    // Leaked on purpose: destroying streams during static destruction races the runtime's own
    // teardown.
    return static_cast<Backend*>(new CudaBackend(device));
  }();
  return instance;
}

}  // namespace packmoe
