// CPU reference of the MoE non-GEMM ops (backend/ops/moe.h). OpenMP splits work by token, row or
// expert only; every reduction runs inside one iteration in the order backend/ops/moe.h defines, so the
// bits never depend on the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/ops/moe.h"
#include "backend/reduce_order.h"
#include "core/check.h"

namespace packmoe {
namespace {

float load(DType t, const void* p, int64_t i) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

void store(DType t, void* p, int64_t i, float v) {
  if (t == DType::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
}

// Top-k order key: NaN sorts below every probability (probabilities are >= 0).
float topk_key(float p) { return p == p ? p : -1.0f; }

// Routed-pair counts per expert, summed over j: (E). Sequential: integer sums have no order.
std::vector<int64_t> expert_counts(const int32_t* idx, int64_t slots, int64_t experts) {
  std::vector<int64_t> cnt(experts, 0);
  for (int64_t i = 0; i < slots; ++i) {
    PACKMOE_CHECK(idx[i] >= 0 && idx[i] < experts,
                  "idx " << idx[i] << " outside [0, " << experts << ")");
    ++cnt[idx[i]];
  }
  return cnt;
}

}  // namespace

Status router_topk_cpu(const RouterTopkArgs& a) {
  const int64_t E = a.experts, k = a.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* z = a.logits + t * E;  // (E)
    float* p = a.probs + t * E;         // (E)
    float m = z[0];
    for (int64_t e = 1; e < E; ++e) m = z[e] > m ? z[e] : m;
    for (int64_t e = 0; e < E; ++e) p[e] = moe_exp_f32(z[e] - m);
    const float s = sum_r32(E, [&](int64_t e) { return p[e]; });
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] / s;

    // Selection sort without a visited set: pick j is the best expert strictly after pick j-1 in
    // the order (key descending, index ascending), which is total, so k <= E picks always exist.
    int32_t* idx = a.idx + t * k;  // (k)
    float* w = a.w + t * k;        // (k)
    for (int64_t j = 0; j < k; ++j) {
      int32_t best = -1;
      float best_key = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        const float key = topk_key(p[e]);
        if (j > 0) {
          const float prev_key = topk_key(p[idx[j - 1]]);
          const bool after_prev = key < prev_key || (key == prev_key && e > idx[j - 1]);
          if (!after_prev) continue;
        }
        if (best < 0 || key > best_key) {
          best = static_cast<int32_t>(e);
          best_key = key;
        }
      }
      idx[j] = best;
      w[j] = p[best];
    }
    if (a.norm_topk_prob) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum = sum + w[j];
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / sum;
    }
  }
  return Status::ok();
}

Status router_topk_backward_cpu(const RouterTopkBackwardArgs& a) {
  const int64_t E = a.experts, k = a.top_k;
#pragma omp parallel
  {
    std::vector<float> g(k);  // (k) dL/dp at the selected experts of one token
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) {
      const float* p = a.probs + t * E;    // (E)
      const int32_t* idx = a.idx + t * k;  // (k)
      const float* dw = a.dw + t * k;      // (k)
      float* dz = a.dlogits + t * E;       // (E)
      for (int64_t j = 0; j < k; ++j)
        PACKMOE_CHECK(idx[j] >= 0 && idx[j] < E, "idx " << idx[j] << " outside [0, " << E << ")");
      if (a.norm_topk_prob) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) sum = sum + p[idx[j]];
        float c = 0.0f;
        for (int64_t j = 0; j < k; ++j) c = c + dw[j] * (p[idx[j]] / sum);
        for (int64_t j = 0; j < k; ++j) g[j] = (dw[j] - c) / sum;
      } else {
        for (int64_t j = 0; j < k; ++j) g[j] = dw[j];
      }
      float d = 0.0f;
      for (int64_t j = 0; j < k; ++j) d = d + g[j] * p[idx[j]];
      for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * -d;
      for (int64_t j = 0; j < k; ++j) dz[idx[j]] = p[idx[j]] * (g[j] - d);
    }
  }
  return Status::ok();
}

