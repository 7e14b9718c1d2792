// CUDA backend: memory, copies, timing and op dispatch on one stream of one device.
// Invariant: everything this backend queues goes to stream_, so stream order alone makes buffer
// reuse (workspace, uploaded group tables, pool allocations) safe; the host waits only in copy-to-host,
// large host-to-device copies, synchronize, time_ms and when a staging slot is recycled.
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
  if (kind == CopyKind::kHostToDevice && bytes <= kStagedCopyBytes) {
    // `src` is reusable at once: its bytes are in a pinned slot, copied in stream order.
    UploadSlot& s = stage(src, bytes);
    PACKMOE_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, stream_));
    PACKMOE_CUDA_CHECK(cudaEventRecord(s.copied, stream_));
    return;
  }
  PACKMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, stream_));
  // Host memory must be reusable (H2D) or readable (D2H) when copy returns; D2D stays ordered.
  if (kind != CopyKind::kDeviceToDevice) PACKMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) PACKMOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
}

void CudaBackend::synchronize() { PACKMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

std::optional<Backend::MemoryUse> CudaBackend::memory_use() const {
  cudaMemPool_t pool = nullptr;
  PACKMOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  uint64_t used = 0, reserved = 0, reserved_high = 0;
  PACKMOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
  PACKMOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  PACKMOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_high));
  return MemoryUse{used, reserved, reserved_high};
}

// The pool keeps every block it ever held (release threshold: unlimited); a block freed at start-up
// is reused only by a later allocation that fits in it. Trimming returns the whole free chunks.
void CudaBackend::release_unused_memory() {
  synchronize();  // stream-ordered frees complete first
  cudaMemPool_t pool = nullptr;
  PACKMOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  PACKMOE_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
}

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

// Slot capacities start at kUploadSlotBytes and double. A grown slot's old pinned buffer is no
// longer read (its copy is done); its old device buffer may still be read by queued kernels, so it
// is freed in stream order: no device synchronisation.
CudaBackend::UploadSlot& CudaBackend::stage(const void* host, size_t bytes) {
  UploadSlot& s = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kUploadSlots;
  // The previous copy out of this pinned buffer must be done before we overwrite it. With 32
  // slots this only waits when 32 uploads are still queued.
  PACKMOE_CUDA_CHECK(cudaEventSynchronize(s.copied));
  if (s.host_capacity < bytes) {
    size_t cap = std::max(s.host_capacity * 2, kUploadSlotBytes);
    while (cap < bytes) cap *= 2;
    if (s.host) PACKMOE_CUDA_CHECK(cudaFreeHost(s.host));
    PACKMOE_CUDA_CHECK(cudaMallocHost(&s.host, cap));
    s.host_capacity = cap;
  }
  std::memcpy(s.host, host, bytes);
  return s;
}

const void* CudaBackend::upload(const void* host, size_t bytes) {
  UploadSlot& s = stage(host, bytes);
  if (s.device_capacity < bytes) {
    if (s.device) PACKMOE_CUDA_CHECK(cudaFreeAsync(s.device, stream_));
    PACKMOE_CUDA_CHECK(cudaMallocAsync(&s.device, s.host_capacity, stream_));
    s.device_capacity = s.host_capacity;
  }
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
