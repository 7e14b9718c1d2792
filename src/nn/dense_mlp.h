// Dense SwiGLU MLP of Qwen3-MoE's mlp_only_layers: down(silu(gate x) * up x), with gate and up
// packed in one (2I, H) linear (gate rows first, as the experts' gate_up_proj). Invariant: the
// same ops as one expert of the MoE block (BF16 GEMMs, the swiglu op), FP32 output. With the
// SwiGLU recomputed (set_recompute_swiglu) forward keeps only its input h, not down's copy of its
// output: backward re-runs it before down's backward.
#pragma once

#include "backend/backend.h"
#include "core/tensor.h"
#include "nn/grouped_linear.h"

namespace packmoe {

class DenseMlp {
 public:
  // gate_up: (2I, H), down: (H, I), F32 host.
  DenseMlp(Backend& backend, Layout layout, bool grad_accum_fusion, const Tensor& gate_up,
           const Tensor& down);

  GroupedLinear& gate_up() { return gate_up_; }
  GroupedLinear& down() { return down_; }

  // x: (T, H) BF16. Returns (T, H) F32.
  Tensor forward(const Tensor& x);
  // dy: (T, H) F32. Returns dx (T, H) F32.
  Tensor backward(const Tensor& dy);
  // Selective recomputation (nn/recompute.h); only between a backward and the next forward.
  void set_recompute_swiglu(bool on) { recompute_swiglu_ = on; }
  // Frees everything forward kept (full recomputation: a forward runs again before backward).
  void release();

 private:
  // (T, I) BF16 = swiglu(h_), down's input.
  Tensor swiglu() const;

  Backend* backend_;
  GroupedLinear gate_up_;  // (1, 2I, H)
  GroupedLinear down_;     // (1, H, I)
  bool recompute_swiglu_ = false;
  Tensor h_;               // (T, 2I) F32, SwiGLU's input
};

}  // namespace packmoe
