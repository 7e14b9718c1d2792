// Grouped GEMM on CUDA, the entry point: every operand becomes BF16 (MXFP8 and NVFP4 are
// dequantized EXACTLY, one launch per operand over all groups), then either the sm_90a wgmma kernel
// runs all groups in one launch (grouped_gemm_sm90.cu; chosen by choose_impl from the device and
// the shapes) or each group is one cuBLASLt matmul with true FP32 accumulation, all on
// be.stream(). On the sm_90a kernel the MXFP8 rowwise copies skip the pre-pass: the kernel's
// converter warps write the same BF16 values while it runs (streams). Invariant: the
// implementation and a group's algorithm are functions of (policy, op, m_g, N, K, out dtype) only,
// never of where its pointers live, so a packed (E, N, K) weight and E separate buffers give the
// same bytes. Host synchronisation: when a cached device buffer has to grow, and for `m_device`
// calls off the sm_90a path (other GPUs, GemmImpl::kCublasLt, shapes or pointers the kernel does
// not take, more than kSm90MaxDeviceGroups groups: the G counts are copied to the host). On the
// sm_90a path an m_device call never synchronises after its first run (which makes its device
// state) and can be captured in a CUDA graph ("token counts in device memory" below).
//
// The dequantize is this file's bandwidth-oriented BF16 kernel (hardware FP8 -> F16 converts,
// a persistent grid, 8 x 8 elements a thread per tile) when the copies are 16-byte aligned, else the backend's
// dequantize_mxfp8 / dequantize_nvfp4 (any alignment). Both write the same values: f32_to_bf16 of
// mxfp8_decode, or of nvfp4_decode with S_dec = 1 (NaN payloads aside); a test checks the GEMM
// results of both paths are the same bytes.
//
// Exactness of the BF16 operands (docs/gemm.md): an MXFP8 value e * 2^(s-127) has at most 4
// significant bits (E4M3; 3 for E5M2) and fits BF16 exactly unless its lowest bit falls below
// BF16's smallest subnormal 2^-133, i.e. for scale codes s < 3 (E4M3) or s < 10 (E5M2), which
// the quantizer gives only blocks with amax below ~2^-116 (E4M3) / ~2^-102 (E5M2); there the
// dequantize rounds to BF16 (RNE). An NVFP4 block value e2m1 * e4m3 has at most 6
// significant bits in [2^-10, 2688]: always exact. NVFP4's per-tensor FP32 decode scales are not
// folded into the operands but applied as alpha[g] = S_dec(lhs)[g] * S_dec(rhs)[g], computed on
// the device (no host round trip), as a native block-scaled GEMM does. cuBLASLt takes it as a
// device alpha vector (one entry per output row, all equal) with beta zero or a host beta, so an
// overwrite never reads the old output (a device-scalar beta of 0 would not promise that: where
// the vector mode has no algorithm we use it and zero the output first).
//
// Determinism. cuBLAS's own heuristic (cublasGemmEx, or cublasLt with the default preference)
// assumes up to 256-byte pointer alignment and may pick another kernel for a pointer that is only
// 16-byte aligned (a packed expert at offset g*N*K*2), which can change the FP32 summation
// order. So we call cublasLt with an algorithm chosen once per shape by the heuristic told that
// every pointer is exactly kAlignmentBytes (16) aligned, and cache it. Pointers that are not
// 16-byte aligned (possible only for BF16 operands with odd shapes) are staged through aligned
// scratch, so they too run the cached algorithm. The reduction-scheme mask allows split-K only
// with an FP32 workspace reduction (the cublasLt form of CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_
// REDUCTION); compute type CUBLAS_COMPUTE_32F (no TF32/BF16x9 "fast" modes); a fixed 32 MiB
// workspace of our own, so nothing depends on a cuBLAS-internal pool.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/grouped_gemm_sm90.h"
#include "backend/cuda/grouped_gemm_dequant.cuh"
#include "backend/cuda/kernel_policy.h"
#include "backend/ops/gemm.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

#define PACKMOE_CUBLAS_CHECK(expr)                                                    \
  do {                                                                                \
    cublasStatus_t packmoe_cublas_st_ = (expr);                                       \
    PACKMOE_CHECK(packmoe_cublas_st_ == CUBLAS_STATUS_SUCCESS,                        \
                  #expr << ": " << cublasLtGetStatusString(packmoe_cublas_st_));      \
  } while (0)

namespace packmoe {
namespace {

using namespace gemm_convert;

struct Config {
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // NVIDIA's advice for sm_90
  static constexpr uint32_t kAlignmentBytes = 16;  // the one alignment the heuristic is told
  static constexpr size_t kScratchAlign = 256;     // every scratch matrix starts here
  static constexpr size_t kGrowQuantum = size_t{2} << 20;
  static constexpr size_t kMaxPlans = 1 << 14;     // cached (shape -> algorithm) entries
  static constexpr int kDequantThreads = 256;       // fast dequantize: CTA size,
  static constexpr int kDequantUnroll = 8;          // independent loads in flight per thread,
  static constexpr int kDequantVec = 8;             // elements a lane converts per step (16 B out),
  static constexpr int kDequantCtasPerSm = 8;       // most resident CTAs per SM (persistent grid)
  static constexpr int64_t kTileElems = int64_t{kDequantThreads} * kDequantUnroll * kDequantVec;
  static_assert(kScratchAlign % kAlignmentBytes == 0, "scratch must satisfy the heuristic");
  static_assert(kMxfp8Block % kDequantVec == 0 && kNvfp4Block % kDequantVec == 0,
                "a lane's elements share one block scale");
};

// ---- small kernels ---------------------------------------------------------------------------

__global__ void fill_kernel(float* p, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}

// alpha[g * rows + i] = S_dec(lhs)[g] * S_dec(rhs)[g] for i < rows: one FP32 multiply, as the
// block-scaled GEMM's alpha, repeated over the output rows of group g (cuBLASLt's alpha vector).
__global__ void nvfp4_alpha_kernel(const float* lhs, const float* rhs, float* alpha, int groups,
                                   int rows) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<int64_t>(groups) * rows) {
    const int g = static_cast<int>(i / rows);
    alpha[i] = lhs[g] * rhs[g];
  }
}

// ---- fast dequantize to BF16 ------------------------------------------------------------------
// One persistent launch per operand (a few CTAs per SM). The operand is cut into tiles of
// Config::kTileElems elements, each within one group; tile t belongs to the group with the last
// tile_begin <= t (empty groups share tile_begin with the next one, so they are never chosen) and
// CTA b converts tiles b, b + grid, ... A lane converts kVec = 8 consecutive elements per step, so
// every warp-level store writes one contiguous 512 B span of BF16 (16 B a lane, streaming) and
// every load reads one contiguous span (8 B a lane MXFP8, 4 B NVFP4); kUnroll independent loads
// per thread are in flight before the first conversion, and the next tile's group lookup overlaps
// them. Values: the FP32 product of the exactly converted element and scale, rounded once to BF16
// (cvt.rn.bf16x2.f32, no FTZ), i.e. f32_to_bf16(mxfp8_decode(...)) /
// f32_to_bf16(nvfp4_decode(..., S_dec = 1)).

// Tile t of an operand's table belongs to the last job with begin <= t.
__device__ __forceinline__ int find_job(const DequantJob* t, int count, uint32_t tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(&t[mid].begin) <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Step u of a thread converts elements tile_start + (u * T + threadIdx.x) * 8 + [0, 8) of its
// job (grouped_gemm_dequant.cuh: one row, one block scale or 8 column codes).
template <DequantKind kKind>
__global__ void __launch_bounds__(Config::kDequantThreads)
    dequantize_to_bf16_kernel(const DequantJob* __restrict__ table, int count, uint32_t tiles) {
  constexpr int T = Config::kDequantThreads, U = Config::kDequantUnroll, V = Config::kDequantVec;
  uint32_t tile = blockIdx.x;
  if (tile >= tiles) return;
  int g = find_job(table, count, tile);
  for (;;) {
    const DequantJob job = table[g];
    const int64_t base = static_cast<int64_t>(tile - job.begin) * Config::kTileElems +
                         threadIdx.x * V;
    Raw8 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = base + u * (T * V);
      if (e < job.elems) raw[u] = load8<kKind>(job, e);
    }
    const uint32_t next = tile + gridDim.x;
    const int ng = next < tiles ? find_job(table, count, next) : g;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = base + u * (T * V);
      if (e >= job.elems) break;
      store8<true>(job.out, e, convert8<kKind>(raw[u]));
    }
    if (next >= tiles) break;
    tile = next;
    g = ng;
  }
}

