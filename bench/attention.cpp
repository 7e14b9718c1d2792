// Flash attention (backend/cuda/flash_attention_sm90.h) forward and backward on the shapes of the
// PyTorch peer (shared peers' torch_attention.py; docs/attention-sm90.md) plus one document-masked
// case: per shape the median ms of each over CUDA-event-timed launches and the nominal TFLOP/s.
// FLOPs count the causal pairs P = B Hq S (S + 1) / 2 (the peer's counting, also for the masked
// case): forward 4 D P, backward 10 D P (Q K^T recomputed, dO V^T, P^T dO, dS^T Q, dS K). The
// backward time includes its preprocessing kernel. Needs a CUDA build and a GPU.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if __has_include(<cuda_runtime.h>)
#include "backend/cuda/flash_attention_sm90.h"
#define PACKMOE_BENCH_CUDA 1
#endif

namespace packmoe {
namespace {

struct Options {
  int iters = 10;
  int warmup = 3;
};

#if defined(PACKMOE_BENCH_CUDA)
struct Shape {
  int64_t B, S, Hq, Hkv, D;
  int docs;  // documents per row (0: plain causal)
};

const Shape kShapes[] = {
    {16, 512, 8, 2, 64, 0},   {4, 2048, 32, 4, 128, 0}, {1, 4096, 32, 4, 128, 0},
    {1, 8192, 32, 4, 128, 0}, {1, 8192, 32, 4, 128, 8},
};

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "packmoe: error: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check_ok(const Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "packmoe: error: %s\n", s.message().c_str());
    std::exit(1);
  }
}

// BF16 bits of uniform values in [-a, a) from a counter hash.
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float a) {
  std::vector<uint16_t> h(n);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float x = (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    h[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}

template <typename T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  check_cuda(cudaMalloc(&d, h.size() * sizeof(T)), "cudaMalloc");
  check_cuda(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}
void* alloc(size_t bytes) {
  void* d = nullptr;
  check_cuda(cudaMalloc(&d, std::max<size_t>(bytes, 16)), "cudaMalloc");
  return d;
}

template <typename F>
double median_ms(F&& launch, const Options& o) {
  for (int i = 0; i < o.warmup; ++i) launch();
  check_cuda(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "event");
  check_cuda(cudaEventCreate(&b), "event");
  std::vector<float> ts;
  for (int i = 0; i < o.iters; ++i) {
    check_cuda(cudaEventRecord(a), "record");
    launch();
    check_cuda(cudaEventRecord(b), "record");
    check_cuda(cudaEventSynchronize(b), "sync");
    float ms = 0.0f;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "elapsed");
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

void run_shape(const Shape& s, const Options& o) {
  const cuda::FlashAttentionShape fs{
      s.B, s.S, s.Hq, s.Hkv, s.D, static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)))};
  const int64_t nq = s.B * s.S * s.Hq * s.D, nkv = s.B * s.S * s.Hkv * s.D;
  const float qa = 2.0f * std::pow(static_cast<float>(s.D), 0.25f) / std::sqrt(3.0f);
  uint16_t* q = upload(random_bf16(nq, 1, qa));
  uint16_t* k = upload(random_bf16(nkv, 2, qa));
  uint16_t* v = upload(random_bf16(nkv, 3, 1.0f));
  uint16_t* dout = upload(random_bf16(nq, 4, 1.0f));
  int32_t* doc = nullptr;
  if (s.docs > 0) {  // equal documents
    std::vector<int32_t> h(s.B * s.S);
    const int64_t len = (s.S + s.docs - 1) / s.docs;
    for (int64_t i = 0; i < s.B * s.S; ++i) h[i] = static_cast<int32_t>((i % s.S) / len * len);
    doc = upload(h);
  }
  auto* out = static_cast<uint16_t*>(alloc(nq * 2));
  auto* lse = static_cast<float*>(alloc(s.B * s.Hq * s.S * 4));
  auto* dq = static_cast<float*>(alloc(nq * 4));
  auto* dk = static_cast<float*>(alloc(nkv * 4));
  auto* dv = static_cast<float*>(alloc(nkv * 4));
  void* ws = alloc(cuda::flash_attention_backward_workspace_bytes(fs));
  const double fwd = median_ms(
      [&] { check_ok(cuda::flash_attention_forward_sm90(fs, q, k, v, doc, out, lse, nullptr)); },
      o);
  const double bwd = median_ms(
      [&] {
        check_ok(cuda::flash_attention_backward_sm90(fs, q, k, v, out, dout, lse, doc, dq, dk, dv,
                                                     ws, nullptr));
      },
      o);
  check_cuda(cudaGetLastError(), "kernels");
  const double pairs = static_cast<double>(s.B * s.Hq) * static_cast<double>(s.S) *
                       static_cast<double>(s.S + 1) / 2.0;
  const double d = static_cast<double>(s.D);
  std::printf("B%-3lld S%-5lld Hq%-3lld Hkv%-2lld D%-4lld docs %-2d %9.3f %9.3f %8.1f %8.1f\n",
              static_cast<long long>(s.B), static_cast<long long>(s.S),
              static_cast<long long>(s.Hq), static_cast<long long>(s.Hkv),
              static_cast<long long>(s.D), s.docs, fwd, bwd, 4.0 * d * pairs / (fwd * 1e-3) / 1e12,
              10.0 * d * pairs / (bwd * 1e-3) / 1e12);
  std::fflush(stdout);
  for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                  static_cast<void*>(dout), static_cast<void*>(doc), static_cast<void*>(out),
                  static_cast<void*>(lse), static_cast<void*>(dq), static_cast<void*>(dk),
                  static_cast<void*>(dv), ws})
    cudaFree(p);
}

int run(const Options& o) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "packmoe: error: bench_attention needs a GPU\n");
    return 1;
  }
  std::printf(
      "# bench_attention: flash attention sm90, median of %d after %d warm-up; TFLOP/s:"
      " fwd 4 D, bwd 10 D per causal pair\n",
      o.iters, o.warmup);
  std::printf("%-40s %9s %9s %8s %8s\n", "shape", "fwd_ms", "bwd_ms", "fwd_TF", "bwd_TF");
  for (const Shape& s : kShapes) run_shape(s, o);
  return 0;
}
#else
int run(const Options&) {
  std::fprintf(stderr, "packmoe: error: bench_attention needs a CUDA build\n");
  return 1;
}
#endif

}  // namespace
}  // namespace packmoe

int main(int argc, char** argv) {
  packmoe::Options o;
  CLI::App app{"packmoe flash attention benchmark"};
  app.add_option("--iters", o.iters, "timed iterations (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed warm-up iterations")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  return packmoe::run(o);
}
