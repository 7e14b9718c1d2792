// A GPU timeline without Nsight Systems (the GPU machine's nsys cannot import its own captures):
// a CUPTI activity tracer that the CUDA driver loads into any unmodified program through
// CUDA_INJECTION64_PATH. It writes one line per kernel, copy and memset with the GPU's start and
// end timestamps (ns), which tools/probes/timeline_gaps.py turns into busy / idle time per
// iteration and the time per kernel.
//
// Build (by hand, on the GPU machine; the record types are CUDA 13.0's), in one line:
//   CUPTI=/usr/local/cuda/targets/x86_64-linux; g++ -shared -fPIC -O2 -I$CUPTI/include
//   -I/usr/local/cuda/include tools/probes/cuda_timeline.cpp -o /tmp/libcuda_timeline.so
//   -L$CUPTI/lib -lcupti -Wl,-rpath,$CUPTI/lib
// Run, e.g.:
//   PACKMOE_TIMELINE_OUT=moe.txt CUDA_INJECTION64_PATH=/tmp/libcuda_timeline.so
//   build-gpu/bench_moe_block --only qwen3_30b_a3b --recipes bf16 --iters 5 --warmup 2
// Lines: "K start end mangled-kernel-name", "C start end kind<copyKind> bytes<n>" (copyKind 1 =
// host to device, 2 = device to host, 8 = device to device), "S start end bytes<n>".
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

namespace {

#ifndef PACKMOE_KERNEL_RECORD
#define PACKMOE_KERNEL_RECORD CUpti_ActivityKernel10
#endif
#ifndef PACKMOE_MEMCPY_RECORD
#define PACKMOE_MEMCPY_RECORD CUpti_ActivityMemcpy6
#endif
#ifndef PACKMOE_MEMSET_RECORD
#define PACKMOE_MEMSET_RECORD CUpti_ActivityMemset4
#endif

constexpr size_t kBufferBytes = size_t{16} << 20;
FILE* out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = kBufferBytes;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const PACKMOE_KERNEL_RECORD*>(r);
      std::fprintf(out, "K %llu %llu %s\n", static_cast<unsigned long long>(k->start),
                   static_cast<unsigned long long>(k->end), k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* c = reinterpret_cast<const PACKMOE_MEMCPY_RECORD*>(r);
      std::fprintf(out, "C %llu %llu kind%d bytes%llu\n", static_cast<unsigned long long>(c->start),
                   static_cast<unsigned long long>(c->end), static_cast<int>(c->copyKind),
                   static_cast<unsigned long long>(c->bytes));
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const PACKMOE_MEMSET_RECORD*>(r);
      std::fprintf(out, "S %llu %llu bytes%llu\n", static_cast<unsigned long long>(m->start),
                   static_cast<unsigned long long>(m->end),
                   static_cast<unsigned long long>(m->bytes));
    }
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  if (out) std::fclose(out);
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection() {
  const char* path = std::getenv("PACKMOE_TIMELINE_OUT");
  out = std::fopen(path ? path : "timeline.txt", "w");
  if (!out) {
    std::fprintf(stderr, "cuda_timeline: cannot write %s\n", path ? path : "timeline.txt");
    return 0;
  }
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  std::atexit(finish);
  return 1;
}
