// FP64 reference of the whole Qwen3-MoE decoder (HF Qwen3MoeForCausalLM, as nn/model.h has it):
// the forward losses of a ModelWeights map on a Batch, in double, written from the math with no
// packmoe op; optionally with packmoe's BF16 roundings replayed as constant offsets (Bf16Rounding).
// Invariant: the losses are a smooth function of the weights while no token's top-k choice changes,
// so Losses reports every choice and the smallest top-k logit gap.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/model.h"

namespace packmoe::reference {

using Vec = std::vector<double>;
using Weights64 = std::map<std::string, Vec>;  // ModelWeights keys and shapes, row-major

inline Weights64 widen(const ModelWeights& weights) {
  Weights64 out;
  for (const auto& [name, t] : weights) {
    const float* p = t.data_as<const float>();
    out.emplace(name, Vec(p, p + t.numel()));
  }
  return out;
}

// The values packmoe's Model holds in BF16 although the math is smooth: the activation operands of
// its GEMMs (normed inputs of q/k/v, the router and experts, the dense MLP and the LM head; the
// attention core's q, k, v and output; SwiGLU outputs) and the MoE block's BF16 activations (FC1 and FC2 outputs).
// kOff: the smooth math. kRecord: each such value becomes bf16(fp32(v)) (RNE) and the offset
// bf16(fp32(v)) - v is remembered, in evaluation order. kReplay: each value gets its remembered
// offset added instead, a constant, so the loss is smooth in the weights again and its derivative
// treats rounding as the identity, as the model's backward does; this removes the forward
// roundings from a gradient comparison and leaves the backward's. Replay needs the recorded
// evaluation order, i.e. the same top-k choices.
class Bf16Rounding {
 public:
  void record() {
    mode_ = Mode::kRecord;
    offsets_.clear();
  }
  void replay() { mode_ = Mode::kReplay; }
  void start() { next_ = 0; }  // at the start of each forward
  void finish() const {
    if (mode_ == Mode::kReplay && next_ != offsets_.size())
      throw std::logic_error("Bf16Rounding: replay evaluated fewer values than were recorded");
  }

  double operator()(double v) {
    switch (mode_) {
      case Mode::kOff: return v;
      case Mode::kRecord: {
        const double r = to_bf16(v);
        offsets_.push_back(r - v);
        return r;
      }
      case Mode::kReplay: return v + offsets_.at(next_++);
    }
    return v;
  }
  Vec operator()(Vec v) {
    for (double& x : v) x = (*this)(x);
    return v;
  }

 private:
  // FP64 -> FP32 (RNE, as the model's FP32 value) -> BF16 (RNE on the upper 16 bits; finite).
  static double to_bf16(double v) {
    const float f = static_cast<float>(v);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    float r;
    std::memcpy(&r, &bits, sizeof(r));
    return r;
  }

  enum class Mode { kOff, kRecord, kReplay };
  Mode mode_ = Mode::kOff;
  std::vector<double> offsets_;
  size_t next_ = 0;
};

// y (T, N) = x (T, K) w^T for w (N, K) (a pointer, so one expert of a pack can be passed).
inline Vec linear(const Vec& x, const double* w, int64_t T, int64_t K, int64_t N) {
  Vec y(T * N);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t i = 0; i < K; ++i) acc += x[t * K + i] * w[n * K + i];
      y[t * N + n] = acc;
    }
  return y;
}

// Every row of D elements: x / sqrt(mean(x^2) + eps) * w.
inline Vec rms_norm(const Vec& x, const Vec& w, int64_t D, double eps) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / D; ++r) {
    const double* in = &x[r * D];
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += in[d] * in[d];
    const double rstd = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t d = 0; d < D; ++d) y[r * D + d] = in[d] * rstd * w[d];
  }
  return y;
}

// Rotate-half RoPE in place on x (B, S, heads, D): dimension i pairs with i + D/2 and turns by
// s * theta^(-2i/D), s the position of the row in its sequence.
inline void rope(Vec& x, int64_t B, int64_t S, int64_t heads, int64_t D, double theta) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        double* v = &x[((b * S + s) * heads + h) * D];
        for (int64_t i = 0; i < half; ++i) {
          const double angle = s * std::pow(theta, -2.0 * i / D);
          const double c = std::cos(angle), sn = std::sin(angle), a = v[i], bb = v[i + half];
          v[i] = a * c - bb * sn;
          v[i + half] = bb * c + a * sn;
        }
      }
}

// Causal softmax attention, q (B, S, Hq, D), k / v (B, S, Hkv, D) -> (B, S, Hq, D); query head h
// reads KV head h / (Hq / Hkv); scores scaled by D^-1/2.
inline Vec attention(const Vec& q, const Vec& k, const Vec& v, int64_t B, int64_t S, int64_t Hq,
                     int64_t Hkv, int64_t D) {
  Vec o(q.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      for (int64_t i = 0; i < S; ++i) {
        const double* qi = &q[((b * S + i) * Hq + h) * D];
        Vec p(i + 1);
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = &k[((b * S + j) * Hkv + g) * D];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
          p[j] = dot * scale;
        }
        const double m = *std::max_element(p.begin(), p.end());
        double sum = 0;
        for (double& x : p) sum += (x = std::exp(x - m));
        double* oi = &o[((b * S + i) * Hq + h) * D];
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < D; ++d) oi[d] += p[j] / sum * v[((b * S + j) * Hkv + g) * D + d];
      }
    }
  return o;
}

