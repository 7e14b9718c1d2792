// Attention forward / backward: the op sequence of nn/attention.h, every step one op call.
#include "nn/attention.h"

#include <cmath>

#include "nn/layer_ops.h"

namespace packmoe {
namespace {

// x (T, heads * D) F32 rotated in place by the table: forward RoPE, or its inverse (backward).
void rotate_in_place(Backend& b, const PositionTables& rope, const Tensor& x, int64_t heads, int64_t D,
                     bool inverse) {
  RopeArgs r;
  r.tokens = x.dim(0);
  r.heads = heads;
  r.head_dim = D;
  r.cos = rope.cos.data_as<const float>();
  r.sin = rope.sin.data_as<const float>();
  r.in = x.data_as<const float>();
  r.out = x.data_as<float>();
  check_op(inverse ? ops::rope_backward(b, r) : ops::rope(b, r), inverse ? "rope_backward" : "rope");
}

}  // namespace

Attention::Attention(Backend& backend, const AttentionShape& shape, Layout layout,
                     bool grad_accum_fusion, const AttentionInit& init)
    : backend_(&backend),
      shape_(shape),
      q_proj_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(init.q)),
      k_proj_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(init.k)),
      v_proj_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(init.v)),
      o_proj_(backend, dense_linear_config(layout, grad_accum_fusion), as_single_group(init.o)),
      q_norm_(backend, layout, shape.eps, init.q_norm),
      k_norm_(backend, layout, shape.eps, init.k_norm) {}

Tensor Attention::forward(const Tensor& x, int64_t batch, int64_t seq, const PositionTables& rope) {
  const int64_t T = batch * seq, H = shape_.hidden;
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(0) == T && x.dim(1) == H,
                "Attention forward: x must be (" << T << ", " << H << ") bf16, got "
                                                 << shape_string(x.shape()));
  batch_ = batch;
  seq_ = seq;
  rope_ = rope;
  project(x, rope, q_, k_, v_);
  run_core();
  Tensor y = o_proj_.forward(attn_, {T});  // (T, H)
  if (recompute_core_) {
    o_proj_.release_input();
    attn_ = lse_ = Tensor{};
  }
  return y;
}

void Attention::run_core() {
  Backend& b = *backend_;
  const int64_t T = batch_ * seq_, D = shape_.head_dim;
  const int64_t Hq = shape_.q_heads, Hkv = shape_.kv_heads;
  attn_ = Tensor::empty(b, DType::kBF16, {T, Hq * D});
  lse_ = Tensor::empty(b, DType::kF32, {batch_, Hq, seq_});
  AttentionArgs a;
  a.batch = batch_;
  a.seq = seq_;
  a.q_heads = Hq;
  a.kv_heads = Hkv;
  a.head_dim = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.q = q_.data_as<const uint16_t>();
  a.k = k_.data_as<const uint16_t>();
  a.v = v_.data_as<const uint16_t>();
  a.doc_start = rope_.doc_start.data_as<const int32_t>();  // null: causal
  a.o = attn_.data_as<uint16_t>();
  a.lse = lse_.data_as<float>();
  check_op(ops::attention(b, a), "attention");
}

void Attention::release() {
  for (GroupedLinear* l : {&q_proj_, &k_proj_, &v_proj_, &o_proj_}) l->release_input();
  q_norm_.release();
  k_norm_.release();
  q_ = k_ = v_ = attn_ = lse_ = Tensor{};
  rope_ = PositionTables{};
}

Tensor Attention::backward(const Tensor& dy) {
  Backend& b = *backend_;
  const int64_t T = batch_ * seq_, D = shape_.head_dim;
  const int64_t Hq = shape_.q_heads, Hkv = shape_.kv_heads;
  PACKMOE_CHECK(q_.data() != nullptr, "Attention backward without a forward");
  if (recompute_core_) {
    run_core();
    o_proj_.restore_input(attn_);
  }
  const Tensor dattn = o_proj_.backward(to_bf16(b, dy), GradAccum::kAccumulate);  // (T, Hq*D) F32
  const Tensor dattn_bf16 = to_bf16(b, dattn);

  const Tensor dq = Tensor::empty(b, DType::kF32, {T, Hq * D});
  const Tensor dk = Tensor::empty(b, DType::kF32, {T, Hkv * D});
  const Tensor dv = Tensor::empty(b, DType::kF32, {T, Hkv * D});
  AttentionBackwardArgs a;
  a.batch = batch_;
  a.seq = seq_;
  a.q_heads = Hq;
  a.kv_heads = Hkv;
  a.head_dim = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.q = q_.data_as<const uint16_t>();
  a.k = k_.data_as<const uint16_t>();
  a.v = v_.data_as<const uint16_t>();
  a.o = attn_.data_as<const uint16_t>();
  a.lse = lse_.data_as<const float>();
  a.doc_start = rope_.doc_start.data_as<const int32_t>();
  a.dout = dattn_bf16.data_as<const uint16_t>();
  a.dq = dq.data_as<float>();
  a.dk = dk.data_as<float>();
  a.dv = dv.data_as<float>();
  check_op(ops::attention_backward(b, a), "attention_backward");

  rotate_in_place(b, rope_, dq, Hq, D, true);  // the inverse rotation
  rotate_in_place(b, rope_, dk, Hkv, D, true);

  const Tensor dq_proj = q_norm_.backward(dq.reshaped({T * Hq, D}));   // (T*Hq, D)
  const Tensor dk_proj = k_norm_.backward(dk.reshaped({T * Hkv, D}));  // (T*Hkv, D)
  Tensor dx = q_proj_.backward(to_bf16(b, dq_proj.reshaped({T, Hq * D})), GradAccum::kAccumulate);
  add_into(b, dx,
           k_proj_.backward(to_bf16(b, dk_proj.reshaped({T, Hkv * D})), GradAccum::kAccumulate));
  add_into(b, dx, v_proj_.backward(to_bf16(b, dv), GradAccum::kAccumulate));
  q_ = k_ = v_ = attn_ = lse_ = Tensor{};
  return dx;
}

void Attention::project(const Tensor& x, const PositionTables& rope, Tensor& q_out, Tensor& k_out,
                        Tensor& v_out) {
  Backend& b = *backend_;
  const int64_t T = x.dim(0), D = shape_.head_dim;
  const int64_t Hq = shape_.q_heads, Hkv = shape_.kv_heads;
  const Tensor q = q_proj_.forward(x, {T});  // (T, Hq*D) F32
  const Tensor k = k_proj_.forward(x, {T});  // (T, Hkv*D) F32
  const Tensor v = v_proj_.forward(x, {T});  // (T, Hkv*D) F32
  const Tensor q_rot = q_norm_.forward(q.reshaped({T * Hq, D})).reshaped({T, Hq * D});
  const Tensor k_rot = k_norm_.forward(k.reshaped({T * Hkv, D})).reshaped({T, Hkv * D});

  // In place: the norm outputs are not needed again.
  rotate_in_place(b, rope, q_rot, Hq, D, false);
  rotate_in_place(b, rope, k_rot, Hkv, D, false);
  q_out = to_bf16(b, q_rot);
  k_out = to_bf16(b, k_rot);
  v_out = to_bf16(b, v);
}

}  // namespace packmoe