// CTAs of a persistent dequantize launch: as many as fit on the device at once.
template <typename Kernel>
unsigned dequant_grid(Kernel kernel, uint64_t tiles) {
  int dev = 0, sms = 0, per_sm = 0;
  PACKMOE_CUDA_CHECK(cudaGetDevice(&dev));
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  PACKMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, Config::kDequantThreads, 0));
  per_sm = std::max(1, std::min(per_sm, Config::kDequantCtasPerSm));
  return static_cast<unsigned>(std::min<uint64_t>(tiles, static_cast<uint64_t>(sms) * per_sm));
}

// The layout of a stored copy, as the dequantize kernels and the sm_90a converter name it.
DequantKind dequant_kind(OperandFormat f, DType element, bool columnwise) {
  if (f == OperandFormat::kNvfp4) return DequantKind::kNvfp4;
  if (element == DType::kE5M2)
    return columnwise ? DequantKind::kE5m2Columnwise : DequantKind::kE5m2Rowwise;
  return columnwise ? DequantKind::kE4m3Columnwise : DequantKind::kE4m3Rowwise;
}

// The fast dequantize kernel of a stored copy (all share one signature).
using DequantKernel = void (*)(const DequantJob*, int, uint32_t);
DequantKernel dequant_kernel(DequantKind kind) {
  switch (kind) {
    case DequantKind::kE4m3Rowwise: return dequantize_to_bf16_kernel<DequantKind::kE4m3Rowwise>;
    case DequantKind::kE4m3Columnwise: return dequantize_to_bf16_kernel<DequantKind::kE4m3Columnwise>;
    case DequantKind::kE5m2Rowwise: return dequantize_to_bf16_kernel<DequantKind::kE5m2Rowwise>;
    case DequantKind::kE5m2Columnwise: return dequantize_to_bf16_kernel<DequantKind::kE5m2Columnwise>;
    case DequantKind::kNvfp4: break;
  }
  return dequantize_to_bf16_kernel<DequantKind::kNvfp4>;
}

// wgrad overwrite with device token counts: group g's (N, K) output, `vecs` 16-byte words,
// becomes +0 when m_g = 0 (the host path's memset, decided on the device). Grid (x, G).
__global__ void zero_empty_groups_kernel(const int64_t* m, void* const* out, int64_t vecs) {
  if (m[blockIdx.y] != 0) return;
  uint4* o = static_cast<uint4*>(out[blockIdx.y]);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    o[i] = make_uint4(0, 0, 0, 0);
}

// ---- per-backend state -------------------------------------------------------------------------

// A device buffer that only grows; growing waits for queued work that may still read the old one.
class GrowBuffer {
 public:
  void* get(CudaBackend& be, size_t bytes) {
    if (bytes > bytes_) {
      be.synchronize();
      if (ptr_) PACKMOE_CUDA_CHECK(cudaFree(ptr_));
      bytes_ = (bytes + Config::kGrowQuantum - 1) / Config::kGrowQuantum * Config::kGrowQuantum;
      PACKMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
      grown_ = true;
    }
    return ptr_;
  }
  // True once after each growth (the caller re-initialises the contents).
  bool take_grown() { return std::exchange(grown_, false); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool grown_ = false;
};

// The state of one m_device call signature on the sm_90a path (grouped_gemm_cublas below): its
// dequantize tables and map plan live in device memory kept for the life of the process and
// never reused by another signature (the BF16 scratch they point to is GemmState's, shared).
struct DeviceDequant {
  const DequantJob* table = nullptr;  // device, owned by the DeviceCall
  int count = 0;
  uint32_t tiles = 0;  // 0: nothing to dequantize
  unsigned grid = 0;
  DequantKernel kernel = nullptr;
};

struct DeviceCall {
  const Sm90DevicePlan* plan = nullptr;
  DeviceDequant lhs, rhs;
  void* const* zero_outs = nullptr;  // wgrad overwrite: (G,) outputs on the device
  int64_t zero_vecs = 0;             // 16-byte words per output
};

// How alpha and beta reach cuBLASLt.
enum class Scaling : int {
  kHost = 0,             // alpha = 1, beta = 0 or 1, host scalars (BF16, MXFP8)
  kVectorBetaZero = 1,   // NVFP4 overwrite: device alpha vector, beta zero (C never read)
  kVectorBetaHost = 2,   // NVFP4 accumulate: device alpha vector, host beta = 1
};

// One cuBLASLt problem in column-major terms: D (M, Nc) = op(A) (M, Kc) . op(B) (Kc, Nc);
// (transa, transb, M, Nc, Kc, lda, ldb, ldc, out is BF16, Scaling).
using PlanKey =
    std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  // The vector modes had no algorithm: device scalar alpha/beta instead, and an overwrite zeroes
  // its output first (beta = 0 from device memory may still read C).
  bool device_scalar = false;
};

