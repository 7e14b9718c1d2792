// The dense decoder op family (backend/ops/model.h): argument checks shared by every backend, the
// ops:: entries and the host RoPE table. Checks read only the structs, never the memory they point
// to; the table is computed in FP64 on the host, so every backend uploads the same bits.
#include "backend/ops/model.h"

#include <climits>
#include <cmath>
#include <string>

#include "backend/arg_checks.h"
#include "backend/backend.h"

namespace packmoe {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

Status check_pos(const char* op, int64_t v, const char* name) {
  if (v <= 0)
    return Status::error(std::string(op) + ": " + name + " must be positive, got " + num(v));
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

// What the attention forward and backward both take: the dimensions, and q, k, v, o, lse (the
// forward's outputs are the backward's inputs).
template <typename Args>
Status check_attention(const char* op, const Args& a) {
  PACKMOE_RETURN_IF_ERROR(
      check_attention_dims(op, a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim, a.scale));
  return require_non_null(op, {{a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.o, "o"}, {a.lse, "lse"}});
}

// The embedding's (T, V, H), forward and backward.
Status check_embedding_dims(const char* op, int64_t tokens, int64_t vocab, int64_t hidden) {
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, vocab));
  return check_pos(op, hidden, "H (hidden)");
}

// RMSNorm's (N, D), forward and backward.
Status check_norm_dims(const char* op, int64_t rows, int64_t dim) {
  PACKMOE_RETURN_IF_ERROR(check_pos(op, rows, "N (rows)"));
  return check_tokens(op, dim, "D (dim)");
}

}  // namespace

// Forward and backward check the same dimensions (the helpers above) and different pointers: the
// lists of what may not be null differ by design.
Status validate_embedding(const EmbeddingArgs& a) {
  constexpr const char* op = "embedding";
  PACKMOE_RETURN_IF_ERROR(check_embedding_dims(op, a.tokens, a.vocab, a.hidden));
  return require_non_null(op, {{a.ids, "ids"}, {a.table, "table"}, {a.out, "out"}});
}

Status validate_embedding_backward(const EmbeddingBackwardArgs& a) {
  constexpr const char* op = "embedding_backward";
  PACKMOE_RETURN_IF_ERROR(check_embedding_dims(op, a.tokens, a.vocab, a.hidden));
  return require_non_null(op, {{a.ids, "ids"}, {a.dout, "dout"}, {a.dtable, "dtable"}});
}

Status validate_rms_norm(const RmsNormArgs& a) {
  constexpr const char* op = "rms_norm";
  PACKMOE_RETURN_IF_ERROR(check_norm_dims(op, a.rows, a.dim));
  if (!std::isfinite(a.eps) || a.eps < 0.0f)
    return Status::error(std::string(op) + ": eps must be finite and >= 0, got " +
                         std::to_string(a.eps));
  if ((a.y == nullptr) == (a.y_bf16 == nullptr))
    return Status::error(std::string(op) + ": set exactly one of y (F32) and y_bf16 (BF16), got " +
                         (a.y ? "both" : "neither"));
  return require_non_null(op, {{a.x, "x"}, {a.weight, "weight"}, {a.rstd, "rstd"}});
}

Status validate_rms_norm_backward(const RmsNormBackwardArgs& a) {
  constexpr const char* op = "rms_norm_backward";
  PACKMOE_RETURN_IF_ERROR(check_norm_dims(op, a.rows, a.dim));
  return require_non_null(op, {{a.x, "x"},
                               {a.weight, "weight"},
                               {a.rstd, "rstd"},
                               {a.dy, "dy"},
                               {a.dx, "dx"},
                               {a.dweight, "dweight"}});
}

Status validate_rope_table(const RopeTableArgs& a) {
  constexpr const char* op = "rope_table";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_head_dim_even(op, a.head_dim));
  if (!std::isfinite(a.theta) || a.theta <= 1.0)
    return Status::error(std::string(op) + ": theta must be finite and > 1, got " +
                         std::to_string(a.theta));
  return require_non_null(op, {{a.positions, "positions"}, {a.cos, "cos"}, {a.sin, "sin"}});
}