Status aux_loss_cpu(const AuxLossArgs& a) {
  const int64_t T = a.tokens, E = a.experts, k = a.top_k;
  std::vector<int64_t> cnt(k * E, 0);  // (k, E)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = a.idx[t * k + j];
      PACKMOE_CHECK(e >= 0 && e < E, "idx " << e << " outside [0, " << E << ")");
      ++cnt[j * E + e];
    }
  std::vector<float> pbar(E);  // (E)
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < E; ++e)
    pbar[e] = sum_r32(T, [&](int64_t t) { return a.probs[t * E + e]; }) / static_cast<float>(T);
  const float sum = sum_r32(k * E, [&](int64_t i) {
    const float f = static_cast<float>(cnt[i]) / static_cast<float>(T);
    return f * pbar[i % E];
  });
  *a.aux = static_cast<float>(E) * sum;
  return Status::ok();
}

Status aux_loss_backward_cpu(const AuxLossBackwardArgs& a) {
  const int64_t T = a.tokens, E = a.experts;
  const std::vector<int64_t> cnt = expert_counts(a.idx, T * a.top_k, E);
  std::vector<float> q(E);  // (E) dL/dprobs[t, e], the same for every token
  for (int64_t e = 0; e < E; ++e)
    q[e] =
        ((a.daux * static_cast<float>(E)) * (static_cast<float>(cnt[e]) / static_cast<float>(T))) /
        static_cast<float>(T);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* p = a.probs + t * E;  // (E)
    float* dz = a.dlogits + t * E;     // (E)
    const float d = sum_r32(E, [&](int64_t e) { return p[e] * q[e]; });
    for (int64_t e = 0; e < E; ++e) dz[e] = dz[e] + p[e] * (q[e] - d);
  }
  return Status::ok();
}

Status permute_cpu(const PermuteArgs& a) {
  const int64_t slots = a.tokens * a.top_k;
  const size_t row_bytes = dtype_bytes_for(a.dtype, a.hidden);
  const auto* x = static_cast<const uint8_t*>(a.x);
  auto* xp = static_cast<uint8_t*>(a.xp);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int32_t slot = a.row_slot[r];
    PACKMOE_CHECK(slot >= -1 && slot < slots,
                  "row_slot " << slot << " outside [-1, " << slots << ")");
    if (slot < 0)
      std::memset(xp + r * row_bytes, 0, row_bytes);
    else
      std::memcpy(xp + r * row_bytes, x + (slot / a.top_k) * row_bytes, row_bytes);
  }
  return Status::ok();
}

Status permute_backward_cpu(const PermuteBackwardArgs& a) {
  const int64_t H = a.hidden, k = a.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t) {
    float* dx = a.dx + t * H;  // (H)
    for (int64_t h = 0; h < H; ++h) dx[h] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = a.dest[t * k + j];
      PACKMOE_CHECK(r >= 0 && r < a.rows, "dest " << r << " outside [0, " << a.rows << ")");
      for (int64_t h = 0; h < H; ++h) dx[h] = dx[h] + load(a.dxp_dtype, a.dxp, r * H + h);
    }
  }
  return Status::ok();
}

Status swiglu_cpu(const SwigluArgs& a) {
  const int64_t F = a.ffn;
  const int64_t rows = a.rows_device ? *a.rows_device : a.rows;  // host memory here
  PACKMOE_CHECK(rows >= 0 && rows <= a.rows, "rows_device " << rows << " outside [0, " << a.rows << "]");
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < F; ++f) {
      const float g = load(a.in_dtype, a.in, r * 2 * F + f);
      const float u = load(a.in_dtype, a.in, r * 2 * F + F + f);
      const float s = moe_sigmoid_f32(g);
      store(a.out_dtype, a.out, r * F + f, (g * s) * u);
    }
  return Status::ok();
}