class GemmState {
 public:
  explicit GemmState(CudaBackend& be) {
    PACKMOE_CUBLAS_CHECK(cublasLtCreate(&lt_));
    PACKMOE_CUDA_CHECK(cudaMalloc(&cublas_ws_, Config::kCublasWorkspaceBytes));
    PACKMOE_CUDA_CHECK(cudaMalloc(&consts_, 2 * sizeof(float)));
    const float c[2] = {0.0f, 1.0f};
    PACKMOE_CUDA_CHECK(
        cudaMemcpyAsync(consts_, c, sizeof c, cudaMemcpyHostToDevice, be.stream()));
    PACKMOE_CUDA_CHECK(cudaStreamSynchronize(be.stream()));  // `c` lives on this frame
  }
  // The state lives as long as the process-wide backend (never destroyed).

  std::mutex mu;
  GrowBuffer scratch;  // dequantized / staged operands and staged outputs
  GrowBuffer ones;     // (G,) 1.0f: NVFP4 decode scales for dequantizing e2m1 * e4m3 only
  GrowBuffer alpha;    // (G, rows of D) NVFP4 alpha vectors
  // m_device calls on the sm_90a path, by signature (device_call_key): never freed or reused.
  std::map<std::vector<uintptr_t>, DeviceCall> device_calls;
  // BF16 copies of their quantized operands: one buffer shared by every signature (their work
  // runs in stream order), replaced by a larger one when a new signature needs more; the old
  // ones stay allocated for the signatures (and captured graphs) that use them.
  uint8_t* device_scratch = nullptr;
  size_t device_scratch_bytes = 0;

  cublasLtHandle_t lt() const { return lt_; }
  void* cublas_workspace() const { return cublas_ws_; }
  const float* zero() const { return consts_; }
  const float* one() const { return consts_ + 1; }

  const Plan& plan(const PlanKey& key);

 private:
  cublasLtHandle_t lt_ = nullptr;
  void* cublas_ws_ = nullptr;
  float* consts_ = nullptr;  // {0, 1}
  std::map<PlanKey, Plan> plans_;
};

// Creates the descriptors of `key` with alpha/beta passed as `mode`; false when the heuristic has
// no algorithm for that mode.
bool make_plan(cublasLtHandle_t lt, const PlanKey& key, cublasLtPointerMode_t mode, Plan& p) {
  const auto [ta, tb, M, Nc, Kc, lda, ldb, ldc, out_bf16, scaling] = key;
  const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                                      sizeof op_a));
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                                      sizeof op_b));
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                                      &mode, sizeof mode));
  // Stored (pre-op) column-major shapes.
  PACKMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, ta ? Kc : M, ta ? M : Kc, lda));
  PACKMOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, tb ? Nc : Kc, tb ? Kc : Nc, ldb));
  PACKMOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.c, out_bf16 ? CUDA_R_16BF : CUDA_R_32F, M, Nc, ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = Config::kCublasWorkspaceBytes;
  // Split-K only with an FP32 (compute type) reduction: no partial sums rounded to BF16.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  const uint32_t align = Config::kAlignmentBytes;
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  PACKMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof reduction));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    PACKMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
    p = Plan{};
    return false;
  }
  p.algo = result.algo;
  p.workspace = result.workspaceSize;
  return true;
}

const Plan& GemmState::plan(const PlanKey& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= Config::kMaxPlans) {
    // Shapes are per expert token count; a long run with ever-new counts must not grow forever.
    for (auto& [k, p] : plans_) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatmulDescDestroy(p.desc);
    }
    plans_.clear();
  }
  const auto scaling = static_cast<Scaling>(std::get<9>(key));
  Plan p;
  bool ok = false;
  switch (scaling) {
    case Scaling::kHost: ok = make_plan(lt_, key, CUBLASLT_POINTER_MODE_HOST, p); break;
    case Scaling::kVectorBetaZero:
      ok = make_plan(lt_, key, CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO, p);
      break;
    case Scaling::kVectorBetaHost:
      ok = make_plan(lt_, key, CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST, p);
      break;
  }
  if (!ok && scaling != Scaling::kHost) {
    ok = make_plan(lt_, key, CUBLASLT_POINTER_MODE_DEVICE, p);
    p.device_scalar = true;
  }
  PACKMOE_CHECK(ok, "cuBLASLt has no algorithm for D(" << std::get<2>(key) << ", "
                                                       << std::get<3>(key) << ") = op(A) op(B), K = "
                                                       << std::get<4>(key) << ", trans "
                                                       << std::get<0>(key) << std::get<1>(key));
  return plans_.emplace(key, p).first->second;
}

GemmState& state_of(CudaBackend& be) {
  static std::mutex mu;
  static auto* states = new std::map<CudaBackend*, std::unique_ptr<GemmState>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*states)[&be];
  if (!s) s = std::make_unique<GemmState>(be);
  return *s;
}

// ---- operand geometry ------------------------------------------------------------------------

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
bool aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % Config::kAlignmentBytes) == 0;
}

// The stored copy an operand of `op` reads (table in backend/ops/gemm.h), as the row-major
// BF16 (rows, cols) matrix it dequantizes to. `transposed`: the NVFP4 columnwise copies, stored
// as the transpose of the logical matrix.
struct Stored {
  int64_t rows = 0, cols = 0;
  bool columnwise = false;  // MXFP8 columnwise scales
  bool transposed = false;
};

Stored stored_of(GemmOp op, OperandFormat f, bool is_lhs, int64_t m, int64_t n, int64_t k) {
  int64_t lr = 0, lc = 0;  // logical shape
  bool reduce_rows = false;
  switch (op) {
    case GemmOp::kFprop:
      lr = is_lhs ? m : n;  // X (m, K) | W (N, K)
      lc = k;
      break;
    case GemmOp::kDgrad:
      lr = is_lhs ? m : n;  // dY (m, N) | W (N, K)
      lc = is_lhs ? n : k;
      reduce_rows = !is_lhs;
      break;
    case GemmOp::kWgrad:
      lr = m;  // dY (m, N) | X (m, K)
      lc = is_lhs ? n : k;
      reduce_rows = true;
      break;
  }
  Stored s{lr, lc, false, false};
  if (reduce_rows && f == OperandFormat::kMxfp8) s.columnwise = true;
  if (reduce_rows && f == OperandFormat::kNvfp4) s = Stored{lc, lr, false, true};
  return s;
}

