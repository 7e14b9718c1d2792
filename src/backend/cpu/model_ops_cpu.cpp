// CPU reference of the dense decoder ops (backend/ops/model.h). OpenMP splits work by row, head,
// column or KV position only; every reduction runs inside one iteration in the order backend/ops/model.h
// defines, so the bits never depend on the thread count.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/ops/model.h"
#include "backend/reduce_order.h"

namespace packmoe {
namespace {

// R32 sums of D-vectors: term n adds w_n * x_n[d] into lane n % 32 of every d, then the same tree.
class SumR32Vec {
 public:
  explicit SumR32Vec(int64_t dim) : dim_(dim), lane_(kMoeReduceLanes * dim) {}
  void reset() { std::fill(lane_.begin(), lane_.end(), 0.0f); }
  void add(int64_t n, float w, const float* x) {  // x (D)
    float* l = lane_.data() + (n % kMoeReduceLanes) * dim_;
    for (int64_t d = 0; d < dim_; ++d) l[d] = l[d] + w * x[d];
  }
  // The tree over lanes per d; returns the (D) sums (valid until the next reset / add).
  const float* finish() {
    for (int off = kMoeReduceLanes / 2; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l)
        for (int64_t d = 0; d < dim_; ++d)
          lane_[l * dim_ + d] = lane_[l * dim_ + d] + lane_[(l + off) * dim_ + d];
    return lane_.data();
  }

 private:
  int64_t dim_;
  std::vector<float> lane_;  // (32, D)
};

float dot_r32(const float* a, const float* b, int64_t n) {
  return sum_r32(n, [&](int64_t i) { return a[i] * b[i]; });
}

// Offsets into (B, S, H, D) and (B, H, S).
struct AttnLayout {
  int64_t S, Hq, Hkv, D, group;
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * Hq + h) * D; }
  int64_t kv(int64_t b, int64_t j, int64_t g) const { return ((b * S + j) * Hkv + g) * D; }
  int64_t row(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * S + i; }
};

Status check_ids(const char* op, const int32_t* ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = 0; t < tokens; ++t)
    if (ids[t] < 0 || ids[t] >= vocab)
      return Status::error(std::string(op) + ": token id " + std::to_string(ids[t]) +
                           " at position " + std::to_string(t) + " outside [0, " +
                           std::to_string(vocab) + ")");
  return Status::ok();
}

// n = #non-ignored, after checking every other target is in [0, V).
Result<int64_t> count_targets(const char* op, const int32_t* targets, int64_t tokens,
                              int64_t vocab, int32_t ignore_index) {
  int64_t n = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (targets[t] == ignore_index) continue;
    if (targets[t] < 0 || targets[t] >= vocab)
      return Status::error(std::string(op) + ": target " + std::to_string(targets[t]) +
                           " at position " + std::to_string(t) + " outside [0, " +
                           std::to_string(vocab) + ") and not the ignore index " +
                           std::to_string(ignore_index));
    ++n;
  }
  return n;
}

}  // namespace

Status embedding_cpu(const EmbeddingArgs& a) {
  PACKMOE_RETURN_IF_ERROR(check_ids("embedding", a.ids, a.tokens, a.vocab));
  const int64_t H = a.hidden;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* src = a.table + static_cast<int64_t>(a.ids[t]) * H;  // (H)
    float* dst = a.out + t * H;                                       // (H)
    for (int64_t h = 0; h < H; ++h) dst[h] = src[h];
  }
  return Status::ok();
}

