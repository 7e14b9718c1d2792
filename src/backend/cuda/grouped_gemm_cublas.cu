// The grouped GEMM as one cuBLASLt matmul per group (grouped_gemm_cublas.h), on the prepared BF16
// operands, all on be.stream().
//
// Scaling. NVFP4's per-tensor FP32 decode scales are not folded into the operands but applied as
// alpha[g] = S_dec(lhs)[g] * S_dec(rhs)[g], computed on the device (no host round trip), as a
// native block-scaled GEMM does. cuBLASLt takes it as a device alpha vector (one entry per output
// row, all equal) with beta zero or a host beta, so an overwrite never reads the old output (a
// device-scalar beta of 0 would not promise that: where the vector mode has no algorithm we use
// it and zero the output first).
//
// Determinism. cuBLAS's own heuristic (cublasGemmEx, or cublasLt with the default preference)
// assumes up to 256-byte pointer alignment and may pick another kernel for a pointer that is only
// 16-byte aligned (a packed expert at offset g*N*K*2), which can change the FP32 summation
// order. So we call cublasLt with an algorithm chosen once per shape by the heuristic told that
// every pointer is exactly kAlignmentBytes (16) aligned, and cache it. Pointers that are not
// 16-byte aligned (possible only for BF16 operands with odd shapes) are staged through aligned
// scratch by the caller, so they too run the cached algorithm. The reduction-scheme mask allows
// split-K only with an FP32 workspace reduction (the cublasLt form of
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION); compute type CUBLAS_COMPUTE_32F (no
// TF32/BF16x9 "fast" modes); a fixed 32 MiB workspace of our own, so nothing depends on a
// cuBLAS-internal pool.
#include "backend/cuda/grouped_gemm_cublas.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#define PACKMOE_CUBLAS_CHECK(expr)                                                    \
  do {                                                                                \
    cublasStatus_t packmoe_cublas_st_ = (expr);                                       \
    PACKMOE_CHECK(packmoe_cublas_st_ == CUBLAS_STATUS_SUCCESS,                        \
                  #expr << ": " << cublasLtGetStatusString(packmoe_cublas_st_));      \
  } while (0)

namespace packmoe::gemm_cuda {
namespace {

struct Config {
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // NVIDIA's advice for sm_90
  static constexpr size_t kMaxPlans = 1 << 14;     // cached (shape -> algorithm) entries
};

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

// The cuBLASLt state of one backend: handle, workspace, constants, cached plans and the NVFP4
// alpha vectors. It lives as long as the process-wide backend (never destroyed); the caller's
// lock serialises its use.
class CublasState {
 public:
  explicit CublasState(CudaBackend& be) {
    PACKMOE_CUBLAS_CHECK(cublasLtCreate(&lt_));
    PACKMOE_CUDA_CHECK(cudaMalloc(&cublas_ws_, Config::kCublasWorkspaceBytes));
    PACKMOE_CUDA_CHECK(cudaMalloc(&consts_, 2 * sizeof(float)));
    const float c[2] = {0.0f, 1.0f};
    PACKMOE_CUDA_CHECK(
        cudaMemcpyAsync(consts_, c, sizeof c, cudaMemcpyHostToDevice, be.stream()));
    PACKMOE_CUDA_CHECK(cudaStreamSynchronize(be.stream()));  // `c` lives on this frame
  }

  GrowBuffer alpha;  // (G, rows of D) NVFP4 alpha vectors

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
  const uint32_t align = kAlignmentBytes;
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

const Plan& CublasState::plan(const PlanKey& key) {
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

CublasState& cublas_state(CudaBackend& be) {
  static std::mutex mu;
  static auto* states = new std::map<CudaBackend*, std::unique_ptr<CublasState>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*states)[&be];
  if (!s) s = std::make_unique<CublasState>(be);
  return *s;
}

}  // namespace

Status grouped_gemm_cublaslt(CudaBackend& be, const GroupedGemmArgs& a,
                             const std::vector<int64_t>& m, const Prepared& lhs,
                             const Prepared& rhs, const std::vector<void*>& out) {
  CublasState& st = cublas_state(be);
  const size_t G = m.size();
  const int64_t N = a.n, K = a.k;
  const OperandFormat f = a.lhs.format;
  const bool out_bf16 = a.out_dtype == DType::kBF16;
  const size_t out_elem = out_bf16 ? 2 : 4;
  cudaStream_t s = be.stream();
  auto out_rows = [&](size_t g) { return a.op == GemmOp::kWgrad ? N : m[g]; };
  auto out_cols = [&]() { return a.op == GemmOp::kFprop ? N : K; };

  // Rows of D in cuBLASLt's column-major view (fprop N, dgrad and wgrad K): the alpha vector length.
  const int64_t d_rows = a.op == GemmOp::kFprop ? N : K;
  // alpha: 1, or NVFP4's per-group S_dec(lhs) * S_dec(rhs) on the device (no host round trip).
  const float* alpha_nvfp4 = nullptr;
  if (f == OperandFormat::kNvfp4) {
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

  // Column-major view of our row-major matrices: a stored row-major (r, c) matrix is the
  // column-major (c, r) matrix with leading dimension c. Per op, D (M, Nc) = op(A) op(B):
  //   fprop  Y^T (N, m)  = W (N,K)        [stored (N,K): T]   . X^T  [stored (m,K): N]
  //   dgrad  dX^T (K, m) = W^T (K,N)      [(N,K): N | NVFP4 (K,N): T] . dY^T [(m,N): N]
  //   wgrad  dW^T (K, N) = X^T (K,m)      [(m,K): N | NVFP4 (K,m): T] . dY   [(m,N): T | (N,m): N]
  for (size_t g = 0; g < G; ++g) {
    if (m[g] <= 0) continue;
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

  return Status::ok();
}

}  // namespace packmoe::gemm_cuda