// One operand after preparation: per group a 16-byte aligned row-major BF16 matrix.
struct Prepared {
  std::vector<const void*> ptr;
  std::vector<Stored> shape;
};

// Whether the fast dequantize kernels (and the sm_90a kernel's converter) read quantized operand
// `o`: 16-byte aligned copies and, for MXFP8 columnwise scales, rows of 16 bytes.
bool fast_dequant_ok(const GemmOperand& o, const std::vector<Stored>& shape,
                     const std::vector<bool>& active) {
  for (size_t g = 0; g < shape.size(); ++g)
    if (active[g] && (!aligned(o.data[g]) ||
                      (shape[g].columnwise && (!aligned(o.scale[g]) || shape[g].cols % 16))))
      return false;
  return true;
}

// One job per group of quantized operand `o` (inactive groups: no elements), BF16 out at `out`,
// begins in tiles of Config::kTileElems; returns the tile count.
uint64_t dequant_jobs(const GemmOperand& o, const std::vector<Stored>& shape,
                      const std::vector<bool>& active, const std::vector<uint8_t*>& out,
                      std::vector<DequantJob>& jobs) {
  const DequantKind kind = dequant_kind(o.format, o.element, shape[0].columnwise);
  jobs.assign(shape.size(), DequantJob{});
  uint64_t tiles = 0;
  for (size_t g = 0; g < shape.size(); ++g) {
    DequantJob& d = jobs[g];
    d.data = static_cast<const uint8_t*>(o.data[g]);
    d.scale = static_cast<const uint8_t*>(o.scale[g]);
    d.out = out[g];
    d.begin = static_cast<uint32_t>(tiles);
    d.elems = active[g] ? shape[g].rows * shape[g].cols : 0;
    d.cols = o.format == OperandFormat::kMxfp8 ? shape[g].cols : 0;
    d.kind = kind;
    tiles += (d.elems + Config::kTileElems - 1) / Config::kTileElems;
  }
  PACKMOE_CHECK(tiles < (1ull << 31), "dequantize over " << tiles << " tiles");
  return tiles;
}

// Fills `dst` (scratch, 256-byte aligned per group) with the BF16 form of operand `o`: one
// dequantize launch for a quantized operand, per-group async copies for a BF16 operand (or a
// quantized one whose BF16 values are given, GemmOperand::bf16) with a misaligned pointer (rare:
// only odd shapes), nothing for aligned BF16 values. With `in_gemm`
// a quantized operand that the fast kernels can read is not dequantized here: its jobs go to
// *in_gemm for the sm_90a kernel's streaming converter (same values, same scratch). Validity of
// the quantized pointers was checked by validate_grouped_gemm (non-null for active groups).
Status prepare(CudaBackend& be, GemmState& st, const GemmOperand& o,
               const std::vector<Stored>& shape, const std::vector<bool>& active, uint8_t* dst,
               const std::vector<size_t>& offset, Prepared& out,
               std::vector<DequantJob>* in_gemm) {
  const size_t G = shape.size();
  out.ptr.assign(G, nullptr);
  out.shape = shape;
  if (o.format == OperandFormat::kBF16 || !o.bf16.empty()) {  // BF16 values at hand
    const std::vector<const void*>& src = o.format == OperandFormat::kBF16 ? o.data : o.bf16;
    bool ok = true;
    for (size_t g = 0; g < G; ++g)
      if (active[g] && !aligned(src[g])) ok = false;
    for (size_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      if (ok) {
        out.ptr[g] = src[g];
      } else {
        const size_t bytes = static_cast<size_t>(shape[g].rows * shape[g].cols) * 2;
        PACKMOE_CUDA_CHECK(cudaMemcpyAsync(dst + offset[g], src[g], bytes,
                                           cudaMemcpyDeviceToDevice, be.stream()));
        out.ptr[g] = dst + offset[g];
      }
    }
    return Status::ok();
  }
  std::vector<void*> outs(G, nullptr);
  for (size_t g = 0; g < G; ++g) {
    if (!active[g]) continue;
    if (o.scale[g] == nullptr)
      return Status::error("grouped_gemm: group " + std::to_string(g) + " has no block scales");
    outs[g] = dst + offset[g];
  }
  for (size_t g = 0; g < G; ++g) out.ptr[g] = outs[g];

  if (fast_dequant_ok(o, shape, active)) {
    std::vector<uint8_t*> dst_of(G, nullptr);
    for (size_t g = 0; g < G; ++g) dst_of[g] = static_cast<uint8_t*>(outs[g]);
    std::vector<DequantJob> table;
    const uint64_t tiles = dequant_jobs(o, shape, active, dst_of, table);
    if (in_gemm != nullptr) {  // the sm_90a kernel converts them (stream_dequant)
      *in_gemm = std::move(table);
      return Status::ok();
    }
    if (tiles == 0) return Status::ok();
    const auto* dt = static_cast<const DequantJob*>(be.upload(table.data(), G * sizeof(DequantJob)));
    const DequantKernel kernel = dequant_kernel(table[0].kind);
    kernel<<<dequant_grid(kernel, tiles), Config::kDequantThreads, 0, be.stream()>>>(
        dt, static_cast<int>(G), static_cast<uint32_t>(tiles));
    PACKMOE_CUDA_CHECK_LAUNCH();
    return Status::ok();
  }

  // Fallback: the backend's grouped dequantize kernels (any alignment).
  if (o.format == OperandFormat::kMxfp8) {
    Mxfp8Copy q;
    q.element = o.element;
    q.columnwise = shape[0].columnwise;
    q.cols = shape[0].cols;
    for (size_t g = 0; g < G; ++g) {
      PACKMOE_CHECK(shape[g].cols == q.cols, "MXFP8 copies share their column count");
      q.rows.push_back(active[g] ? shape[g].rows : 0);
      q.data.push_back(active[g] ? o.data[g] : nullptr);
      q.scale.push_back(active[g] ? o.scale[g] : nullptr);
    }
    PACKMOE_RETURN_IF_ERROR(ops::dequantize_mxfp8(be, q, DType::kBF16, outs));
  } else {
    // Every NVFP4 copy is a row-major sequence of 16-element blocks with one scale byte each, so
    // group g is viewed as (rows * cols / 16, 16): one launch even when the stored row length
    // differs per group (the wgrad copies are (N, m_g) and (K, m_g)). Decode scale 1: the
    // operand holds e2m1 * e4m3 exactly; S_dec goes into alpha.
    Nvfp4Copy q;
    q.cols = kNvfp4Block;
    for (size_t g = 0; g < G; ++g) {
      q.rows.push_back(active[g] ? shape[g].rows * shape[g].cols / kNvfp4Block : 0);
      q.data.push_back(active[g] ? o.data[g] : nullptr);
      q.scale.push_back(active[g] ? o.scale[g] : nullptr);
    }
    float* ones = static_cast<float*>(st.ones.get(be, G * sizeof(float)));
    if (st.ones.take_grown()) {
      // Filled up to its (rounded-up) capacity, so later calls with more groups see ones too.
      const int n = static_cast<int>(round_up(G * sizeof(float), Config::kGrowQuantum) / 4);
      fill_kernel<<<(n + 255) / 256, 256, 0, be.stream()>>>(ones, 1.0f, n);
      PACKMOE_CUDA_CHECK_LAUNCH();
    }
    q.decode_scale = ones;
    PACKMOE_RETURN_IF_ERROR(ops::dequantize_nvfp4(be, q, DType::kBF16, outs));
  }
  return Status::ok();
}