Status validate_rope(const RopeArgs& a) {
  constexpr const char* op = "rope";
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.heads, "heads"));
  PACKMOE_RETURN_IF_ERROR(check_head_dim_even(op, a.head_dim));
  return require_non_null(op, {{a.cos, "cos"}, {a.sin, "sin"}, {a.in, "in"}, {a.out, "out"}});
}

Status validate_attention(const AttentionArgs& a) { return check_attention("attention", a); }

Status validate_attention_backward(const AttentionBackwardArgs& a) {
  constexpr const char* op = "attention_backward";
  PACKMOE_RETURN_IF_ERROR(check_attention(op, a));
  return require_non_null(op, {{a.dout, "dout"}, {a.dq, "dq"}, {a.dk, "dk"}, {a.dv, "dv"}});
}

Status validate_attention_kv(const AttentionKvArgs& a) {
  constexpr const char* op = "attention_kv";
  PACKMOE_RETURN_IF_ERROR(
      check_attention_dims(op, 1, a.keys, a.q_heads, a.kv_heads, a.head_dim, a.scale));
  PACKMOE_RETURN_IF_ERROR(check_pos(op, a.queries, "Sq (queries)"));
  if (a.queries > a.keys)
    return Status::error(std::string(op) + ": Sq = " + num(a.queries) +
                         " new queries need at least as many keys, got Skv = " + num(a.keys));
  return require_non_null(op, {{a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.o, "o"}});
}

Status validate_cross_entropy(const CrossEntropyArgs& a) {
  constexpr const char* op = "cross_entropy";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  PACKMOE_RETURN_IF_ERROR(check_vocab(op, a.vocab));
  if (!std::isfinite(a.grad_scale))
    return Status::error(std::string(op) + ": grad_scale must be finite, got " +
                         std::to_string(a.grad_scale));
  return require_non_null(op, {{a.logits, "logits"}, {a.targets, "targets"}, {a.loss, "loss"}});
}

Status validate_cross_entropy_mean(const CrossEntropyMeanArgs& a) {
  constexpr const char* op = "cross_entropy_mean";
  PACKMOE_RETURN_IF_ERROR(check_tokens(op, a.tokens, "T (tokens)"));
  if (a.valid < 0 || a.valid > a.tokens)
    return Status::error(std::string(op) + ": valid = " + num(a.valid) + " outside [0, T = " +
                         num(a.tokens) + "]");
  return require_non_null(op, {{a.token_loss, "token_loss"}, {a.loss, "loss"}});
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

// ---- entries -------------------------------------------------------------------------------
namespace ops {

Status embedding(Backend& b, const EmbeddingArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_embedding(a));
  return b.kernels().model->embedding(b, a);
}

Status embedding_backward(Backend& b, const EmbeddingBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_embedding_backward(a));
  return b.kernels().model->embedding_backward(b, a);
}

Status rms_norm(Backend& b, const RmsNormArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_rms_norm(a));
  return b.kernels().model->rms_norm(b, a);
}

Status rms_norm_backward(Backend& b, const RmsNormBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_rms_norm_backward(a));
  return b.kernels().model->rms_norm_backward(b, a);
}

Status rope(Backend& b, const RopeArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_rope(a));
  return b.kernels().model->rope(b, a);
}

Status rope_backward(Backend& b, const RopeArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_rope(a));
  return b.kernels().model->rope_backward(b, a);
}

Status attention(Backend& b, const AttentionArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_attention(a));
  return b.kernels().model->attention(b, a);
}

Status attention_backward(Backend& b, const AttentionBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_attention_backward(a));
  return b.kernels().model->attention_backward(b, a);
}

Status attention_kv(Backend& b, const AttentionKvArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_attention_kv(a));
  return b.kernels().model->attention_kv(b, a);
}

Status cross_entropy(Backend& b, const CrossEntropyArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_cross_entropy(a));
  return b.kernels().model->cross_entropy(b, a);
}

Status cross_entropy_mean(Backend& b, const CrossEntropyMeanArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_cross_entropy_mean(a));
  return b.kernels().model->cross_entropy_mean(b, a);
}

}  // namespace ops

}  // namespace packmoe
