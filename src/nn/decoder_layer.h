// DecoderLayer of Qwen3-MoE: h = x + Attention(RMSNorm(x)); out = h + MLP(RMSNorm(h)) with the MLP
// a MoEBlock or, on mlp_only_layers, a DenseMlp. Invariant: the residual stream is FP32 and never
// modified in place (the norms keep their inputs for backward); backward ADDS into main_grads.
// Recomputation (nn/recompute.h): full keeps only the layer's input x and re-runs the forward at
// the start of backward; selective is the attention's and the MLP's own (set_recompute_*).
#pragma once

#include <memory>

#include "nn/attention.h"
#include "nn/dense_mlp.h"
#include "nn/moe_block.h"
#include "nn/recompute.h"
#include "nn/rms_norm.h"

namespace packmoe {

struct DecoderLayerInit {
  Tensor input_norm, post_norm;  // (H)
  AttentionInit attention;
  MoEBlockInit moe;              // when the layer is MoE
  Tensor mlp_gate_up, mlp_down;  // (2I, H), (H, I) when it is dense
};

class DecoderLayer {
 public:
  // moe: the block's config when the layer is MoE, null for a dense MLP.
  DecoderLayer(Backend& backend, const AttentionShape& attention, float norm_eps, Layout layout,
               bool grad_accum_fusion, const MoEBlockConfig* moe, const DecoderLayerInit& init);

  RmsNorm& input_norm() { return input_norm_; }
  Attention& attention() { return attention_; }
  RmsNorm& post_norm() { return post_norm_; }
  MoEBlock* moe() { return moe_.get(); }    // null for a dense layer
  DenseMlp* mlp() { return mlp_.get(); }    // null for a MoE layer

  // x: (T, H) F32. Returns (T, H) F32.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope);
  // dy: (T, H) F32; loss_scale as in MoEBlock::backward. Returns dx (T, H) F32.
  Tensor backward(const Tensor& dy, float loss_scale);
  // Inference (nn/kv_cache.cpp): forward on T new tokens of one sequence after the `past` ones
  // `kv` caches (Attention::forward_cached); x (T, H) F32, returns (T, H) F32.
  Tensor forward_cached(const Tensor& x, const PositionTables& rope, LayerKv& kv, int64_t past);
  // What forward keeps for backward; only between a backward and the next forward.
  void set_recompute(Recompute mode);

 private:
  Backend* backend_;
  RmsNorm input_norm_;
  Attention attention_;
  RmsNorm post_norm_;
  std::unique_ptr<MoEBlock> moe_;
  std::unique_ptr<DenseMlp> mlp_;
  Recompute recompute_ = Recompute::kNone;
  // Saved by forward under full recomputation: the input and what the attention reads with it.
  Tensor x_;  // (T, H) F32
  int64_t batch_ = 0, seq_ = 0;
  PositionTables rope_;

  // Both residual blocks; `recomputed`: the second forward of full recomputation.
  Tensor run_forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope,
                     bool recomputed);
  // The second residual block: h + MLP(post_norm(h)), h (T, H) F32 the first block's output.
  Tensor mlp_residual(const Tensor& h, bool recomputed = false);
};

}  // namespace packmoe