// ---- the implementations ------------------------------------------------------------------------

// The implementations behind the one entry point: the sm_90a wgmma kernel (grouped_gemm_sm90.cu)
// and one cuBLASLt matmul per group, the fallback and the baseline. Both read the same prepared
// BF16 operands.
enum class Impl { kCublasLt, kSm90 };

// The sm_90a kernel's view of the op, shapes only (no pointers, no counts): which per-group
// dimension is the token count (mk_g for fprop / dgrad, kred_g for wgrad), the other one, the
// output columns nk and which operands are K-major. The kernel's A is always the lhs (X or dY), B
// the rhs (W or X). Both the host-count and the device-count paths start from it.
Sm90DeviceGemm sm90_op_shape(const GroupedGemmArgs& a) {
  const bool nvfp4 = a.lhs.format == OperandFormat::kNvfp4;  // columnwise copies stored transposed
  Sm90DeviceGemm p;
  p.tokens_reduce = a.op == GemmOp::kWgrad;
  p.fixed = a.op == GemmOp::kFprop ? a.k : a.n;
  p.nk = a.op == GemmOp::kFprop ? a.n : a.k;
  p.a_k_major = a.op != GemmOp::kWgrad || nvfp4;  // wgrad reads dY (m, N): MN-major
  p.b_k_major = a.op == GemmOp::kFprop || nvfp4;  // dgrad W (N, K), wgrad X (m, K): MN-major
  p.out_bf16 = a.out_dtype == DType::kBF16;
  p.accumulate = a.accumulate;
  return p;
}

// The sm_90a problem with the host's token counts `m` (pointers left empty).
Sm90Gemm sm90_geometry(const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  return sm90_device_geometry(sm90_op_shape(a), m);
}

// GemmImpl::kCublasLt (kernel_policy.h) forces cuBLASLt; otherwise the sm_90a kernel runs on
// compute capability 9.0 wherever its shape rules allow (grouped_gemm_sm90.h). The choice depends
// on the policy, the device and the shapes only, never on pointers.
Impl choose_impl(CudaBackend& be, const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  if (kernel_policy().gemm.impl == GemmImpl::kCublasLt) return Impl::kCublasLt;
  if (!sm90_gemm_device_ok(be)) return Impl::kCublasLt;
  return sm90_gemm_shape_ok(sm90_geometry(a, m)) ? Impl::kSm90 : Impl::kCublasLt;
}

// Whether the sm_90a kernel dequantizes quantized copy `o` itself while it runs (its converter
// warps, Sm90Gemm::a_dequant) instead of a pre-pass launch before it: GemmPolicy::dequant. By
// default the MXFP8 rowwise copies only, where streaming was measured faster than the pre-pass
// (qwen3, deepseek, small_64e fprop); columnwise MXFP8 and NVFP4 copies stream as fast as the
// pre-pass converts them, not faster (docs/gemm-sm90.md, "Streaming dequantize"). Either way the
// same BF16 values reach the same wgmmas: the same bytes.
bool streams(Sm90Dequant mode, const GemmOperand& o, const std::vector<Stored>& shape) {
  if (o.format == OperandFormat::kBF16) return false;
  if (mode == Sm90Dequant::kAll) return true;
  return mode == Sm90Dequant::kRowwiseMxfp8 && o.format == OperandFormat::kMxfp8 &&
         !shape[0].columnwise;
}

