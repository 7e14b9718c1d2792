// Argument checks of the dense decoder ops, shared by every backend, and the host RoPE table
// (backend/model_ops.h). Checks read only the structs, never the memory they point to; the table
// is computed in FP64 on the host, so every backend uploads the same bits.
#include "backend/model_ops.h"

#include <climits>
#include <cmath>
#include <string>

namespace packmoe {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

Status check_pos(const char* op, int64_t v, const char* name) {
  if (v <= 0)
    return Status::error(std::string(op) + ": " + name + " must be positive, got " + num(v));
  return Status::ok();
}

Status check_ptr(const char* op, const void* p, const char* name) {
  if (p == nullptr) return Status::error(std::string(op) + ": " + name + " is null");
  return Status::ok();
}

// The 2^24 bound keeps token / row counts exact in FP32 (means, positions).
Status check_tokens(const char* op, int64_t t, const char* name) {
  PACKMOE_RETURN_IF_ERROR(check_pos(op, t, name));
  if (t >= (int64_t{1} << 24))
    return Status::error(std::string(op) + ": " + name + " = " + num(t) +
                         ", at most 2^24 - 1 per call");
  return Status::ok();
}

Status check_vocab(const char* op, int64_t v) {
  PACKMOE_RETURN_IF_ERROR(check_pos(op, v, "V (vocab)"));
  if (v > INT32_MAX) return Status::error(std::string(op) + ": V = " + num(v) + " exceeds int32");
  return Status::ok();
}

Status check_head_dim_even(const char* op, int64_t d) {
  PACKMOE_RETURN_IF_ERROR(check_pos(op, d, "D (head_dim)"));
  if (d % 2 != 0)
    return Status::error(std::string(op) + ": D (head_dim) must be even for rotate-half, got " +
                         num(d));
  return Status::ok();
}

Status check_attention_dims(const char* op, int64_t b, int64_t s, int64_t hq, int64_t hkv,
                            int64_t d, float scale) {
  PACKMOE_RETURN_IF_ERROR(check_pos(op, b, "B (batch)"));
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, s, "S (seq)"));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, hq, "Hq (q_heads)"));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, hkv, "Hkv (kv_heads)"));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, d, "D (head_dim)"));
  if (hq % hkv != 0)
    return Status::error(std::string(op) + ": Hq = " + num(hq) +
                         " is not a multiple of Hkv = " + num(hkv) + " (GQA groups)");
  if (!std::isfinite(scale) || scale <= 0.0f)
    return Status::error(std::string(op) + ": scale must be finite and positive, got " +
                         std::to_string(scale));
  return Status::ok();
}

}  // namespace

Status validate_embedding(const EmbeddingArgs& a) {
  constexpr const char* op = "embedding";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, a.vocab));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.hidden, "H (hidden)"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.ids, "ids"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.table, "table"));
  return check_ptr(op, a.out, "out");
}

Status validate_embedding_backward(const EmbeddingBackwardArgs& a) {
  constexpr const char* op = "embedding_backward";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, a.vocab));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.hidden, "H (hidden)"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.ids, "ids"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dout, "dout"));
  return check_ptr(op, a.dtable, "dtable");
}

Status validate_rms_norm(const RmsNormArgs& a) {
  constexpr const char* op = "rms_norm";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.rows, "N (rows)"));
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.dim, "D (dim)"));
  if (!std::isfinite(a.eps) || a.eps < 0.0f)
    return Status::error(std::string(op) + ": eps must be finite and >= 0, got " +
                         std::to_string(a.eps));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.x, "x"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.weight, "weight"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.y, "y"));
  return check_ptr(op, a.rstd, "rstd");
}

Status validate_rms_norm_backward(const RmsNormBackwardArgs& a) {
  constexpr const char* op = "rms_norm_backward";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.rows, "N (rows)"));
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.dim, "D (dim)"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.x, "x"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.weight, "weight"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.rstd, "rstd"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dy, "dy"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dx, "dx"));
  return check_ptr(op, a.dweight, "dweight");
}

Status validate_rope_table(const RopeTableArgs& a) {
  constexpr const char* op = "rope_table";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_head_dim_even(op, a.head_dim));
  if (!std::isfinite(a.theta) || a.theta <= 1.0)
    return Status::error(std::string(op) + ": theta must be finite and > 1, got " +
                         std::to_string(a.theta));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.positions, "positions"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.cos, "cos"));
  return check_ptr(op, a.sin, "sin");
}

Status validate_rope(const RopeArgs& a) {
  constexpr const char* op = "rope";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.heads, "heads"));
  PACKMOE_RETURN_IF_ERROR(check_head_dim_even(op, a.head_dim));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.cos, "cos"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.sin, "sin"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.in, "in"));
  return check_ptr(op, a.out, "out");
}

Status validate_attention(const AttentionArgs& a) {
  constexpr const char* op = "attention";
  PACKMOE_RETURN_IF_ERROR(
      check_attention_dims(op, a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim, a.scale));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.q, "q"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.k, "k"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.v, "v"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.o, "o"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_max, "row_max"));
  return check_ptr(op, a.row_sum, "row_sum");
}

Status validate_attention_backward(const AttentionBackwardArgs& a) {
  constexpr const char* op = "attention_backward";
  PACKMOE_RETURN_IF_ERROR(
      check_attention_dims(op, a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim, a.scale));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.q, "q"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.k, "k"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.v, "v"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.o, "o"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_max, "row_max"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_sum, "row_sum"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dout, "dout"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dq, "dq"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.dk, "dk"));
  return check_ptr(op, a.dv, "dv");
}

Status validate_cross_entropy(const CrossEntropyArgs& a) {
  constexpr const char* op = "cross_entropy";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, a.vocab));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.logits, "logits"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.targets, "targets"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.loss, "loss"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_max, "row_max"));
  return check_ptr(op, a.row_sum, "row_sum");
}

Status validate_cross_entropy_backward(const CrossEntropyBackwardArgs& a) {
  constexpr const char* op = "cross_entropy_backward";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, a.vocab));
  if (!std::isfinite(a.dloss))
    return Status::error(std::string(op) + ": dloss must be finite, got " +
                         std::to_string(a.dloss));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.logits, "logits"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.targets, "targets"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_max, "row_max"));
  PACKMOE_RETURN_IF_ERROR(check_ptr(op, a.row_sum, "row_sum"));
  return check_ptr(op, a.dlogits, "dlogits");
}

Status rope_table(const RopeTableArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_rope_table(a));
  const int64_t half = a.head_dim / 2;
  for (int64_t t = 0; t < a.tokens; ++t)
    if (a.positions[t] < 0 || a.positions[t] >= (1 << 24))
      return Status::error("rope_table: position " + num(a.positions[t]) + " at token " + num(t) +
                           " outside [0, 2^24) (FP32 holds it exactly only there)");
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float pos = static_cast<float>(a.positions[t]);  // exact: < 2^24
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = static_cast<float>(
          1.0 / std::pow(a.theta, static_cast<double>(2 * i) / static_cast<double>(a.head_dim)));
      const float angle = pos * inv_freq;
      a.cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      a.sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  return Status::ok();
}

}  // namespace packmoe