Status swiglu_backward_cpu(const SwigluBackwardArgs& a) {
  const int64_t F = a.ffn;
  const int64_t rows = a.rows_device ? *a.rows_device : a.rows;  // host memory here
  PACKMOE_CHECK(rows >= 0 && rows <= a.rows, "rows_device " << rows << " outside [0, " << a.rows << "]");
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < F; ++f) {
      const float g = load(a.in_dtype, a.in, r * 2 * F + f);
      const float u = load(a.in_dtype, a.in, r * 2 * F + F + f);
      const float o = load(a.dout_dtype, a.dout, r * F + f);
      const float s = moe_sigmoid_f32(g);
      store(a.din_dtype, a.din, r * 2 * F + f, (o * u) * (s * (1.0f + g * (1.0f - s))));
      store(a.din_dtype, a.din, r * 2 * F + F + f, o * (g * s));
    }
  return Status::ok();
}

Status unpermute_cpu(const UnpermuteArgs& a) {
  const int64_t H = a.hidden, k = a.top_k;
#pragma omp parallel
  {
    std::vector<float> acc(H);  // (H) one token's FP32 sum, rounded once if y is BF16
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t h = 0; h < H; ++h) acc[h] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = a.dest[t * k + j];
        PACKMOE_CHECK(r >= 0 && r < a.rows, "dest " << r << " outside [0, " << a.rows << ")");
        const float wj = a.w[t * k + j];
        for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + wj * load(a.yp_dtype, a.yp, r * H + h);
      }
      for (int64_t h = 0; h < H; ++h) store(a.y_dtype, a.y, t * H + h, acc[h]);
    }
  }
  return Status::ok();
}

Status unpermute_backward_cpu(const UnpermuteBackwardArgs& a) {
  const int64_t H = a.hidden, k = a.top_k, slots = a.tokens * a.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int32_t slot = a.row_slot[r];
    PACKMOE_CHECK(slot >= -1 && slot < slots,
                  "row_slot " << slot << " outside [-1, " << slots << ")");
    if (slot < 0) {
      for (int64_t h = 0; h < H; ++h) store(a.dyp_dtype, a.dyp, r * H + h, 0.0f);
      continue;
    }
    const int64_t t = slot / k;
    const float wj = a.w[slot];
    for (int64_t h = 0; h < H; ++h)
      store(a.dyp_dtype, a.dyp, r * H + h, wj * load(a.dy_dtype, a.dy, t * H + h));
  }
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = a.dest[t * k + j];
      PACKMOE_CHECK(r >= 0 && r < a.rows, "dest " << r << " outside [0, " << a.rows << ")");
      a.dw[t * k + j] = sum_r32(H, [&](int64_t h) {
        return load(a.dy_dtype, a.dy, t * H + h) * load(a.yp_dtype, a.yp, r * H + h);
      });
    }
  return Status::ok();
}

// build_routing_plan's arrays, written where the op's arguments point.
Status routing_plan_cpu(const RoutingPlanArgs& a) {
  const int64_t slots = a.tokens * a.top_k;
  std::fill(a.counts, a.counts + a.experts + 1, int64_t{0});
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = a.idx[i];
    ++a.counts[e >= 0 && e < a.experts ? e : a.experts];
  }
  if (a.counts[a.experts] != 0) return Status::ok();  // dest, row_slot unspecified
  Result<RoutingPlan> p = build_routing_plan(a.idx, a.tokens, a.experts, a.top_k, a.align);
  if (!p) return p.status();
  const RoutingPlan& plan = p.value();
  std::copy(plan.dest.begin(), plan.dest.end(), a.dest);
  std::copy(plan.row_slot.begin(), plan.row_slot.end(), a.row_slot);
  std::fill(a.row_slot + plan.rows, a.row_slot + a.max_rows, int32_t{-1});
  std::copy(plan.padded_counts.begin(), plan.padded_counts.end(), a.padded_counts);
  *a.rows = plan.rows;
  return Status::ok();
}

}  // namespace packmoe