Status run_grouped(CudaBackend& be, GemmState& st, const GroupedGemmArgs& a,
                   const std::vector<int64_t>& m, Impl impl) {
  const size_t G = m.size();
  const int64_t N = a.n, K = a.k;
  const OperandFormat f = a.lhs.format;
  const bool out_bf16 = a.out_dtype == DType::kBF16;
  const size_t out_elem = out_bf16 ? 2 : 4;
  cudaStream_t s = be.stream();

  std::vector<bool> active(G);
  bool any = false;
  for (size_t g = 0; g < G; ++g) any |= (active[g] = m[g] > 0);

  // wgrad groups without tokens: zeros when overwriting, untouched when accumulating.
  if (a.op == GemmOp::kWgrad && !a.accumulate)
    for (size_t g = 0; g < G; ++g)
      if (!active[g])
        PACKMOE_CUDA_CHECK(cudaMemsetAsync(a.out[g], 0, static_cast<size_t>(N * K) * out_elem, s));
  if (!any) return Status::ok();

  // Scratch layout: [lhs groups][rhs groups][staged outputs], each matrix 256-byte aligned.
  std::vector<Stored> lhs_shape(G), rhs_shape(G);
  std::vector<size_t> lhs_off(G, 0), rhs_off(G, 0), out_off(G, 0);
  auto out_rows = [&](size_t g) { return a.op == GemmOp::kWgrad ? N : m[g]; };
  auto out_cols = [&]() { return a.op == GemmOp::kFprop ? N : K; };
  bool stage_out = false;
  for (size_t g = 0; g < G; ++g) {
    lhs_shape[g] = stored_of(a.op, f, true, m[g], N, K);
    rhs_shape[g] = stored_of(a.op, f, false, m[g], N, K);
    if (active[g] && !aligned(a.out[g])) stage_out = true;
  }
  auto need = [&](const GemmOperand& o) {  // scratch: to dequantize into, or to align BF16
    if (o.format != OperandFormat::kBF16 && o.bf16.empty()) return true;
    const std::vector<const void*>& bf16 = o.format == OperandFormat::kBF16 ? o.data : o.bf16;
    for (size_t g = 0; g < G; ++g)
      if (active[g] && !aligned(bf16[g])) return true;
    return false;
  };
  const bool lhs_scratch = need(a.lhs), rhs_scratch = need(a.rhs);
  size_t total = 0;
  auto layout = [&](bool use, const std::vector<Stored>& sh, std::vector<size_t>& off, size_t el) {
    if (!use) return;
    for (size_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      off[g] = total;
      total += round_up(static_cast<size_t>(sh[g].rows * sh[g].cols) * el, Config::kScratchAlign);
    }
  };
  layout(lhs_scratch, lhs_shape, lhs_off, 2);
  layout(rhs_scratch, rhs_shape, rhs_off, 2);
  std::vector<Stored> out_shape(G);
  for (size_t g = 0; g < G; ++g) out_shape[g] = Stored{out_rows(g), out_cols(), false, false};
  layout(stage_out, out_shape, out_off, out_elem);
  uint8_t* scratch = total ? static_cast<uint8_t*>(st.scratch.get(be, total)) : nullptr;

  Prepared lhs, rhs;
  const Sm90Dequant mode = kernel_policy().gemm.dequant;
  const bool sm90 = impl == Impl::kSm90;
  std::vector<DequantJob> lhs_jobs, rhs_jobs;  // converted by the sm_90a kernel itself
  PACKMOE_RETURN_IF_ERROR(prepare(be, st, a.lhs, lhs_shape, active, scratch, lhs_off, lhs,
                                  sm90 && streams(mode, a.lhs, lhs_shape) ? &lhs_jobs : nullptr));
  PACKMOE_RETURN_IF_ERROR(prepare(be, st, a.rhs, rhs_shape, active, scratch, rhs_off, rhs,
                                  sm90 && streams(mode, a.rhs, rhs_shape) ? &rhs_jobs : nullptr));

  // Rows of D in cuBLASLt's column-major view (fprop N, dgrad and wgrad K): the alpha vector length.
  const int64_t d_rows = a.op == GemmOp::kFprop ? N : K;
  // alpha: 1, or NVFP4's per-group S_dec(lhs) * S_dec(rhs) on the device (no host round trip).
  const float* alpha_nvfp4 = nullptr;
  if (f == OperandFormat::kNvfp4 && impl == Impl::kCublasLt) {
    float* al = static_cast<float*>(st.alpha.get(be, G * d_rows * sizeof(float)));
    st.alpha.take_grown();
    const int64_t n = static_cast<int64_t>(G) * d_rows;
    nvfp4_alpha_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(
        static_cast<const float*>(a.lhs.decode_scale),
        static_cast<const float*>(a.rhs.decode_scale), al, static_cast<int>(G),
        static_cast<int>(d_rows));
    PACKMOE_CUDA_CHECK_LAUNCH();
    alpha_nvfp4 = al;
  }
  const Scaling scaling = f != OperandFormat::kNvfp4 ? Scaling::kHost
                          : a.accumulate              ? Scaling::kVectorBetaHost
                                                      : Scaling::kVectorBetaZero;
  const float host_one = 1.0f, host_zero = 0.0f;

  // Outputs: the caller's pointers, or aligned scratch copied back after the GEMMs.
  std::vector<void*> out(G, nullptr);
  for (size_t g = 0; g < G; ++g) {
    if (!active[g]) continue;
    const size_t bytes = static_cast<size_t>(out_rows(g) * out_cols()) * out_elem;
    out[g] = stage_out ? scratch + out_off[g] : a.out[g];
    if (stage_out && a.accumulate)
      PACKMOE_CUDA_CHECK(cudaMemcpyAsync(out[g], a.out[g], bytes, cudaMemcpyDeviceToDevice, s));
  }

  if (impl == Impl::kSm90) {
    Sm90Gemm p = sm90_geometry(a, m);
    p.a = lhs.ptr;
    p.b = rhs.ptr;
    p.a_dequant = std::move(lhs_jobs);
    p.b_dequant = std::move(rhs_jobs);
    p.out = out;
    if (f == OperandFormat::kNvfp4) {
      p.alpha_lhs = static_cast<const float*>(a.lhs.decode_scale);
      p.alpha_rhs = static_cast<const float*>(a.rhs.decode_scale);
    }
    PACKMOE_RETURN_IF_ERROR(grouped_gemm_sm90(be, p));
  }

  // Column-major view of our row-major matrices: a stored row-major (r, c) matrix is the
  // column-major (c, r) matrix with leading dimension c. Per op, D (M, Nc) = op(A) op(B):
  //   fprop  Y^T (N, m)  = W (N,K)        [stored (N,K): T]   . X^T  [stored (m,K): N]
  //   dgrad  dX^T (K, m) = W^T (K,N)      [(N,K): N | NVFP4 (K,N): T] . dY^T [(m,N): N]
  //   wgrad  dW^T (K, N) = X^T (K,m)      [(m,K): N | NVFP4 (K,m): T] . dY   [(m,N): T | (N,m): N]
  for (size_t g = 0; g < G && impl == Impl::kCublasLt; ++g) {
    if (!active[g]) continue;
    const Stored& sa = rhs.shape[g];  // A is always the rhs (W or X)
    const Stored& sb = lhs.shape[g];  // B is always the lhs (X or dY)
    int64_t M = 0, Nc = 0, Kc = 0;
    bool ta = false, tb = false;
    switch (a.op) {
      case GemmOp::kFprop:
        M = N, Nc = m[g], Kc = K, ta = true, tb = false;
        break;
      case GemmOp::kDgrad:
        M = K, Nc = m[g], Kc = N, ta = sa.transposed, tb = false;
        break;
      case GemmOp::kWgrad:
        M = K, Nc = N, Kc = m[g], ta = sa.transposed, tb = !sb.transposed;
        break;
    }
    const PlanKey key{ta, tb, M, Nc, Kc, sa.cols, sb.cols, M, out_bf16 ? 1 : 0,
                      static_cast<int>(scaling)};
    const Plan& p = st.plan(key);
    const void* alpha = &host_one;
    const void* beta = a.accumulate ? &host_one : &host_zero;
    if (alpha_nvfp4) {
      alpha = alpha_nvfp4 + g * d_rows;  // vector, or its first entry as a device scalar
      if (p.device_scalar) {
        beta = a.accumulate ? st.one() : st.zero();
        if (!a.accumulate)
          PACKMOE_CUDA_CHECK(cudaMemsetAsync(
              out[g], 0, static_cast<size_t>(out_rows(g) * out_cols()) * out_elem, s));
      }  // else: the vector modes take beta from the host (1) or as zero (C is not read)
    }
    PACKMOE_CUBLAS_CHECK(cublasLtMatmul(st.lt(), p.desc, alpha, rhs.ptr[g], p.a, lhs.ptr[g], p.b,
                                        beta, out[g], p.c, out[g], p.c, &p.algo,
                                        st.cublas_workspace(), p.workspace, s));
  }

  if (stage_out)
    for (size_t g = 0; g < G; ++g)
      if (active[g])
        PACKMOE_CUDA_CHECK(cudaMemcpyAsync(
            a.out[g], out[g], static_cast<size_t>(out_rows(g) * out_cols()) * out_elem,
            cudaMemcpyDeviceToDevice, s));
  return Status::ok();
}

