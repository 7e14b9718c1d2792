// Attention layer of Qwen3-MoE: q/k/v projections, per-head RMSNorm on q and k, rotate-half RoPE,
// causal (or document-masked) GQA attention, o projection; explicit forward / backward over ops.
// Invariant: projections are BF16 GEMMs with FP32 masters and FP32 outputs; norms and RoPE run in
// FP32; the attention core reads q, k, v as BF16 and writes its output in BF16 (o_proj's operand);
// backward ADDS every weight gradient into its main_grad. With the core recomputed
// (set_recompute_core) forward keeps q, k, v but not the core's output and lse (nor o_proj's copy
// of it): backward re-runs the core on the same q, k, v first.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/tensor.h"
#include "nn/grouped_linear.h"
#include "nn/rms_norm.h"

namespace packmoe {

struct AttentionShape {
  int64_t hidden = 0;    // H
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv
  int64_t head_dim = 0;  // D
  float eps = 1e-6f;     // q_norm / k_norm
};

struct AttentionInit {
  Tensor q, k, v, o;      // (Hq*D, H), (Hkv*D, H), (Hkv*D, H), (H, Hq*D) F32 host
  Tensor q_norm, k_norm;  // (D) F32 host
};

// What one batch's token positions give every layer, in backend memory: the RoPE table of each
// token's position and, with document masking, the first position of its document in its row.
struct PositionTables {
  Tensor cos, sin;   // (T, D/2) F32
  Tensor doc_start;  // (T) I32, or empty: every row is one causal sequence
};

struct LayerKv;  // nn/kv_cache.h

class Attention {
 public:
  Attention(Backend& backend, const AttentionShape& shape, Layout layout, bool grad_accum_fusion,
            const AttentionInit& init);

  GroupedLinear& q_proj() { return q_proj_; }
  GroupedLinear& k_proj() { return k_proj_; }
  GroupedLinear& v_proj() { return v_proj_; }
  GroupedLinear& o_proj() { return o_proj_; }
  RmsNorm& q_norm() { return q_norm_; }
  RmsNorm& k_norm() { return k_norm_; }

  // x: (T, H) BF16 with T = B * S rows of B sequences (masked as `rope.doc_start` says).
  // Returns (T, H) F32.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope);
  // dy: (T, H) F32. Returns dx (T, H) F32 (the sum over the q, k and v paths).
  Tensor backward(const Tensor& dy);
  // Selective recomputation (nn/recompute.h); only between a backward and the next forward.
  void set_recompute_core(bool on) { recompute_core_ = on; }
  // Frees everything forward kept (full recomputation: a forward runs again before backward).
  void release();
  // Inference (nn/kv_cache.cpp): x (T, H) BF16, T new tokens of one sequence at positions
  // [past, past + T) (`rope` is their table), after the `past` tokens `kv` holds. Writes their
  // K / V into rows [past, past + T) of `kv` and returns (T, H) F32, what forward gives these rows
  // of the whole sequence. Saves nothing for backward.
  Tensor forward_cached(const Tensor& x, const PositionTables& rope, LayerKv& kv, int64_t past);

 private:
  // The q, k, v of x (T, H) BF16 as the attention core reads them: (T, Hq*D), (T, Hkv*D) after
  // the norms and RoPE at the table's positions, (T, Hkv*D) as projected; BF16.
  void project(const Tensor& x, const PositionTables& rope, Tensor& q, Tensor& k, Tensor& v);
  // attn_ and lse_ from the saved q_, k_, v_ (ops::attention).
  void run_core();

  Backend* backend_;
  AttentionShape shape_;
  GroupedLinear q_proj_, k_proj_, v_proj_, o_proj_;
  RmsNorm q_norm_, k_norm_;
  bool recompute_core_ = false;

  // Saved by forward.
  int64_t batch_ = 0, seq_ = 0;
  PositionTables rope_;
  Tensor q_;     // (T, Hq*D) BF16 after q_norm and RoPE
  Tensor k_;     // (T, Hkv*D) BF16 after k_norm and RoPE
  Tensor v_;     // (T, Hkv*D) BF16 as projected
  Tensor attn_;  // (T, Hq*D) BF16 attention output (o_proj's input); recomputed: backward only
  Tensor lse_;   // (B, Hq, S) F32; likewise
};

}  // namespace packmoe
