// Dense decoder ops of Qwen3-MoE, forward and backward: embedding lookup, RMSNorm, rotate-half
// RoPE, causal GQA attention core and shifted-label cross-entropy, their argument checks and the
// host RoPE table. Invariant: as in backend/ops/moe.h, every result is the exact FP32 arithmetic written
// here (fixed reduction orders, moe_exp_f32 / model_log_f32, no FMA, no libm on a device path), so
// any backend can reproduce the CPU reference's bits whatever its thread count; attention and
// cross_entropy say where CUDA only keeps a bound. Tensors FP32 unless marked BF16.
#pragma once

#include <cstdint>

#include "backend/ops/moe.h"  // moe_exp_f32, the R32 order (backend/reduce_order.h)
#include "core/codecs.h"
#include "core/hd.h"
#include "core/status.h"

namespace packmoe {

// ---- exact arithmetic (see reduce_order.h for "sequential" and "R32" sums) ---------------------

// ln x in FP32 from exactly-rounded operations only (libm's logf and CUDA's differ in the last
// bit). x = 2^e * m with m in (sqrt(1/2), sqrt(2)] (subnormals pre-scaled by 2^23), f = (m - 1) /
// (m + 1), ln m = 2f + 2f * (f^2 * P(f^2)) with the atanh series P = 1/3 + f^2/5 + ... + f^8/11
// (truncation < 1e-10 relative since f^2 <= 0.0295), result = e * ln2_hi + (e * ln2_lo + ln m).
// Over every positive finite FP32 input: <= 2 ulp from ln x rounded to FP32, 99.2% exactly equal
// (checked exhaustively; the unit test samples it). NaN / x < 0: NaN; +0: -Inf; +Inf: +Inf.
PACKMOE_HD float model_log_f32(float x) {
  if (x != x) return x;
  if (x < 0.0f) return f32_from_bits(0x7FC00000u);
  if (x == 0.0f) return -f32_from_bits(0x7F800000u);
  if (x == f32_from_bits(0x7F800000u)) return x;
  uint32_t b = f32_bits(x);
  int e = static_cast<int>((b >> 23) & 0xFFu);
  if (e == 0) {  // subnormal: 2^23 x is normal and exact
    b = f32_bits(x * 8388608.0f);
    e = static_cast<int>((b >> 23) & 0xFFu) - 23;
  }
  e -= 127;
  float m = f32_from_bits((b & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m = m * 0.5f;  // exact
    e += 1;
  }
  constexpr float kLn2Hi = 6.93145751953125e-1f;  // 15 significant bits: e * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  const float f = (m - 1.0f) / (m + 1.0f);  // m - 1 exact (Sterbenz)
  const float f2 = f * f;
  float p = 1.0f / 11.0f;
  p = 1.0f / 9.0f + f2 * p;
  p = 1.0f / 7.0f + f2 * p;
  p = 1.0f / 5.0f + f2 * p;
  p = 1.0f / 3.0f + f2 * p;
  const float two_f = 2.0f * f;  // exact
  const float ln_m = two_f + two_f * (f2 * p);
  const float ke = static_cast<float>(e);
  return ke * kLn2Hi + (ke * kLn2Lo + ln_m);
}

// ---- embedding lookup ---------------------------------------------------------------------------
//
// Forward: out[t] = table[ids[t]] (a copy). ids are data, so an id outside [0, V) is a Status error
// (checked before anything is written), not a crash.
struct EmbeddingArgs {
  int64_t tokens = 0;             // T
  int64_t vocab = 0;              // V
  int64_t hidden = 0;             // H
  const int32_t* ids = nullptr;   // (T)
  const float* table = nullptr;   // (V, H)
  float* out = nullptr;           // (T, H)
};

// Backward: the call's sum is ADDED into dtable (the table's gradient collects several calls, and
// zeroing all of (V, H) per call would cost more than the op): for every (v, h) with some token of
// id v, s = +0, then s = s + dout[t, h] in increasing t over the tokens with ids[t] = v, then
// dtable[v, h] = dtable[v, h] + s; rows of ids that do not occur are not touched. So one call over
// N micro-batches' tokens and N calls give different sums, but N data-parallel ranks each adding
// its call's s give what one process adding N calls' s gives. A scatter in a fixed order, no
// atomics (both backends sort the (id, t) pairs and sum each id's segment in t order).
struct EmbeddingBackwardArgs {
  int64_t tokens = 0;            // T
  int64_t vocab = 0;             // V
  int64_t hidden = 0;            // H
  const int32_t* ids = nullptr;  // (T)
  const float* dout = nullptr;   // (T, H)
  float* dtable = nullptr;       // (V, H) accumulated into
};

// ---- RMSNorm over the last dim ------------------------------------------------------------------
//
// Forward, per row r, x = x[r] (D):
//   ss      = R32 sum_d x[d] * x[d]
//   rstd[r] = 1 / sqrt(ss / float(D) + eps)          (sqrt and / correctly rounded; HF's rsqrt
//                                                     is an approximation on CUDA, so not used)
//   n[d]    = x[d] * rstd[r]
//   y[d]    = n[d] * weight[d]
// HF casts n to the activation dtype before the weight; in FP32 that cast is the identity.
// Used for input/post-attention/final norms (rows = T, D = H) and q/k norms (rows = T * heads,
// D = head_dim). Exactly one output is set: y (FP32), or y_bf16 = f32_to_bf16(y[d]) (RNE of the
// FP32 value y would hold: cast_f32_to_bf16's bytes, without the FP32 tensor in memory).
struct RmsNormArgs {
  int64_t rows = 0;               // N
  int64_t dim = 0;                // D
  float eps = 1e-6f;
  const float* x = nullptr;       // (N, D)
  const float* weight = nullptr;  // (D)
  float* y = nullptr;             // (N, D) F32, or null when y_bf16 is set
  float* rstd = nullptr;          // (N) kept for the backward
  uint16_t* y_bf16 = nullptr;     // (N, D) BF16, or null when y is set
};

// Backward, both outputs overwritten; n[d] = x[d] * rstd[r] recomputed (the forward's bits):
//   g[d]     = dy[d] * weight[d]
//   c        = (R32 sum_d g[d] * n[d]) / float(D)
//   t[d]     = (g[d] - n[d] * c) * rstd[r]
//   dx[d]    = t[d], or with dresidual: dresidual[r, d] + t[d] (t rounded to FP32 first, then
//              one FP32 add: a residual block's dx = dresidual + norm'(dy) in the same pass)
//   dweight[d] = blocked R32 sum (backend/reduce_order.h) over rows r of dy[r, d] * n[r, d]
struct RmsNormBackwardArgs {
  int64_t rows = 0;               // N
  int64_t dim = 0;                // D
  const float* x = nullptr;       // (N, D) the forward's input
  const float* weight = nullptr;  // (D)
  const float* rstd = nullptr;    // (N) from the forward
  const float* dy = nullptr;      // (N, D)
  float* dx = nullptr;            // (N, D)
  float* dweight = nullptr;       // (D)
  const float* dresidual = nullptr;  // (N, D) optional (null: dx = t)
};

// ---- RoPE, rotate-half (GPT-NeoX / HF default) --------------------------------------------------
//
// Table (host, once per batch of positions), for i < D/2, following HF's FP32 angle:
//   inv_freq[i] = float(1 / theta^(2i / D))               (FP64, rounded once)
//   angle       = float(pos[t]) * inv_freq[i]             (one FP32 product, as HF's matmul)
//   cos[t, i]   = float(cos(double(angle))),  sin[t, i] = float(sin(double(angle)))
// Computed on the host in FP64 so that the device only uploads it (no device libm).
struct RopeTableArgs {
  int64_t tokens = 0;                  // T
  int64_t head_dim = 0;                // D, even
  double theta = 1e6;                  // rope_theta
  const int32_t* positions = nullptr;  // (T) in [0, 2^24)
  float* cos = nullptr;                // (T, D/2)
  float* sin = nullptr;                // (T, D/2)
};

// Apply, per token t, head h, i < D/2, with c = cos[t, i], s = sin[t, i], a = in[i], b = in[i+D/2]:
//   forward:  out[i] = a * c - b * s,   out[i + D/2] = b * c + a * s
//   backward: the inverse (= transposed) rotation applied to dout:
//             din[i] = a * c + b * s,   din[i + D/2] = b * c - a * s   (a, b read from dout)
// in and out may be the same buffer (each pair is read before it is written).
struct RopeArgs {
  int64_t tokens = 0;         // T (= B * S)
  int64_t heads = 0;          // number of heads in the layout (Hq for q, Hkv for k)
  int64_t head_dim = 0;       // D, even
  const float* cos = nullptr;  // (T, D/2) from rope_table
  const float* sin = nullptr;  // (T, D/2)
  const float* in = nullptr;   // (T, heads, D): x forward, dout backward
  float* out = nullptr;        // (T, heads, D): y forward, din backward
};

// ---- causal GQA attention core, BF16 operands, optional document mask -------------------------
//
// q (B, S, Hq, D), k / v (B, S, Hkv, D) BF16 -> o (B, S, Hq, D) BF16 and lse (B, Hq, S) FP32.
// Query head h reads KV head g = h / (Hq / Hkv) (HF repeat_kv). scale is the caller's (HF:
// float(hd^-0.5)). Key j is visible to query i of row b iff doc_start[b, i] <= j <= i, where
// doc_start (B, S) is the first position of token i's document (null: 0, plain causal; the caller
// keeps doc_start[b, i] <= i and nondecreasing along a row). On the BF16 values as reals:
//   s_ij = scale * (q_i . k_j);   lse_i = ln sum_j exp(s_ij);   o_i = sum_j exp(s_ij - lse_i) v_j
// with j over the visible keys; o is rounded to BF16 (RNE).
// CPU (the reference): exact FP32 in a fixed order, for visible j ascending:
//   s_j = (R32 sum_d q_i[d] * k_j[d]) * scale;  m = max_j s_j (sequential);  p_j = moe_exp_f32(s_j - m)
//   l = R32 sum_j p_j;  o_i[d] = bf16((R32 sum_j p_j * v_j[d]) / l);  lse_i = m + model_log_f32(l)
// CUDA: tensor cores with FP32 accumulation (backend/cuda/flash_attention_sm90.h), deterministic
// and batch-invariant (a row's outputs depend on that row's inputs only), within the bound its
// test states of the FP64 value. Memory: never (S, S).
struct AttentionArgs {
  int64_t batch = 0;     // B
  int64_t seq = 0;       // S
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;  // D
  float scale = 0.0f;
  const uint16_t* q = nullptr;         // (B, S, Hq, D) BF16
  const uint16_t* k = nullptr;         // (B, S, Hkv, D) BF16
  const uint16_t* v = nullptr;         // (B, S, Hkv, D) BF16
  const int32_t* doc_start = nullptr;  // (B, S) or null (causal)
  uint16_t* o = nullptr;               // (B, S, Hq, D) BF16
  float* lse = nullptr;                // (B, Hq, S) kept for the backward
};

// Inference: Sq new queries of ONE sequence over its KV cache (src/nn/kv_cache.h), the Skv >= Sq
// cached keys including the new ones. Query i sits at position p_i = Skv - Sq + i and sees keys
// j <= p_i (causal). q (Sq, Hq, D), k / v (Skv, Hkv, D) BF16 (the cache's first Skv rows) -> o
// (Sq, Hq, D) BF16; head h reads KV head h / (Hq / Hkv). Every backend computes exactly the CPU
// attention's arithmetic above for a row (s_j, m, p_j, l, o_i; no lse), so a query's output is
// bitwise the output AttentionArgs gives its row in the whole sequence (B = 1, S = Skv).
struct AttentionKvArgs {
  int64_t queries = 0;   // Sq >= 1
  int64_t keys = 0;      // Skv >= Sq
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;  // D
  float scale = 0.0f;
  const uint16_t* q = nullptr;  // (Sq, Hq, D) BF16
  const uint16_t* k = nullptr;  // (Skv, Hkv, D) BF16
  const uint16_t* v = nullptr;  // (Skv, Hkv, D) BF16
  uint16_t* o = nullptr;        // (Sq, Hq, D) BF16
};

// Backward, dq / dk / dv (FP32) overwritten, for the visible pairs (i, j):
//   P_ij = exp(s_ij - lse_i);  dP_ij = dout_i . v_j;  Dl_i = dout_i . o_i  (o as the forward wrote it)
//   dS_ij = P_ij (dP_ij - Dl_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum dS_ij q_i;  dv_j = sum P_ij dout_i
// where dk_j and dv_j sum over every query head of KV head g and every query i that sees j.
// CPU: the same FP32 arithmetic as the forward (P_ij = moe_exp_f32(s_ij - lse_i), R32 dot
// products and sums; dk / dv pairs (h, i) in h ascending, then i ascending).
struct AttentionBackwardArgs {
  int64_t batch = 0;     // B
  int64_t seq = 0;       // S
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv
  int64_t head_dim = 0;  // D
  float scale = 0.0f;
  const uint16_t* q = nullptr;         // (B, S, Hq, D) BF16
  const uint16_t* k = nullptr;         // (B, S, Hkv, D) BF16
  const uint16_t* v = nullptr;         // (B, S, Hkv, D) BF16
  const uint16_t* o = nullptr;         // (B, S, Hq, D) BF16, the forward's output
  const float* lse = nullptr;          // (B, Hq, S)
  const int32_t* doc_start = nullptr;  // (B, S) or null, as in the forward
  const uint16_t* dout = nullptr;      // (B, S, Hq, D) BF16
  float* dq = nullptr;                 // (B, S, Hq, D)
  float* dk = nullptr;                 // (B, S, Hkv, D)
  float* dv = nullptr;                 // (B, S, Hkv, D)
};

// ---- cross-entropy over one chunk of logits, forward and backward in one pass ---------------------
//
// targets[t] is the label of the NEXT position (the caller shifts: targets[t] = labels[t + 1], the
// last position -100). A target equal to ignore_index is skipped; any other outside [0, V) is a
// Status error (checked before anything is written). The call covers any T rows (the LM head
// passes one chunk of tokens, nn/lm_head_loss.h); the batch-wide scale g = dloss / float(n), n the
// non-ignored targets of the whole batch, is the caller's (0 when n = 0). Per token t with
// z = logits[t]:
//   m          = max_e z[e] (sequential);  s = R32 sum_e moe_exp_f32(z[e] - m)
//   loss[t]    = model_log_f32(s) - (z[target] - m)        (+0 for an ignored token)
//   dlogits[t, e] = bf16((moe_exp_f32(z[e] - m) / s - [e == target]) * g)   (+0 rows if ignored)
// dlogits may be null (evaluation: the loss only). CPU: exactly this. CUDA (one row per CTA, one
// read of the row for m, s and the target logit, a second to write dlogits): m and s by an online
// max / rescaled sum over fixed thread strides and a fixed tree, the hardware exp and a reciprocal
// of s, so deterministic and row-local (batch-invariant) but not the CPU's bits: the loss within
// 1e-5 of it and each dlogit within one BF16 ulp (tests/cuda/test_cuda_model_ops.cpp).
struct CrossEntropyArgs {
  int64_t tokens = 0;  // T (rows of this call)
  int64_t vocab = 0;   // V
  int32_t ignore_index = -100;
  float grad_scale = 0.0f;           // g
  const float* logits = nullptr;     // (T, V)
  const int32_t* targets = nullptr;  // (T)
  float* loss = nullptr;             // (T) per token
  uint16_t* dlogits = nullptr;       // (T, V) BF16, or null
};

// The batch's loss from the per-token losses of every chunk: with n = valid (the non-ignored
// targets, counted by the caller),
//   loss = (R32 sum_t token_loss[t]) / float(n),  or +0 when n = 0 (an all-padding batch gives no
//          gradient instead of NaN). Every backend: exactly this.
struct CrossEntropyMeanArgs {
  int64_t tokens = 0;                  // T (the whole batch)
  int64_t valid = 0;                   // n, 0 <= n <= T
  const float* token_loss = nullptr;   // (T)
  float* loss = nullptr;               // (1,)
};

// ---- argument checks (shapes, pointers; touch no memory) ---------------------------------------
Status validate_embedding(const EmbeddingArgs& a);
Status validate_embedding_backward(const EmbeddingBackwardArgs& a);
Status validate_rms_norm(const RmsNormArgs& a);
Status validate_rms_norm_backward(const RmsNormBackwardArgs& a);
Status validate_rope_table(const RopeTableArgs& a);
Status validate_rope(const RopeArgs& a);
Status validate_attention(const AttentionArgs& a);
Status validate_attention_backward(const AttentionBackwardArgs& a);
Status validate_attention_kv(const AttentionKvArgs& a);
Status validate_cross_entropy(const CrossEntropyArgs& a);
Status validate_cross_entropy_mean(const CrossEntropyMeanArgs& a);

// The host RoPE table (backend/ops/model.cpp): validates, then errors for a position outside
// [0, 2^24).
Status rope_table(const RopeTableArgs& a);

// ---- CPU reference (backend/cpu/model_ops_cpu.cpp): host pointers, OpenMP over rows / heads -----
// Each validates its arguments first; ids and targets (data) are range-checked with a Status error
// before any output is written.
Status embedding_cpu(const EmbeddingArgs& a);
Status embedding_backward_cpu(const EmbeddingBackwardArgs& a);
Status rms_norm_cpu(const RmsNormArgs& a);
Status rms_norm_backward_cpu(const RmsNormBackwardArgs& a);
Status rope_cpu(const RopeArgs& a);
Status rope_backward_cpu(const RopeArgs& a);  // in = dout, out = din
Status attention_cpu(const AttentionArgs& a);
Status attention_backward_cpu(const AttentionBackwardArgs& a);
Status attention_kv_cpu(const AttentionKvArgs& a);  // backend/cpu/attention_kv_cpu.cpp
Status cross_entropy_cpu(const CrossEntropyArgs& a);
Status cross_entropy_mean_cpu(const CrossEntropyMeanArgs& a);

// ---- entries: validate once, then run the backend's implementation (backend/ops/model.cpp) --------
class Backend;
namespace ops {
Status embedding(Backend& b, const EmbeddingArgs& a);
Status embedding_backward(Backend& b, const EmbeddingBackwardArgs& a);
Status rms_norm(Backend& b, const RmsNormArgs& a);
Status rms_norm_backward(Backend& b, const RmsNormBackwardArgs& a);
Status rope(Backend& b, const RopeArgs& a);
Status rope_backward(Backend& b, const RopeArgs& a);
Status attention(Backend& b, const AttentionArgs& a);
Status attention_backward(Backend& b, const AttentionBackwardArgs& a);
Status attention_kv(Backend& b, const AttentionKvArgs& a);
Status cross_entropy(Backend& b, const CrossEntropyArgs& a);
Status cross_entropy_mean(Backend& b, const CrossEntropyMeanArgs& a);
}  // namespace ops

// One device's implementation of the family; every pointer is set (backend/cpu/cpu_kernels.cpp,
// backend/cuda/cuda_kernels.cu). Arguments arrive validated.
struct ModelKernels {
  Status (*embedding)(Backend&, const EmbeddingArgs&);
  Status (*embedding_backward)(Backend&, const EmbeddingBackwardArgs&);
  Status (*rms_norm)(Backend&, const RmsNormArgs&);
  Status (*rms_norm_backward)(Backend&, const RmsNormBackwardArgs&);
  Status (*rope)(Backend&, const RopeArgs&);
  Status (*rope_backward)(Backend&, const RopeArgs&);
  Status (*attention)(Backend&, const AttentionArgs&);
  Status (*attention_backward)(Backend&, const AttentionBackwardArgs&);
  Status (*cross_entropy)(Backend&, const CrossEntropyArgs&);
  Status (*cross_entropy_mean)(Backend&, const CrossEntropyMeanArgs&);
  Status (*attention_kv)(Backend&, const AttentionKvArgs&);
};

}  // namespace packmoe