// ---- token counts in device memory (no host synchronisation) -----------------------------------
// An m_device call on the sm_90a path queues, on be.stream(): the zeroing of empty wgrad groups
// (overwrite), the dequantize of quantized operands (token-side ones over the whole m_capacity
// buffer: the packed layout is the per-group layouts back to back, so this writes group g's BF16
// values at off_g exactly where a per-group dequantize would), the device schedule and the GEMM.
// Nothing reads the counts on the host. Everything the launches read besides their parameters
// (dequantize tables, map templates, the schedule's output) belongs to the call's DeviceCall,
// made on the first call with that signature (outside graph capture: it encodes, allocates and
// uploads) and kept, unchanged, for the life of the process; the BF16 scratch is shared by all
// signatures (GemmState::device_scratch), so their work, graph replays included, must run in
// order on the backend's stream. A captured graph can be replayed with new counts and operand
// values for as long as the pointers it names live.

constexpr size_t kMaxDeviceCalls = 16384;  // signatures kept (each a few KB plus its scratch)

bool capturing(CudaBackend& be) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  PACKMOE_CUDA_CHECK(cudaStreamIsCapturing(be.stream(), &st));
  return st != cudaStreamCaptureStatusNone;
}

// The sm_90a problem of an m_device call with the caller's pointers (the BF16 copies of quantized
// operands are filled in by make_device_call); shapes decide everything else.
Sm90DeviceGemm device_problem(const GroupedGemmArgs& a) {
  const TokenStrides ts = token_strides(a);
  Sm90DeviceGemm p = sm90_op_shape(a);
  p.groups = a.groups;
  p.capacity = a.m_capacity;
  p.align = gemm_token_alignment(a.lhs.format);
  if (a.lhs.format == OperandFormat::kNvfp4) {
    p.alpha_lhs = static_cast<const float*>(a.lhs.decode_scale);
    p.alpha_rhs = static_cast<const float*>(a.rhs.decode_scale);
  }
  // Token-side operands: BF16 bytes per token are 2 * (their token-row length).
  const int64_t lhs_cols = a.op == GemmOp::kFprop ? a.k : a.n;
  p.a.base = a.lhs.data[0];
  p.a.token_bytes = 2 * lhs_cols;
  if (a.op == GemmOp::kWgrad) {
    p.b.base = a.rhs.data[0];
    p.b.token_bytes = 2 * a.k;
    p.out.ptr.assign(a.out.begin(), a.out.end());
  } else {
    p.b.ptr = a.rhs.data;
    p.out.base = a.out[0];
    p.out.token_bytes = ts.out;
  }
  return p;
}

// Whether the call can take the no-sync path: an sm_90a device and kernel, at most
// kSm90MaxDeviceGroups groups, the kernel's shape rules for any counts, 16-byte aligned data and
// outputs (no staging) and the fast dequantize's alignment of MXFP8 columnwise scales.
bool device_path_ok(const GroupedGemmArgs& a, Impl impl) {
  if (impl != Impl::kSm90 || a.groups > kSm90MaxDeviceGroups || a.m_capacity >= (int64_t{1} << 31))
    return false;
  const Sm90DeviceGemm p = device_problem(a);
  const int64_t align = gemm_token_alignment(a.lhs.format);
  if (!sm90_gemm_shape_ok(sm90_device_geometry(p, sm90_uniform_split(p.capacity, p.groups, align))))
    return false;
  auto all_aligned = [](const auto& v) {
    return std::all_of(v.begin(), v.end(), [](const void* q) { return aligned(q); });
  };
  if (!all_aligned(a.lhs.data) || !all_aligned(a.rhs.data) || !all_aligned(a.out)) return false;
  for (const GemmOperand* o : {&a.lhs, &a.rhs}) {
    const bool is_lhs = o == &a.lhs;
    const Stored sh = stored_of(a.op, o->format, is_lhs, a.m_capacity, a.n, a.k);
    if (sh.columnwise && (!all_aligned(o->scale) || sh.cols % 16 != 0)) return false;
  }
  return true;
}

// The signature of a call: everything its DeviceCall depends on.
std::vector<uintptr_t> device_call_key(const GroupedGemmArgs& a, Sm90Tiles tiles) {
  const std::vector<uintptr_t> head = {
      static_cast<uintptr_t>(a.op), static_cast<uintptr_t>(a.lhs.format),
      static_cast<uintptr_t>(a.lhs.element), static_cast<uintptr_t>(a.rhs.element),
      static_cast<uintptr_t>(a.n), static_cast<uintptr_t>(a.k), static_cast<uintptr_t>(a.groups),
      static_cast<uintptr_t>(a.m_capacity), static_cast<uintptr_t>(a.out_dtype),
      a.accumulate, reinterpret_cast<uintptr_t>(a.m_device),
      reinterpret_cast<uintptr_t>(a.lhs.decode_scale), reinterpret_cast<uintptr_t>(a.rhs.decode_scale),
      static_cast<uintptr_t>(tiles.bn), static_cast<uintptr_t>(tiles.cluster)};
  std::vector<uintptr_t> k = head;
  for (const auto* v : {&a.lhs.data, &a.lhs.scale, &a.rhs.data, &a.rhs.scale}) {
    k.push_back(v->size());
    for (const void* q : *v) k.push_back(reinterpret_cast<uintptr_t>(q));
  }
  for (void* q : a.out) k.push_back(reinterpret_cast<uintptr_t>(q));
  return k;
}

