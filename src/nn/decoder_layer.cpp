// DecoderLayer forward / backward: two pre-norm residual blocks.
#include "nn/decoder_layer.h"

#include "nn/layer_ops.h"

namespace packmoe {

DecoderLayer::DecoderLayer(Backend& backend, const AttentionShape& attention, float norm_eps,
                           Layout layout, bool grad_accum_fusion, const MoEBlockConfig* moe,
                           const DecoderLayerInit& init)
    : backend_(&backend),
      input_norm_(backend, layout, norm_eps, init.input_norm),
      attention_(backend, attention, layout, grad_accum_fusion, init.attention),
      post_norm_(backend, layout, norm_eps, init.post_norm) {
  if (moe)
    moe_ = std::make_unique<MoEBlock>(backend, *moe, init.moe);
  else
    mlp_ = std::make_unique<DenseMlp>(backend, layout, grad_accum_fusion, init.mlp_gate_up,
                                      init.mlp_down);
}

void DecoderLayer::set_recompute(Recompute mode) {
  recompute_ = mode;
  const bool selective = mode == Recompute::kSelective;
  attention_.set_recompute_core(selective);
  if (moe_)
    moe_->set_recompute_swiglu(selective);
  else
    mlp_->set_recompute_swiglu(selective);
}

Tensor DecoderLayer::forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope) {
  Tensor out = run_forward(x, batch, seq, rope, false);
  if (recompute_ == Recompute::kFull) {
    x_ = x;  // never written in place (the invariant above), so kept by reference
    batch_ = batch;
    seq_ = seq;
    rope_ = rope;
    input_norm_.release();
    attention_.release();
    post_norm_.release();
    if (moe_)
      moe_->release();
    else
      mlp_->release();
  }
  return out;
}

Tensor DecoderLayer::run_forward(const Tensor& x, int64_t batch, int64_t seq,
                                 const PositionTables& rope, bool recomputed) {
  // Each sum is a new tensor (layer_ops.h add): x and h stay as the norms saved them.
  const Tensor h =
      add(*backend_, x, attention_.forward(input_norm_.forward_bf16(x), batch, seq, rope));
  return mlp_residual(h, recomputed);
}

Tensor DecoderLayer::mlp_residual(const Tensor& h, bool recomputed) {
  const Tensor n = post_norm_.forward_bf16(h);
  return add(*backend_, h, moe_ ? moe_->forward(n, recomputed) : mlp_->forward(n));
}

Tensor DecoderLayer::backward(const Tensor& dy, float loss_scale) {
  if (recompute_ == Recompute::kFull) {
    PACKMOE_CHECK(x_.data() != nullptr, "DecoderLayer backward without a forward");
    run_forward(x_, batch_, seq_, rope_, true);  // the output is the forward's: not needed
    x_ = Tensor{};
    rope_ = PositionTables{};
  }
  const Tensor dn = moe_ ? moe_->backward(dy, GradAccum::kAccumulate, loss_scale)
                         : mlp_->backward(dy);
  // Each residual's gradient is added by the norm's backward (dh = dy + post_norm'(dn)).
  const Tensor dh = post_norm_.backward(dn, dy);
  return input_norm_.backward(attention_.backward(dh), dh);
}

}  // namespace packmoe
