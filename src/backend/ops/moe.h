// Non-GEMM ops of the MoE block, forward and backward (router softmax / top-k, aux loss, permute,
// SwiGLU, unpermute + combine), their argument checks and the host routing plan. Invariant: every
// result is the exact FP32 arithmetic written here (fixed reduction orders, moe_exp_f32, no FMA),
// so any backend gives the CPU reference's bits whatever its thread count. M = permuted rows: each
// expert's rows padded to the GEMM format's token alignment.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/reduce_order.h"
#include "core/codecs.h"
#include "core/dtype.h"
#include "core/hd.h"
#include "core/status.h"

namespace packmoe {

// ---- exact arithmetic shared by every backend ---------------------------------------------------
//
// "Sequential" and "R32" sums, and the rounding rules: backend/reduce_order.h.

// e^x in FP32 from exactly-rounded operations only, so host and device agree bit for bit (libm's
// expf and CUDA's expf differ in the last bit). Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
// Taylor degree 7 in Horner form (truncation < 0.1 ulp), then two exact-or-once-rounded scalings
// by 2^n1 * 2^n2 (n = n1 + n2) so subnormal results round once. Over every FP32 input with a
// normal result: <= 1 ulp from exp rounded to FP32, 99.2% exactly equal (checked exhaustively);
// +Inf above ln(FLT_MAX), +0 far below, NaN passes through.
PACKMOE_HD float moe_exp_f32(float x) {
  if (x != x) return x;
  // Beyond these bounds the result is Inf / 0 anyway; clamping keeps n within [-150, 129].
  if (x > 89.0f) x = 89.0f;
  if (x < -104.0f) x = -104.0f;
  constexpr float kLog2e = 1.44269504088896341f;
  // ln2 = kLn2Hi + kLn2Lo; kLn2Hi (0x3F317200) has 15 significant bits, so n * kLn2Hi is exact.
  constexpr float kLn2Hi = 6.93145751953125e-1f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;  // 0x35BFBE8E
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (RNE)
  const float kn = (x * kLog2e + kRound) - kRound;
  const int n = static_cast<int>(kn);
  const float r = (x - kn * kLn2Hi) - kn * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = 1.0f / 720.0f + r * p;
  p = 1.0f / 120.0f + r * p;
  p = 1.0f / 24.0f + r * p;
  p = 1.0f / 6.0f + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  const int n1 = n / 2;
  const int n2 = n - n1;
  const float s1 = f32_from_bits(static_cast<uint32_t>(n1 + 127) << 23);  // 2^n1, |n1| <= 75
  const float s2 = f32_from_bits(static_cast<uint32_t>(n2 + 127) << 23);  // 2^n2, |n2| <= 75
  return (p * s1) * s2;
}

// sigmoid(g) = 1 / (1 + e^-g); silu(g) = g * sigmoid(g).
PACKMOE_HD float moe_sigmoid_f32(float g) { return 1.0f / (1.0f + moe_exp_f32(-g)); }

// ---- router: softmax over all E experts, top-k, optional renormalisation ------------------------
//
// Forward, per token t, z = logits[t]:
//   m           = max_e z[e]
//   x[e]        = moe_exp_f32(z[e] - m)
//   s           = R32 sum_e x[e]
//   probs[t, e] = x[e] / s
//   idx[t, j]   = the j-th expert in the order (probs descending, expert index ascending), NaN
//                 probs last: j = 0 is the largest and a tie goes to the LOWER expert index
//   p_j         = probs[t, idx[t, j]]
//   w[t, j]     = p_j / S with S = sequential sum_j p_j    when norm_topk_prob
//                 p_j                                        otherwise
struct RouterTopkArgs {
  int64_t tokens = 0;   // T
  int64_t experts = 0;  // E
  int64_t top_k = 0;    // k
  bool norm_topk_prob = false;
  const float* logits = nullptr;  // (T, E) the router linear's output
  float* probs = nullptr;         // (T, E) kept for the backward and the aux loss
  int32_t* idx = nullptr;         // (T, k)
  float* w = nullptr;             // (T, k)
};

// Backward: dw (T, k) -> dlogits (T, E), overwritten. Per token, p_j and S recomputed from probs
// and idx exactly as in the forward (same bits), g_j = dL/dp at expert idx[t, j]:
//   norm_topk_prob: c = sequential sum_j dw_j * (p_j / S);  g_j = (dw_j - c) / S
//   otherwise:      g_j = dw_j
//   d              = sequential sum_j g_j * p_j                 (= sum_e dL/dp_e * p_e)
//   dlogits[t, e]  = p_e * (g_j - d)  when e = idx[t, j],   p_e * (-d) otherwise
// idx rows must hold distinct experts (the forward's do).
struct RouterTopkBackwardArgs {
  int64_t tokens = 0;   // T
  int64_t experts = 0;  // E
  int64_t top_k = 0;    // k
  bool norm_topk_prob = false;
  const float* probs = nullptr;  // (T, E) from the forward
  const int32_t* idx = nullptr;  // (T, k) from the forward
  const float* dw = nullptr;     // (T, k)
  float* dlogits = nullptr;      // (T, E)
};

// ---- load-balancing aux loss (one layer's tokens) -----------------------------------------------
//
// Hugging Face load_balancing_loss_func with the fix of transformers PR #45131 (softmax applied
// once, to logits): aux = E * sum_{j,e} f[j, e] * pbar[e], where
//   cnt[j, e] = #{t : idx[t, j] = e}                            (exact integers)
//   f[j, e]   = float(cnt[j, e]) / float(T)
//   pbar[e]   = (R32 sum_t probs[t, e]) / float(T)
//   aux       = float(E) * (R32 sum over i = j * E + e of f[j, e] * pbar[e])
// T < 2^24 so every count is exact in FP32.
struct AuxLossArgs {
  int64_t tokens = 0;            // T
  int64_t experts = 0;           // E
  int64_t top_k = 0;             // k
  const float* probs = nullptr;  // (T, E) the router forward's
  const int32_t* idx = nullptr;  // (T, k)
  float* aux = nullptr;          // (1,)
};

// Backward: daux -> dlogits, ADDED into dlogits (after the router backward wrote it). f is
// piecewise constant in the logits, so only pbar carries gradient:
//   cnt_e         = sum_j cnt[j, e]
//   q[e]          = ((daux * float(E)) * (float(cnt_e) / float(T))) / float(T)   (daux dAux/dp)
//   d_t           = R32 sum_e probs[t, e] * q[e]
//   dlogits[t, e] = dlogits[t, e] + probs[t, e] * (q[e] - d_t)
struct AuxLossBackwardArgs {
  int64_t tokens = 0;            // T
  int64_t experts = 0;           // E
  int64_t top_k = 0;             // k
  float daux = 0.0f;             // dL/daux, e.g. router_aux_loss_coef times the loss scale
  const float* probs = nullptr;  // (T, E)
  const int32_t* idx = nullptr;  // (T, k)
  float* dlogits = nullptr;      // (T, E) accumulated into
};

// ---- routing plan (host reference) --------------------------------------------------------------
//
// Where each (token, choice) pair goes in the permuted buffer. Expert e owns rows
// [offsets[e], offsets[e + 1]): first its counts[e] routed rows in increasing (t, j) order, then
// padding rows up to a multiple of `align`. padded_counts are the grouped GEMM's per-expert m.
struct RoutingPlan {
  int64_t tokens = 0;                  // T
  int64_t experts = 0;                 // E
  int64_t top_k = 0;                   // k
  int64_t align = 1;                   // rows per expert are a multiple of this
  int64_t rows = 0;                    // M = offsets[E]
  std::vector<int64_t> counts;         // (E) routed (t, j) pairs per expert
  std::vector<int64_t> padded_counts;  // (E) counts rounded up to align
  std::vector<int64_t> offsets;        // (E + 1) first row of each expert
  std::vector<int32_t> dest;           // (T, k) row of (t, j)
  std::vector<int32_t> row_slot;       // (M) t * k + j of the pair in the row, -1 for padding
};

// `idx` (T, k) in host memory; align is the format's token alignment (gemm_token_alignment: BF16
// 1, MXFP8 32, NVFP4 16). Errors for empty or inconsistent shapes, align < 1, an expert index
// outside [0, E), or more rows than int32 addresses.
Result<RoutingPlan> build_routing_plan(const int32_t* idx, int64_t tokens, int64_t experts,
                                       int64_t top_k, int64_t align);

// ---- routing plan on the backend ----------------------------------------------------------------
//
// The same plan computed where idx lives, so nothing travels to the host: dest and row_slot equal
// build_routing_plan's, counts[e] its counts, and counts[E] is the number of idx entries outside
// [0, E) (then every other output is unspecified: routing_plan_from_counts turns it into an
// error). padded_counts its padded_counts (the grouped GEMMs' m_device) and rows[0] = M (the
// row-side ops' device row count), so buffers sized by routing_plan_max_rows serve any plan
// without the host knowing M.
struct RoutingPlanArgs {
  int64_t tokens = 0;               // T
  int64_t experts = 0;              // E
  int64_t top_k = 0;                // k
  int64_t align = 1;                // as build_routing_plan
  int64_t max_rows = 0;             // row_slot capacity, >= routing_plan_max_rows(T, E, k, align)
  const int32_t* idx = nullptr;     // (T, k)
  int32_t* dest = nullptr;          // (T, k)
  int32_t* row_slot = nullptr;      // (max_rows): rows past M hold -1 too
  int64_t* counts = nullptr;        // (E + 1)
  int64_t* padded_counts = nullptr; // (E)
  int64_t* rows = nullptr;          // (1) M = sum of padded_counts
};

// The most rows a plan can have: T k routed rows plus at most align - 1 padding rows per expert.
int64_t routing_plan_max_rows(int64_t tokens, int64_t experts, int64_t top_k, int64_t align);

// The host part of a plan from the op's counts (E + 1, host memory): counts, padded_counts,
// offsets and rows; dest and row_slot stay empty (they live in the backend's memory). Errors: an
// expert index outside [0, E) (counts[E] > 0), counts that do not sum to T k, more rows than int32.
Result<RoutingPlan> routing_plan_from_counts(const int64_t* counts, int64_t tokens,
                                             int64_t experts, int64_t top_k, int64_t align);

// ---- permute: tokens -> expert-sorted rows ------------------------------------------------------
//
// Forward: xp[r] = x[row_slot[r] / k] for a routed row, zeros for a padding row (a byte copy: x
// and xp share dtype, BF16 or F32). The plan's dest is its inverse (dest[t, j] = the row r with
// row_slot[r] = t k + j): a backend may walk either (the CUDA kernel reads each x row once and
// writes it to its k rows).
struct PermuteArgs {
  int64_t tokens = 0;  // T
  int64_t hidden = 0;  // H
  int64_t top_k = 0;   // k
  int64_t rows = 0;    // M
  DType dtype = DType::kBF16;
  const int32_t* row_slot = nullptr;  // (M) the plan's
  const int32_t* dest = nullptr;      // (T, k) the plan's
  const void* x = nullptr;            // (T, H)
  void* xp = nullptr;                 // (M, H)
};

// Backward: dx[t] = sequential sum_j dxp[dest[t, j]] in FP32 (dxp F32 or BF16), dx overwritten.
// A gather per token: no atomics.
struct PermuteBackwardArgs {
  int64_t tokens = 0;             // T
  int64_t hidden = 0;             // H
  int64_t top_k = 0;              // k
  int64_t rows = 0;               // M
  const int32_t* dest = nullptr;  // (T, k) the plan's
  DType dxp_dtype = DType::kF32;
  const void* dxp = nullptr;  // (M, H)
  float* dx = nullptr;        // (T, H)
};

// ---- SwiGLU on the packed gate/up output --------------------------------------------------------
//
// in (M, 2F) holds gate in columns [0, F) and up in [F, 2F) (Hugging Face gate_up_proj order).
// Forward, per element, g = gate, u = up widened to FP32, s = moe_sigmoid_f32(g):
//   out = (g * s) * u
// rows_device (optional, both directions): a (1,) I64 in the backend's memory, M' <= M; only rows
// [0, M') are read and written (buffers sized by an upper bound, the routing plan's padded_counts[E]
// the rows in use: the rest hold nothing anyone reads).
struct SwigluArgs {
  int64_t rows = 0;                // M
  const int64_t* rows_device = nullptr;
  int64_t ffn = 0;                 // F
  DType in_dtype = DType::kBF16;   // F32 or BF16
  const void* in = nullptr;        // (M, 2F)
  DType out_dtype = DType::kBF16;  // F32 or BF16
  void* out = nullptr;             // (M, F)
};

// Backward: dout (M, F) -> din (M, 2F), overwritten; with o = dout, g, u, s as above:
//   dgate = (o * u) * (s * (1 + g * (1 - s)))        (silu'(g) = s (1 + g (1 - s)))
//   dup   = o * (g * s)
struct SwigluBackwardArgs {
  int64_t rows = 0;                // M
  const int64_t* rows_device = nullptr;  // as SwigluArgs
  int64_t ffn = 0;                 // F
  DType in_dtype = DType::kBF16;   // F32 or BF16
  const void* in = nullptr;        // (M, 2F) the forward's input
  DType dout_dtype = DType::kF32;  // F32 or BF16
  const void* dout = nullptr;      // (M, F)
  DType din_dtype = DType::kF32;   // F32 or BF16
  void* din = nullptr;             // (M, 2F)
};

// ---- unpermute + combine: expert rows -> tokens, weighted by the router ------------------------
//
// Forward: y[t] = sequential sum_j w[t, j] * yp[dest[t, j]] in FP32; padding rows are never read.
struct UnpermuteArgs {
  int64_t tokens = 0;             // T
  int64_t hidden = 0;             // H
  int64_t top_k = 0;              // k
  int64_t rows = 0;               // M
  const int32_t* dest = nullptr;  // (T, k) the plan's
  const float* w = nullptr;       // (T, k) the router's
  DType yp_dtype = DType::kBF16;  // F32 or BF16
  const void* yp = nullptr;       // (M, H)
  DType y_dtype = DType::kF32;    // F32 or BF16
  void* y = nullptr;              // (T, H)
};

// Backward, both outputs overwritten:
//   dyp[r]   = w[t, j] * dy[t] for the pair (t, j) = row_slot[r], zeros for a padding row
//   dw[t, j] = R32 sum_h dy[t, h] * yp[dest[t, j], h]
struct UnpermuteBackwardArgs {
  int64_t tokens = 0;                 // T
  int64_t hidden = 0;                 // H
  int64_t top_k = 0;                  // k
  int64_t rows = 0;                   // M
  const int32_t* dest = nullptr;      // (T, k) the plan's
  const int32_t* row_slot = nullptr;  // (M) the plan's
  const float* w = nullptr;           // (T, k)
  DType yp_dtype = DType::kBF16;      // F32 or BF16
  const void* yp = nullptr;           // (M, H) the forward's input
  DType dy_dtype = DType::kF32;       // F32 or BF16
  const void* dy = nullptr;           // (T, H)
  DType dyp_dtype = DType::kF32;      // F32 or BF16
  void* dyp = nullptr;                // (M, H)
  float* dw = nullptr;                // (T, k)
};

// ---- argument checks (shapes, dtypes, pointers; touch no memory) --------------------------------
Status validate_router_topk(const RouterTopkArgs& a);
Status validate_router_topk_backward(const RouterTopkBackwardArgs& a);
Status validate_aux_loss(const AuxLossArgs& a);
Status validate_aux_loss_backward(const AuxLossBackwardArgs& a);
Status validate_permute(const PermuteArgs& a);
Status validate_permute_backward(const PermuteBackwardArgs& a);
Status validate_swiglu(const SwigluArgs& a);
Status validate_swiglu_backward(const SwigluBackwardArgs& a);
Status validate_unpermute(const UnpermuteArgs& a);
Status validate_unpermute_backward(const UnpermuteBackwardArgs& a);
Status validate_routing_plan(const RoutingPlanArgs& a);

// ---- CPU reference (backend/cpu/moe_ops_cpu.cpp): host pointers, OpenMP over tokens or rows -----
// Each validates its arguments first; an index read from idx / dest / row_slot outside its range
// is a programmer error (PACKMOE_CHECK), since those come from the router and the plan.
Status router_topk_cpu(const RouterTopkArgs& a);
Status router_topk_backward_cpu(const RouterTopkBackwardArgs& a);
Status aux_loss_cpu(const AuxLossArgs& a);
Status aux_loss_backward_cpu(const AuxLossBackwardArgs& a);
Status permute_cpu(const PermuteArgs& a);
Status permute_backward_cpu(const PermuteBackwardArgs& a);
Status swiglu_cpu(const SwigluArgs& a);
Status swiglu_backward_cpu(const SwigluBackwardArgs& a);
Status unpermute_cpu(const UnpermuteArgs& a);
Status unpermute_backward_cpu(const UnpermuteBackwardArgs& a);
Status routing_plan_cpu(const RoutingPlanArgs& a);

// ---- entries: validate once, then run the backend's implementation (backend/ops/moe.cpp) --------
class Backend;
namespace ops {
Status router_topk(Backend& b, const RouterTopkArgs& a);
Status router_topk_backward(Backend& b, const RouterTopkBackwardArgs& a);
Status aux_loss(Backend& b, const AuxLossArgs& a);
Status aux_loss_backward(Backend& b, const AuxLossBackwardArgs& a);
Status permute(Backend& b, const PermuteArgs& a);
Status permute_backward(Backend& b, const PermuteBackwardArgs& a);
Status swiglu(Backend& b, const SwigluArgs& a);
Status swiglu_backward(Backend& b, const SwigluBackwardArgs& a);
Status unpermute(Backend& b, const UnpermuteArgs& a);
Status unpermute_backward(Backend& b, const UnpermuteBackwardArgs& a);
Status routing_plan(Backend& b, const RoutingPlanArgs& a);
}  // namespace ops

// One device's implementation of the family; every pointer is set (backend/cpu/cpu_kernels.cpp,
// backend/cuda/cuda_kernels.cu). Arguments arrive validated.
struct MoeKernels {
  Status (*router_topk)(Backend&, const RouterTopkArgs&);
  Status (*router_topk_backward)(Backend&, const RouterTopkBackwardArgs&);
  Status (*aux_loss)(Backend&, const AuxLossArgs&);
  Status (*aux_loss_backward)(Backend&, const AuxLossBackwardArgs&);
  Status (*permute)(Backend&, const PermuteArgs&);
  Status (*permute_backward)(Backend&, const PermuteBackwardArgs&);
  Status (*swiglu)(Backend&, const SwigluArgs&);
  Status (*swiglu_backward)(Backend&, const SwigluBackwardArgs&);
  Status (*unpermute)(Backend&, const UnpermuteArgs&);
  Status (*unpermute_backward)(Backend&, const UnpermuteBackwardArgs&);
  Status (*routing_plan)(Backend&, const RoutingPlanArgs&);
};

}  // namespace packmoe
