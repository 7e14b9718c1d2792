// CPU reference of attention_kv (backend/ops/model.h): new queries of one sequence over its KV
// cache. Invariant: a query row runs exactly attention_cpu's arithmetic for its row (R32 dot
// products and sums, sequential max, moe_exp_f32), so it equals that row of the whole sequence's
// attention bit for bit; OpenMP splits (query, head) rows only.
#include <vector>

#include "backend/ops/model.h"
#include "backend/reduce_order.h"

namespace packmoe {

Status attention_kv_cpu(const AttentionKvArgs& a) {
  const int64_t Sq = a.queries, Skv = a.keys, D = a.head_dim, Hq = a.q_heads, Hkv = a.kv_heads;
  const int64_t group = Hq / Hkv, past = Skv - Sq;
#pragma omp parallel
  {
    std::vector<float> q(D), p(Skv);                    // one query row, its scores / exponentials
    std::vector<float> lane(kMoeReduceLanes * D);       // (32, D) R32 lanes of the output sum
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < Sq * Hq; ++r) {
      const int64_t i = r / Hq, h = r % Hq, g = h / group, n = past + i + 1;  // keys [0, n)
      for (int64_t d = 0; d < D; ++d) q[d] = bf16_to_f32(a.q[(i * Hq + h) * D + d]);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* k = a.k + (j * Hkv + g) * D;  // (D)
        p[j] = sum_r32(D, [&](int64_t d) { return q[d] * bf16_to_f32(k[d]); }) * a.scale;
      }
      float m = p[0];
      for (int64_t j = 1; j < n; ++j) m = p[j] > m ? p[j] : m;
      for (int64_t j = 0; j < n; ++j) p[j] = moe_exp_f32(p[j] - m);
      const float l = sum_r32(n, [&](int64_t j) { return p[j]; });
      std::fill(lane.begin(), lane.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* v = a.v + (j * Hkv + g) * D;  // (D)
        float* acc = lane.data() + (j % kMoeReduceLanes) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + p[j] * bf16_to_f32(v[d]);
      }
      for (int off = kMoeReduceLanes / 2; off >= 1; off /= 2)
        for (int ln = 0; ln < off; ++ln)
          for (int64_t d = 0; d < D; ++d) lane[ln * D + d] = lane[ln * D + d] + lane[(ln + off) * D + d];
      uint16_t* o = a.o + (i * Hq + h) * D;  // (D)
      for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(lane[d] / l);
    }
  }
  return Status::ok();
}

}  // namespace packmoe