inline double silu(double g) { return g / (1.0 + std::exp(-g)); }

// down(silu(gate x) * up x) (H) for one row x (H); gate / up (F, H), down (H, F). The SwiGLU output
// goes through `bf16`; for an expert (BF16 activations) also the gate / up values and the result.
inline Vec swiglu_row(const double* x, const double* gate, const double* up, const double* down,
                      int64_t H, int64_t F, bool expert, Bf16Rounding& bf16) {
  Vec a(F);
  for (int64_t f = 0; f < F; ++f) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < H; ++h) {
      g += gate[f * H + h] * x[h];
      u += up[f * H + h] * x[h];
    }
    if (expert) {
      g = bf16(g);
      u = bf16(u);
    }
    a[f] = bf16(silu(g) * u);
  }
  Vec out(H);
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0;
    for (int64_t f = 0; f < F; ++f) acc += down[h * F + f] * a[f];
    out[h] = expert ? bf16(acc) : acc;
  }
  return out;
}

struct Losses {
  double lm = 0;     // cross-entropy, mean over the non-ignored targets
  // Hugging Face's load-balancing loss over every MoE layer's router outputs concatenated (no
  // coefficient): E * sum_e (C[e] / T') (P[e] / T'), C the routed pairs, P the probability sums and
  // T' the tokens of all MoE layers (aux_counts, aux_prob_sums, aux_tokens).
  double aux = 0;
  double total = 0;  // lm + router_aux_loss_coef * aux
  std::vector<double> aux_counts, aux_prob_sums;  // (E) over the MoE layers so far
  int64_t aux_tokens = 0;
  // Per MoE layer in order, (T, k): each token's chosen experts, ascending.
  std::vector<std::vector<int32_t>> chosen;
  // Smallest k-th minus (k+1)-th largest router logit over every MoE layer's tokens.
  double min_gap = std::numeric_limits<double>::infinity();
};

// The MoE block on x (T, H): softmax over all E router logits, top-k (probabilities descending, a
// tie to the lower expert), renormalised when norm_topk_prob; y = sum_j w_j * expert_j(x); the
// layer's routed counts and probability sums are added to `losses` (the aux loss's statistics).
inline Vec moe(const Vec& x, int64_t T, const ModelConfig& c, const Vec& router,
               const Vec& gate_up, const Vec& down, Bf16Rounding& bf16, Losses& losses) {
  const int64_t H = c.hidden_size, F = c.moe_intermediate_size, E = c.num_experts;
  const int64_t k = c.num_experts_per_tok;
  const Vec logits = linear(x, router.data(), T, H, E);  // (T, E)
  Vec y(T * H, 0.0);
  losses.aux_counts.resize(E, 0.0);
  losses.aux_prob_sums.resize(E, 0.0);
  losses.aux_tokens += T;
  std::vector<int32_t> chosen;
  for (int64_t t = 0; t < T; ++t) {
    const double* z = &logits[t * E];
    const double m = *std::max_element(z, z + E);
    Vec p(E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - m));
    for (double& v : p) v /= sum;
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    if (k < E) losses.min_gap = std::min(losses.min_gap, z[order[k - 1]] - z[order[k]]);
    // The chosen experts in ascending index order: the evaluation order (which Bf16Rounding
    // replays) then depends only on the choice, not on how the chosen ones rank among themselves.
    std::vector<int32_t> top(order.begin(), order.begin() + k);
    std::sort(top.begin(), top.end());
    double topk_sum = 0;
    for (int32_t e : top) topk_sum += p[e];
    for (int32_t e : top) {
      const double w = c.norm_topk_prob ? p[e] / topk_sum : p[e];
      const double* gu = &gate_up[e * 2 * F * H];  // gate rows [0, F), up rows [F, 2F)
      const Vec out = swiglu_row(&x[t * H], gu, gu + F * H, &down[e * H * F], H, F, true, bf16);
      for (int64_t h = 0; h < H; ++h) y[t * H + h] += w * out[h];
      losses.aux_counts[e] += 1;
    }
    for (int64_t e = 0; e < E; ++e) losses.aux_prob_sums[e] += p[e];
    chosen.insert(chosen.end(), top.begin(), top.end());
  }
  losses.chosen.push_back(std::move(chosen));
  return y;
}

// The dense SwiGLU MLP of an mlp_only layer on x (T, H): gate_up (2I, H) with gate rows [0, I)
// and up rows [I, 2I), down (H, I).
inline Vec dense_mlp(const Vec& x, int64_t T, int64_t H, int64_t I, const Vec& gate_up,
                     const Vec& down, Bf16Rounding& bf16) {
  Vec y(T * H);
  for (int64_t t = 0; t < T; ++t) {
    const Vec out = swiglu_row(&x[t * H], gate_up.data(), gate_up.data() + I * H, down.data(), H,
                               I, false, bf16);
    std::copy(out.begin(), out.end(), &y[t * H]);
  }
  return y;
}