// Device memory that lives as long as the process (a captured graph may read it).
void* keep_on_device(const void* host, size_t bytes) {
  void* d = nullptr;
  PACKMOE_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
  if (bytes) PACKMOE_CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

// The dequantize of quantized operand `o` into `out` (BF16, 256-byte aligned per group): one group
// over the whole capacity for a token-side operand, G weight groups otherwise.
DeviceDequant make_device_dequant(const GemmOperand& o, const std::vector<Stored>& shape,
                                  const std::vector<uint8_t*>& out) {
  DeviceDequant d;
  std::vector<DequantJob> table;
  const uint64_t tiles =
      dequant_jobs(o, shape, std::vector<bool>(shape.size(), true), out, table);
  d.table = static_cast<const DequantJob*>(
      keep_on_device(table.data(), table.size() * sizeof(DequantJob)));
  d.count = static_cast<int>(table.size());
  d.tiles = static_cast<uint32_t>(tiles);
  d.kernel = dequant_kernel(table[0].kind);
  d.grid = tiles ? dequant_grid(d.kernel, tiles) : 0;
  return d;
}

DeviceCall make_device_call(CudaBackend& be, GemmState& st, const GroupedGemmArgs& a,
                            Sm90Tiles tiles) {
  const size_t G = static_cast<size_t>(a.groups);
  const OperandFormat f = a.lhs.format;
  const bool wgrad = a.op == GemmOp::kWgrad;
  Sm90DeviceGemm p = device_problem(a);
  p.tiles = tiles;
  DeviceCall call;
  if (f != OperandFormat::kBF16) {
    // BF16 copies: token-side operands over the whole capacity, weights per group.
    const Stored lhs_cap = stored_of(a.op, f, true, a.m_capacity, a.n, a.k);
    const Stored rhs_sh = stored_of(a.op, f, false, a.m_capacity, a.n, a.k);
    const size_t lhs_bytes = round_up(static_cast<size_t>(lhs_cap.rows * lhs_cap.cols) * 2,
                                      Config::kScratchAlign);
    const size_t rhs_group = round_up(static_cast<size_t>(rhs_sh.rows * rhs_sh.cols) * 2,
                                      Config::kScratchAlign);
    const size_t rhs_groups = wgrad ? 1 : G;
    const size_t need = lhs_bytes + rhs_groups * rhs_group;
    if (st.device_scratch_bytes < need) {  // never freed: earlier signatures may still use it
      PACKMOE_CUDA_CHECK(cudaMalloc(&st.device_scratch, need));
      st.device_scratch_bytes = need;
    }
    uint8_t* scratch = st.device_scratch;
    call.lhs = make_device_dequant(a.lhs, {lhs_cap}, {scratch});
    std::vector<uint8_t*> rhs_out;
    for (size_t g = 0; g < rhs_groups; ++g) rhs_out.push_back(scratch + lhs_bytes + g * rhs_group);
    call.rhs = make_device_dequant(a.rhs, std::vector<Stored>(rhs_groups, rhs_sh), rhs_out);
    p.a.base = scratch;
    if (wgrad)
      p.b.base = rhs_out[0];
    else
      p.b.ptr.assign(rhs_out.begin(), rhs_out.end());
  }
  if (wgrad && !a.accumulate) {
    call.zero_outs = static_cast<void* const*>(keep_on_device(a.out.data(), G * sizeof(void*)));
    call.zero_vecs = a.n * a.k * (a.out_dtype == DType::kBF16 ? 2 : 4) / 16;
  }
  call.plan = make_sm90_device_plan(be, p);
  return call;
}

// The no-sync path of an m_device call: false when it does not apply (the caller copies the
// counts to the host instead).
Result<bool> run_device_counts(CudaBackend& be, GemmState& st, const GroupedGemmArgs& a) {
  // Shape and pointer checks, with every group taken as non-empty (every pointer must be valid).
  const std::vector<int64_t> probe(static_cast<size_t>(a.groups), gemm_token_alignment(a.lhs.format));
  PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(expand_packed_tokens(a, probe), probe));
  const Impl impl = choose_impl(be, expand_packed_tokens(a, probe), probe);
  if (!device_path_ok(a, impl)) return false;
  const Sm90Tiles tiles = sm90_device_tiles(be, device_problem(a));
  const std::vector<uintptr_t> key = device_call_key(a, tiles);
  auto it = st.device_calls.find(key);
  if (it == st.device_calls.end()) {
    if (capturing(be))
      return Status::error("grouped_gemm: this m_device call has not run before; run it once "
                           "outside CUDA-graph capture, then capture it");
    if (st.device_calls.size() >= kMaxDeviceCalls)
      return Status::error("grouped_gemm: more than " + std::to_string(kMaxDeviceCalls) +
                           " distinct m_device call signatures (their device state is kept for "
                           "CUDA graphs and never freed)");
    it = st.device_calls.emplace(key, make_device_call(be, st, a, tiles)).first;
  }
  const DeviceCall& call = it->second;
  const auto* m = static_cast<const int64_t*>(a.m_device);
  cudaStream_t s = be.stream();
  if (call.zero_outs != nullptr) {
    const unsigned x = static_cast<unsigned>(std::min<int64_t>((call.zero_vecs + 255) / 256, 64));
    zero_empty_groups_kernel<<<dim3(std::max(x, 1u), static_cast<unsigned>(a.groups)), 256, 0, s>>>(
        m, call.zero_outs, call.zero_vecs);
    PACKMOE_CUDA_CHECK_LAUNCH();
  }
  for (const DeviceDequant* d : {&call.lhs, &call.rhs}) {
    if (d->tiles == 0) continue;
    d->kernel<<<d->grid, Config::kDequantThreads, 0, s>>>(d->table, d->count, d->tiles);
    PACKMOE_CUDA_CHECK_LAUNCH();
  }
  PACKMOE_RETURN_IF_ERROR(grouped_gemm_sm90_device(be, *call.plan, m));
  return true;
}

}  // namespace

Status grouped_gemm_cublas(CudaBackend& be, const GroupedGemmArgs& args) {
  PACKMOE_RETURN_IF_ERROR(validate_token_source(args));
  GemmState& st = state_of(be);
  std::lock_guard<std::mutex> lock(st.mu);
  if (args.m_device != nullptr) {
    PACKMOE_RETURN_IF_ERROR(validate_packed_tokens(args));
    Result<bool> done = run_device_counts(be, st, args);
    if (!done.is_ok()) return done.status();
    if (done.value()) return Status::ok();
    // cuBLASLt (or shapes / pointers the sm_90a path does not take): the counts come to the
    // host, a synchronisation, so this cannot be captured in a CUDA graph.
    if (capturing(be))
      return Status::error("grouped_gemm: this m_device call copies the counts to the host (no "
                           "sm_90a path for it), so it cannot be captured in a CUDA graph");
    std::vector<int64_t> m(static_cast<size_t>(args.groups));
    be.copy(m.data(), args.m_device, m.size() * sizeof(int64_t), Backend::CopyKind::kDeviceToHost);
    PACKMOE_RETURN_IF_ERROR(check_device_counts(args, m));
    const GroupedGemmArgs host = expand_packed_tokens(args, m);
    PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(host, m));
    return run_grouped(be, st, host, m, choose_impl(be, host, m));
  }
  PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(args, args.m));
  return run_grouped(be, st, args, args.m, choose_impl(be, args, args.m));
}

}  // namespace packmoe