Status embedding_backward_cpu(const EmbeddingBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(check_ids("embedding_backward", a.ids, a.tokens, a.vocab));
  const int64_t H = a.hidden, T = a.tokens;
  // The token positions grouped by id, ascending t inside each id (a stable sort by id).
  std::vector<int64_t> order(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return a.ids[x] < a.ids[y]; });
  std::vector<int64_t> starts;  // first position of each id's segment in `order`
  for (int64_t p = 0; p < T; ++p)
    if (p == 0 || a.ids[order[p]] != a.ids[order[p - 1]]) starts.push_back(p);
  const int64_t segments = static_cast<int64_t>(starts.size());
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < segments; ++g) {
    const int64_t p0 = starts[g], p1 = g + 1 < segments ? starts[g + 1] : T;
    float* dst = a.dtable + static_cast<int64_t>(a.ids[order[p0]]) * H;  // (H)
    for (int64_t h = 0; h < H; ++h) {
      float s = 0.0f;
      for (int64_t p = p0; p < p1; ++p) s = s + a.dout[order[p] * H + h];
      dst[h] = dst[h] + s;
    }
  }
  return Status::ok();
}

Status rms_norm_cpu(const RmsNormArgs& a) {
  const int64_t D = a.dim;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = a.x + r * D;  // (D)
    const float ss = dot_r32(x, x, D);
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(D) + a.eps);
    a.rstd[r] = rstd;
    if (a.y) {
      float* y = a.y + r * D;  // (D)
      for (int64_t d = 0; d < D; ++d) y[d] = (x[d] * rstd) * a.weight[d];
    } else {
      uint16_t* y = a.y_bf16 + r * D;  // (D)
      for (int64_t d = 0; d < D; ++d) y[d] = f32_to_bf16((x[d] * rstd) * a.weight[d]);
    }
  }
  return Status::ok();
}

Status rms_norm_backward_cpu(const RmsNormBackwardArgs& a) {
  const int64_t D = a.dim;
#pragma omp parallel
  {
    std::vector<float> g(D), n(D);  // (D) dy * weight and the normalised row
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const float* x = a.x + r * D;    // (D)
      const float* dy = a.dy + r * D;  // (D)
      float* dx = a.dx + r * D;        // (D)
      const float rstd = a.rstd[r];
      for (int64_t d = 0; d < D; ++d) {
        n[d] = x[d] * rstd;
        g[d] = dy[d] * a.weight[d];
      }
      const float c = dot_r32(g.data(), n.data(), D) / static_cast<float>(D);
      if (a.dresidual) {
        const float* dres = a.dresidual + r * D;  // (D)
        for (int64_t d = 0; d < D; ++d) {
          const float t = (g[d] - n[d] * c) * rstd;  // rounded to FP32 before the add
          dx[d] = dres[d] + t;
        }
      } else {
        for (int64_t d = 0; d < D; ++d) dx[d] = (g[d] - n[d] * c) * rstd;
      }
    }
  }
  // dweight: one column per iteration, rows in the blocked R32 order (strided reads; a reference
  // only).
#pragma omp parallel for schedule(static)
  for (int64_t d = 0; d < D; ++d)
    a.dweight[d] = sum_blocked_r32(a.rows, [&](int64_t r) {
      return a.dy[r * D + d] * (a.x[r * D + d] * a.rstd[r]);
    });
  return Status::ok();
}

namespace {
// Rotate every (token, head) pair by +angle (sign = 1) or -angle (sign = -1, the backward).
Status rope_apply(const RopeArgs& a, bool inverse) {
  const int64_t D = a.head_dim, half = D / 2, NH = a.heads;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* cs = a.cos + t * half;  // (D/2)
    const float* sn = a.sin + t * half;  // (D/2)
    for (int64_t h = 0; h < NH; ++h) {
      const float* in = a.in + (t * NH + h) * D;  // (D)
      float* out = a.out + (t * NH + h) * D;      // (D)
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = in[i], x1 = in[i + half], c = cs[i], s = sn[i];
        if (!inverse) {
          out[i] = x0 * c - x1 * s;
          out[i + half] = x1 * c + x0 * s;
        } else {
          out[i] = x0 * c + x1 * s;
          out[i + half] = x1 * c - x0 * s;
        }
      }
    }
  }
  return Status::ok();
}
}  // namespace

Status rope_cpu(const RopeArgs& a) { return rope_apply(a, false); }
Status rope_backward_cpu(const RopeArgs& a) { return rope_apply(a, true); }