// Mean over the targets other than -100 of log-sum-exp(z) - z[target]; 0 when all are ignored.
inline double cross_entropy(const Vec& logits, const std::vector<int32_t>& targets, int64_t V) {
  double sum = 0;
  int64_t n = 0;
  for (size_t t = 0; t < targets.size(); ++t) {
    if (targets[t] == -100) continue;
    const double* z = &logits[t * V];
    const double m = *std::max_element(z, z + V);
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
    sum += std::log(s) + m - z[targets[t]];
    ++n;
  }
  return n == 0 ? 0.0 : sum / n;
}

// x (B*S, H) + o_proj(attention(RoPE(q_norm(q)), RoPE(k_norm(k)), v)) of input_layernorm(x).
inline Vec attention_block(const Vec& x, int64_t B, int64_t S, const ModelConfig& c,
                           const Weights64& w, const std::string& p, Bf16Rounding& bf16) {
  const int64_t T = B * S, H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps;
  const Vec a = bf16(rms_norm(x, w.at(p + "input_layernorm.weight"), H, eps));
  Vec q = linear(a, w.at(p + "self_attn.q_proj.weight").data(), T, H, Hq * D);
  Vec k = linear(a, w.at(p + "self_attn.k_proj.weight").data(), T, H, Hkv * D);
  Vec v = linear(a, w.at(p + "self_attn.v_proj.weight").data(), T, H, Hkv * D);
  q = rms_norm(q, w.at(p + "self_attn.q_norm.weight"), D, eps);  // per head, before RoPE
  k = rms_norm(k, w.at(p + "self_attn.k_norm.weight"), D, eps);
  rope(q, B, S, Hq, D, c.rope_theta);
  rope(k, B, S, Hkv, D, c.rope_theta);
  // The attention core reads q, k, v in BF16 (in this order) and writes o in BF16.
  q = bf16(q);
  k = bf16(k);
  v = bf16(v);
  const Vec o = bf16(attention(q, k, v, B, S, Hq, Hkv, D));
  Vec out = linear(o, w.at(p + "self_attn.o_proj.weight").data(), T, Hq * D, H);
  for (int64_t i = 0; i < T * H; ++i) out[i] += x[i];
  return out;
}

// h (T, H) + mlp(post_attention_layernorm(h)), the MoE block or layer's dense MLP.
inline Vec mlp_block(const Vec& h, int64_t T, int64_t layer, const ModelConfig& c,
                     const Weights64& w, const std::string& p, Bf16Rounding& bf16,
                     Losses& losses) {
  const int64_t H = c.hidden_size;
  const Vec& norm = w.at(p + "post_attention_layernorm.weight");
  const Vec a = bf16(rms_norm(h, norm, H, c.rms_norm_eps));
  Vec out = c.is_moe_layer(layer)
                ? moe(a, T, c, w.at(p + "mlp.gate.weight"), w.at(p + "mlp.experts.gate_up_proj"),
                      w.at(p + "mlp.experts.down_proj"), bf16, losses)
                : dense_mlp(a, T, H, c.intermediate_size, w.at(p + "mlp.gate_up_proj"),
                            w.at(p + "mlp.down_proj.weight"), bf16);
  for (int64_t i = 0; i < T * H; ++i) out[i] += h[i];
  return out;
}

// Embedding -> decoder layers -> final norm -> LM head (the embedding when tied) -> losses; the
// smooth math unless `rounding` is given.
inline Losses forward(const ModelConfig& c, const Weights64& w, const Batch& batch,
                      Bf16Rounding* rounding = nullptr) {
  Bf16Rounding smooth;
  Bf16Rounding& bf16 = rounding ? *rounding : smooth;
  bf16.start();
  const int64_t B = batch.batch, S = batch.seq, T = B * S, H = c.hidden_size;
  const int64_t V = c.vocab_size;
  const Vec& embed = w.at("model.embed_tokens.weight");
  Vec x(T * H);
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(&embed[batch.inputs[t] * H], H, &x[t * H]);
  Losses losses;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    x = mlp_block(attention_block(x, B, S, c, w, p, bf16), T, layer, c, w, p, bf16, losses);
  }
  const Vec a = bf16(rms_norm(x, w.at("model.norm.weight"), H, c.rms_norm_eps));
  const Vec& head = c.tie_word_embeddings ? embed : w.at("lm_head.weight");
  losses.lm = cross_entropy(linear(a, head.data(), T, H, V), batch.targets, V);
  const double tokens = static_cast<double>(losses.aux_tokens);
  for (size_t e = 0; e < losses.aux_counts.size(); ++e)
    losses.aux += losses.aux_counts[e] / tokens * (losses.aux_prob_sums[e] / tokens);
  losses.aux *= static_cast<double>(losses.aux_counts.size());
  losses.total = losses.lm + c.router_aux_loss_coef * losses.aux;
  bf16.finish();
  return losses;
}

}  // namespace packmoe::reference
