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

Tensor DecoderLayer::forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope) {
  Backend& b = *backend_;
  Tensor h = clone(b, x);
  add_into(b, h, attention_.forward(to_bf16(b, input_norm_.forward(x)), batch, seq, rope));
  return mlp_residual(h);
}

Tensor DecoderLayer::mlp_residual(const Tensor& h) {
  Backend& b = *backend_;
  const Tensor n = to_bf16(b, post_norm_.forward(h));
  Tensor out = clone(b, h);
  add_into(b, out, moe_ ? moe_->forward(n) : mlp_->forward(n));
  return out;
}

Tensor DecoderLayer::backward(const Tensor& dy, float loss_scale) {
  Backend& b = *backend_;
  const Tensor dn = moe_ ? moe_->backward(dy, GradAccum::kAccumulate, loss_scale)
                         : mlp_->backward(dy);
  Tensor dh = clone(b, dy);
  add_into(b, dh, post_norm_.backward(dn));
  Tensor dx = clone(b, dh);
  add_into(b, dx, input_norm_.backward(attention_.backward(dh)));
  return dx;
}

}  // namespace packmoe