namespace {
// FP32 copy of n BF16 values (exact).
std::vector<float> widen_bf16(const uint16_t* x, int64_t n) {
  std::vector<float> out(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
  return out;
}

// First key position query i of row b sees.
int64_t first_key(const int32_t* doc_start, int64_t S, int64_t b, int64_t i) {
  return doc_start == nullptr ? 0 : doc_start[b * S + i];
}
}  // namespace

Status attention_cpu(const AttentionArgs& a) {
  const AttnLayout L{a.seq, a.q_heads, a.kv_heads, a.head_dim, a.q_heads / a.kv_heads};
  const int64_t S = a.seq, D = a.head_dim, rows = a.batch * a.q_heads * S;
  const std::vector<float> qf = widen_bf16(a.q, a.batch * S * a.q_heads * D);   // (B, S, Hq, D)
  const std::vector<float> kf = widen_bf16(a.k, a.batch * S * a.kv_heads * D);  // (B, S, Hkv, D)
  const std::vector<float> vf = widen_bf16(a.v, a.batch * S * a.kv_heads * D);  // (B, S, Hkv, D)
#pragma omp parallel
  {
    std::vector<float> p(S);  // (S) scores, then exponentials, of one query row
    SumR32Vec acc(D);
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / (a.q_heads * S), h = (r / S) % a.q_heads, i = r % S;
      const int64_t g = h / L.group, j0 = first_key(a.doc_start, S, b, i), n = i + 1 - j0;
      const float* q = qf.data() + L.q(b, i, h);  // (D)
      for (int64_t j = j0; j <= i; ++j)
        p[j - j0] = dot_r32(q, kf.data() + L.kv(b, j, g), D) * a.scale;
      float m = p[0];
      for (int64_t j = 1; j < n; ++j) m = p[j] > m ? p[j] : m;
      for (int64_t j = 0; j < n; ++j) p[j] = moe_exp_f32(p[j] - m);
      const float l = sum_r32(n, [&](int64_t j) { return p[j]; });
      acc.reset();
      for (int64_t j = 0; j < n; ++j) acc.add(j, p[j], vf.data() + L.kv(b, j0 + j, g));
      const float* sum = acc.finish();
      uint16_t* o = a.o + L.q(b, i, h);  // (D)
      for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(sum[d] / l);
      a.lse[L.row(b, h, i)] = m + model_log_f32(l);
    }
  }
  return Status::ok();
}

Status attention_backward_cpu(const AttentionBackwardArgs& a) {
  const AttnLayout L{a.seq, a.q_heads, a.kv_heads, a.head_dim, a.q_heads / a.kv_heads};
  const int64_t B = a.batch, S = a.seq, D = a.head_dim, Hq = a.q_heads, rows = B * Hq * S;
  const std::vector<float> qf = widen_bf16(a.q, B * S * Hq * D);           // (B, S, Hq, D)
  const std::vector<float> kf = widen_bf16(a.k, B * S * a.kv_heads * D);   // (B, S, Hkv, D)
  const std::vector<float> vf = widen_bf16(a.v, B * S * a.kv_heads * D);   // (B, S, Hkv, D)
  const std::vector<float> of = widen_bf16(a.o, B * S * Hq * D);           // (B, S, Hq, D)
  const std::vector<float> dof = widen_bf16(a.dout, B * S * Hq * D);       // (B, S, Hq, D)

  // P_ij and dS_ij: pointwise, so the dq loop and the dk/dv loop compute the same bits.
  std::vector<float> dl(rows);  // (B, Hq, S) Dl_i = do_i . o_i
  auto prob = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    const float s = dot_r32(qf.data() + L.q(b, i, h), kf.data() + L.kv(b, j, h / L.group), D) *
                    a.scale;
    return moe_exp_f32(s - a.lse[L.row(b, h, i)]);
  };
  auto dscore = [&](int64_t b, int64_t h, int64_t i, int64_t j, float P) {
    const float dp = dot_r32(dof.data() + L.q(b, i, h), vf.data() + L.kv(b, j, h / L.group), D);
    return P * (dp - dl[L.row(b, h, i)]);
  };

