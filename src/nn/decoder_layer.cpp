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
  Backend& b = *backend_;
  Tensor h = clone(b, x);
  add_into(b, h, attention_.forward(to_bf16(b, input_norm_.forward(x)), batch, seq, rope));
  return mlp_residual(h, recomputed);
}

Tensor DecoderLayer::mlp_residual(const Tensor& h, bool recomputed) {
  Backend& b = *backend_;
  const Tensor n = to_bf16(b, post_norm_.forward(h));
  Tensor out = clone(b, h);
  add_into(b, out, moe_ ? moe_->forward(n, recomputed) : mlp_->forward(n));
  return out;
}

Tensor DecoderLayer::backward(const Tensor& dy, float loss_scale) {
  Backend& b = *backend_;
  if (recompute_ == Recompute::kFull) {
    PACKMOE_CHECK(x_.data() != nullptr, "DecoderLayer backward without a forward");
    run_forward(x_, batch_, seq_, rope_, true);  // the output is the forward's: not needed
    x_ = Tensor{};
    rope_ = PositionTables{};
  }
  const Tensor dn = moe_ ? moe_->backward(dy, GradAccum::kAccumulate, loss_scale)
                         : mlp_->backward(dy);
  Tensor dh = clone(b, dy);
  add_into(b, dh, post_norm_.backward(dn));
  Tensor dx = clone(b, dh);
  add_into(b, dx, input_norm_.backward(attention_.backward(dh)));
  return dx;
}

}  // namespace packmoe