#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (Hq * S), h = (r / S) % Hq, i = r % S;
    dl[r] = dot_r32(dof.data() + L.q(b, i, h), of.data() + L.q(b, i, h), D);
  }

  // dq: one query row per iteration, its visible keys ascending.
#pragma omp parallel
  {
    SumR32Vec acc(D);
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / (Hq * S), h = (r / S) % Hq, i = r % S;
      const int64_t j0 = first_key(a.doc_start, S, b, i);
      acc.reset();
      for (int64_t j = j0; j <= i; ++j)
        acc.add(j - j0, dscore(b, h, i, j, prob(b, h, i, j)),
                kf.data() + L.kv(b, j, h / L.group));
      const float* sum = acc.finish();
      float* dq = a.dq + L.q(b, i, h);  // (D)
      for (int64_t d = 0; d < D; ++d) dq[d] = sum[d] * a.scale;
    }
  }

  // dk, dv: one (b, KV head g, key j) per iteration, pairs (h, i) in the header's order over the
  // queries that see j (i >= j inside j's document: doc_start[i] <= j).
  const int64_t kv_rows = B * a.kv_heads * S;
#pragma omp parallel
  {
    SumR32Vec acc_k(D), acc_v(D);
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < kv_rows; ++r) {
      const int64_t b = r / (a.kv_heads * S), g = (r / S) % a.kv_heads, j = r % S;
      acc_k.reset();
      acc_v.reset();
      int64_t n = 0;
      for (int64_t h = g * L.group; h < (g + 1) * L.group; ++h)
        for (int64_t i = j; i < S && first_key(a.doc_start, S, b, i) <= j; ++i, ++n) {
          const float P = prob(b, h, i, j);
          acc_k.add(n, dscore(b, h, i, j, P), qf.data() + L.q(b, i, h));
          acc_v.add(n, P, dof.data() + L.q(b, i, h));
        }
      const float* sk = acc_k.finish();
      const float* sv = acc_v.finish();
      float* dk = a.dk + L.kv(b, j, g);  // (D)
      float* dv = a.dv + L.kv(b, j, g);  // (D)
      for (int64_t d = 0; d < D; ++d) {
        dk[d] = sk[d] * a.scale;
        dv[d] = sv[d];
      }
    }
  }
  return Status::ok();
}

Status cross_entropy_cpu(const CrossEntropyArgs& a) {
  const Result<int64_t> n = count_targets("cross_entropy", a.targets, a.tokens, a.vocab,
                                          a.ignore_index);
  if (!n.is_ok()) return n.status();
  const int64_t V = a.vocab;
  const float g = a.grad_scale;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* z = a.logits + t * V;  // (V)
    const int32_t tgt = a.targets[t];
    const bool ignored = tgt == a.ignore_index;
    float m = z[0];
    for (int64_t e = 1; e < V; ++e) m = z[e] > m ? z[e] : m;
    const float s = sum_r32(V, [&](int64_t e) { return moe_exp_f32(z[e] - m); });
    a.loss[t] = ignored ? 0.0f : model_log_f32(s) - (z[tgt] - m);
    if (a.dlogits == nullptr) continue;
    uint16_t* dz = a.dlogits + t * V;  // (V)
    for (int64_t e = 0; e < V; ++e) {
      if (ignored) {
        dz[e] = 0;  // bf16 +0
        continue;
      }
      const float p = moe_exp_f32(z[e] - m) / s;
      dz[e] = f32_to_bf16((e == tgt ? p - 1.0f : p) * g);
    }
  }
  return Status::ok();
}

Status cross_entropy_mean_cpu(const CrossEntropyMeanArgs& a) {
  const float sum = sum_r32(a.tokens, [&](int64_t t) { return a.token_loss[t]; });
  *a.loss = a.valid == 0 ? 0.0f : sum / static_cast<float>(a.valid);
  return Status::ok();
}

}  // namespace packmoe
