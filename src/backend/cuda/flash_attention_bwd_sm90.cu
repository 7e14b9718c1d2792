// Flash attention backward for sm_90a, D = 64 or 128, the dK / dV half (docs/attention-sm90.md):
// a preprocessing kernel writes Dl = rowsum(dO * O) and lse log2(e); then one CTA per (128-key
// tile, query head): thread 0 loads K, V of the head's KV head once and, per query tile, Q, dO,
// lse, Dl and the document starts (TMA on mbarriers, four stages); two warpgroups of 64 keys each
// compute S^T = K Q^T and dP^T = V dO^T (wgmma), P^T and dS^T in registers, dV += P^T dO and
// dK += dS^T Q (wgmma, A from registers). With GQA, dK / dV of each query head go to the workspace
// and a last kernel sums each group's heads (per-head CTAs keep the causal work balanced over the
// GPU). dQ has its own kernel (flash_attention_dq_sm90.cu): adding dS K into dq from every KV tile
// costs a 32 KB FP32 reduction in L2 per 64 x 128 tile, and L2 reductions bound that design.
// Invariant (deterministic, batch invariant): dK / dV sum in a fixed order (query tiles in
// registers, then heads in order), never by atomics.
#include "backend/cuda/flash_attention_sm90.h"
#include "backend/cuda/flash_attention_sm90_device.cuh"
#include "backend/cuda/flash_attention_sm90_dq.h"
#include "backend/cuda/flash_attention_sm90_simple.h"

namespace packmoe::cuda {
namespace {

using namespace flash;

// 128 keys per CTA; per step 64 queries (D = 128) or 128 (D = 64): what the registers hold.
template <int D>
struct BwdLayout {
  static constexpr int kBN = 128, kBM = D == 128 ? 64 : 128, kBoxes = D / 64, kStages = 4;
  static constexpr int kKvBytes = kBN * D * 2;  // K or V: D / 64 boxes of (128, 64)
  static constexpr int kQBytes = kBM * D * 2;   // Q or dO of one stage: D / 64 boxes of (kBM, 64)
  static constexpr int kK = 0, kV = kKvBytes, kQ = 2 * kKvBytes;
  static constexpr int kDo = kQ + kStages * kQBytes;
  static constexpr int kRowF =
      kDo + kStages * kQBytes;  // per stage: lse2, Dl, doc (kBM words each)
  static constexpr int kRowBytes = 3 * kBM * 4;
  static constexpr int kBars = kRowF + kStages * kRowBytes;  // full_kv, full[kStages]
  static constexpr int kSmem = kBars + (1 + kStages) * 8;
  static_assert(kSmem <= 232448, "shared memory");
  static constexpr uint32_t kStageTx = 2 * kQBytes + kRowBytes;
};

struct BwdParams : FlashBwdRows {
  int n_tiles;  // 128-key tiles
  float* dk;    // (B, S, Hq, D): per query head (summed over each group afterwards)
  float* dv;
};

// Step `it` of a CTA: query tile m_first + it of query head h.
struct StepLoad {
  const CUtensorMap* tq;
  const CUtensorMap* tdo;
  int m_first, b, h;
};

// Thread 0 loads the Q, dO, lse2, Dl and doc rows of step `it` into stage it % kStages.
template <int D>
__device__ __forceinline__ void load_step(const BwdParams& p, const StepLoad& sl, uint8_t* smem,
                                          uint64_t* full, int it) {
  using L = BwdLayout<D>;
  const int m = sl.m_first + it, h = sl.h, s = it % L::kStages;
  mbar_arrive_expect_tx(&full[s], L::kStageTx);
  for (int x = 0; x < L::kBoxes; ++x) {
    tma_load_4d(smem + L::kQ + s * L::kQBytes + x * L::kBM * 128, sl.tq, &full[s], 64 * x, h,
                m * L::kBM, sl.b);
    tma_load_4d(smem + L::kDo + s * L::kQBytes + x * L::kBM * 128, sl.tdo, &full[s], 64 * x, h,
                m * L::kBM, sl.b);
  }
  const int64_t row = (static_cast<int64_t>(sl.b) * p.Hq + h) * p.S_pad + m * L::kBM;
  uint8_t* rows = smem + L::kRowF + s * L::kRowBytes;
  bulk_load(rows, p.lse2 + row, L::kBM * 4, &full[s]);
  bulk_load(rows + L::kBM * 4, p.dl + row, L::kBM * 4, &full[s]);
  bulk_load(rows + 2 * L::kBM * 4, p.doc + static_cast<int64_t>(sl.b) * p.S_pad + m * L::kBM,
            L::kBM * 4, &full[s]);
}

// Two warpgroups, no producer warpgroup: ptxas keeps a wgmma kernel within the launch bound's
// registers (docs/gemm-sm90.md; 384 threads give 168, and so do 288: 3 warps on one of the 4
// register-file quarters), and dK, dV, S^T and dP^T need ~200 live; 256 threads allow 255.
// Thread 0 issues every load, kStages deep: step it + kStages - 1 once both warpgroups have
// passed step it's barrier (so step it - 1, the stage's last user, is complete in both).
template <int D>
__global__ void __launch_bounds__(256, 1)
    flash_dkdv_kernel(const __grid_constant__ CUtensorMap tq,
                      const __grid_constant__ CUtensorMap tk,
                      const __grid_constant__ CUtensorMap tv,
                      const __grid_constant__ CUtensorMap tdo, const BwdParams p) {
  using L = BwdLayout<D>;
  extern __shared__ __align__(1024) uint8_t smem[];
  if ((smem_addr(smem) & 1023) != 0) __trap();
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* full_kv = bars;
  uint64_t* full = bars + 1;  // [kStages]

  // Heaviest KV tiles (most query tiles under the causal mask) first.
  const int j = static_cast<int>(blockIdx.x) / p.batch_heads;
  const int bh = static_cast<int>(blockIdx.x) % p.batch_heads;
  const int b = bh / p.Hq, h = bh % p.Hq, g = h / p.group;
  const int key0 = j * L::kBN;
  // Query tiles with a key of this tile visible: [m_first, m_last] (doc starts are nondecreasing).
  const int m_first = key0 / L::kBM;
  int m_last = p.m_tiles - 1;
  if (p.has_doc) {
    const int32_t* doc = p.doc + static_cast<int64_t>(b) * p.S_pad;
    m_last = m_first;
    while (m_last + 1 < p.m_tiles && doc[(m_last + 1) * L::kBM] <= key0 + L::kBN - 1) ++m_last;
  }
  const int steps = m_last - m_first + 1;
  const StepLoad sl{&tq, &tdo, m_first, b, h};

  if (threadIdx.x == 0) {
    mbar_init(full_kv, 1);
    for (int s = 0; s < L::kStages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
    mbar_arrive_expect_tx(full_kv, 2 * L::kKvBytes);
    for (int x = 0; x < L::kBoxes; ++x) {
      tma_load_4d(smem + L::kK + x * L::kBN * 128, &tk, full_kv, 64 * x, g, key0, b);
      tma_load_4d(smem + L::kV + x * L::kBN * 128, &tv, full_kv, 64 * x, g, key0, b);
    }
    for (int it = 0; it < min(steps, L::kStages - 1); ++it) load_step<D>(p, sl, smem, full, it);
  }
  __syncthreads();

  const int c = threadIdx.x / 128;  // keys [64 c, 64 c + 64) of the tile
  const int t = threadIdx.x % 128, w = t / 32, l = t % 32;
  const uint32_t base = smem_addr(smem);
  int keys[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) keys[i] = key0 + 64 * c + 16 * w + 8 * i + l / 4;

  float dk[D / 2], dv[D / 2];  // (64 keys, D)
#pragma unroll
  for (int e = 0; e < D / 2; ++e) dk[e] = dv[e] = 0.0f;

  mbar_wait(full_kv, 0);
  for (int it = 0; it < steps; ++it) {
    const int q0 = (m_first + it) * L::kBM, s = it % L::kStages;
    mbar_wait(&full[s], (it / L::kStages) & 1);
    const uint32_t sq = base + L::kQ + s * L::kQBytes, sdo = base + L::kDo + s * L::kQBytes;
    const float* lse2 = reinterpret_cast<const float*>(smem + L::kRowF + s * L::kRowBytes);
    const float* dl = lse2 + L::kBM;
    const int32_t* doc = reinterpret_cast<const int32_t*>(dl + L::kBM);

    // S^T = K Q^T and dP^T = V dO^T: (64 keys, kBM queries).
    float st[L::kBM / 2], dpt[L::kBM / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk / 4) * L::kBN * 128 + c * 64 * 128 + (kk % 4) * 32;
      const uint32_t qoff = (kk / 4) * L::kBM * 128 + (kk % 4) * 32;
      const uint64_t da = wgmma_desc(base + L::kK + koff, 16, 1024);
      const uint64_t db = wgmma_desc(sq + qoff, 16, 1024);
      if constexpr (L::kBM == 128)
        wgmma_m64n128k16<0, 0>(st, da, db, kk > 0 ? 1u : 0u);
      else
        wgmma_ss_n64<0, 0>(st, da, db, kk > 0 ? 1u : 0u);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = (kk / 4) * L::kBN * 128 + c * 64 * 128 + (kk % 4) * 32;
      const uint32_t qoff = (kk / 4) * L::kBM * 128 + (kk % 4) * 32;
      const uint64_t da = wgmma_desc(base + L::kV + koff, 16, 1024);
      const uint64_t db = wgmma_desc(sdo + qoff, 16, 1024);
      if constexpr (L::kBM == 128)
        wgmma_m64n128k16<0, 0>(dpt, da, db, kk > 0 ? 1u : 0u);
      else
        wgmma_ss_n64<0, 0>(dpt, da, db, kk > 0 ? 1u : 0u);
    }
    wgmma_commit();

    // P^T = 2^(s scale log2e - lse log2e), masked unless every pair of the tile is visible.
    wgmma_wait<1>();
    const bool full_tile = key0 + L::kBN - 1 <= q0 && doc[L::kBM - 1] <= key0;
#pragma unroll
    for (int jj = 0; jj < L::kBM / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * jj + 2 * (l % 4) + e, query = q0 + col;
        const float l2 = lse2[col];
        const int ds = doc[col];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float& x = st[4 * jj + 2 * i + e];
          x = exp2_approx(__fmaf_rn(x, p.scale_log2, -l2));
          if (!full_tile && (keys[i] > query || keys[i] < ds)) x = 0.0f;
        }
      }
    // dS^T = P^T (dP^T - Dl).
    wgmma_wait<0>();
#pragma unroll
    for (int jj = 0; jj < L::kBM / 8; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float d = dl[8 * jj + 2 * (l % 4) + e];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int x = 4 * jj + 2 * i + e;
          dpt[x] = st[x] * (dpt[x] - d);
        }
      }

    // dV += P^T dO, dK += dS^T Q: K = kBM queries, B operands MN-major. The A fragments are
    // converted first: registers an in-flight wgmma reads must stay untouched.
    uint32_t pa[L::kBM / 16][4], dsa[L::kBM / 16][4];
#pragma unroll
    for (int kk = 0; kk < L::kBM / 16; ++kk) {
      to_a_fragment<L::kBM>(st, kk, pa[kk]);
      to_a_fragment<L::kBM>(dpt, kk, dsa[kk]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < L::kBM / 16; ++kk) {
      const uint64_t db = wgmma_desc(sdo + kk * 2048, L::kBM * 128, 1024);
      if constexpr (D == 128)
        wgmma_rs_n128<1>(dv, pa[kk], db, 1u);
      else
        wgmma_rs_n64<1>(dv, pa[kk], db, 1u);
    }
#pragma unroll
    for (int kk = 0; kk < L::kBM / 16; ++kk) {
      const uint64_t db = wgmma_desc(sq + kk * 2048, L::kBM * 128, 1024);
      if constexpr (D == 128)
        wgmma_rs_n128<1>(dk, dsa[kk], db, 1u);
      else
        wgmma_rs_n64<1>(dk, dsa[kk], db, 1u);
    }
    wgmma_commit();

    named_barrier_sync(1, 256);  // step it - 1 is complete in both warpgroups
    if (threadIdx.x == 0 && it + L::kStages - 1 < steps)
      load_step<D>(p, sl, smem, full, it + L::kStages - 1);
    wgmma_wait<0>();  // the A fragments of this step's wgmmas are free again
  }

  // dK (scaled) and dV of this warpgroup's 64 keys.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (keys[i] >= p.S) continue;
    const int64_t off = ((static_cast<int64_t>(b) * p.S + keys[i]) * p.Hq + h) * D;
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
      const int col = 8 * jj + 2 * (l % 4);
      *reinterpret_cast<float2*>(p.dk + off + col) =
          make_float2(dk[4 * jj + 2 * i] * p.scale, dk[4 * jj + 2 * i + 1] * p.scale);
      *reinterpret_cast<float2*>(p.dv + off + col) =
          make_float2(dv[4 * jj + 2 * i], dv[4 * jj + 2 * i + 1]);
    }
  }
}

// dk[b, s, g] = sum over r < group of part[b, s, g group + r] (in order), dv likewise: one thread
// per 4 elements.
__global__ void sum_heads_kernel(const float4* dk_part, const float4* dv_part, float4* dk,
                                 float4* dv, int64_t kv_vectors, int group, int d4) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kv_vectors) return;
  const int64_t row = i / d4, e = i % d4;  // row = (b S + s) Hkv + g
  const float4* a = dk_part + row * group * d4 + e;
  const float4* v = dv_part + row * group * d4 + e;
  float4 sk = a[0], sv = v[0];
  for (int r = 1; r < group; ++r) {
    const float4 x = a[r * d4], y = v[r * d4];
    sk = make_float4(sk.x + x.x, sk.y + x.y, sk.z + x.z, sk.w + x.w);
    sv = make_float4(sv.x + y.x, sv.y + y.y, sv.z + y.z, sv.w + y.w);
  }
  dk[i] = sk;
  dv[i] = sv;
}

// Workspace: dl, lse2 (B, Hq, S_pad) FP32; doc (B, S_pad) int32; with GQA on the tensor-core
// path, dk and dv per query head (B, S, Hq, D) FP32.
struct Workspace {
  int64_t rows, doc, parts;  // element counts
  size_t bytes() const { return static_cast<size_t>(2 * rows + doc + 2 * parts) * 4; }
};
Workspace workspace_of(const FlashAttentionShape& s) {
  const int64_t s_pad = (s.seq + 127) / 128 * 128;
  const bool parts = s.q_heads != s.kv_heads && (s.head_dim == 64 || s.head_dim == 128);
  return {s.batch * s.q_heads * s_pad, s.batch * s_pad,
          parts ? s.batch * s.seq * s.q_heads * s.head_dim : 0};
}

template <int D>
void launch_dkdv(const FlashAttentionShape& sh, const uint16_t* q, const uint16_t* k,
                 const uint16_t* v, const uint16_t* dout, const float* dl, const float* lse2,
                 const int32_t* doc, bool has_doc, float* dk, float* dv, cudaStream_t stream) {
  using L = BwdLayout<D>;
  const FlashBwdMaps t = flash_bwd_maps(sh, D, L::kBM, L::kBN, q, k, v, dout);
  BwdParams p;
  static_cast<FlashBwdRows&>(p) = flash_bwd_rows(sh, L::kBM, dl, lse2, doc, has_doc);
  p.n_tiles = static_cast<int>((sh.seq + L::kBN - 1) / L::kBN);
  p.dk = dk;
  p.dv = dv;
  static const bool configured = set_max_dynamic_smem(flash_dkdv_kernel<D>, L::kSmem);
  (void)configured;
  const dim3 grid(static_cast<unsigned>(p.n_tiles * p.batch_heads));
  flash_dkdv_kernel<D><<<grid, 256, L::kSmem, stream>>>(t.q, t.k, t.v, t.dout, p);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t flash_attention_backward_workspace_bytes(const FlashAttentionShape& shape) {
  return workspace_of(shape).bytes();
}

Status flash_attention_backward_sm90(const FlashAttentionShape& shape, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                     const uint16_t* dout, const float* lse,
                                     const int32_t* doc_start, float* dq, float* dk, float* dv,
                                     void* workspace, cudaStream_t stream) {
  PACKMOE_RETURN_IF_ERROR(flash_check_shape(shape));
  if (shape.batch * shape.seq == 0) return Status::ok();
  const Workspace ws = workspace_of(shape);
  float* dl = static_cast<float*>(workspace);
  float* lse2 = dl + ws.rows;
  int32_t* doc = reinterpret_cast<int32_t*>(lse2 + ws.rows);
  float* dk_part = ws.parts ? reinterpret_cast<float*>(doc + ws.doc) : dk;
  float* dv_part = ws.parts ? dk_part + ws.parts : dv;
  flash_backward_preprocess(shape, o, dout, lse, doc_start, dl, lse2, doc, stream);
  const bool has_doc = doc_start != nullptr;
  if (shape.head_dim == 128 || shape.head_dim == 64) {
    if (shape.head_dim == 128) {
      launch_dkdv<128>(shape, q, k, v, dout, dl, lse2, doc, has_doc, dk_part, dv_part, stream);
      launch_flash_dq_128(shape, q, k, v, dout, dl, lse2, doc, has_doc, dq, stream);
    } else {
      launch_dkdv<64>(shape, q, k, v, dout, dl, lse2, doc, has_doc, dk_part, dv_part, stream);
      launch_flash_dq_64(shape, q, k, v, dout, dl, lse2, doc, has_doc, dq, stream);
    }
    if (ws.parts) {
      const int d4 = static_cast<int>(shape.head_dim / 4);
      const int64_t n = shape.batch * shape.seq * shape.kv_heads * d4;
      sum_heads_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
          reinterpret_cast<const float4*>(dk_part), reinterpret_cast<const float4*>(dv_part),
          reinterpret_cast<float4*>(dk), reinterpret_cast<float4*>(dv), n,
          static_cast<int>(shape.q_heads / shape.kv_heads), d4);
      PACKMOE_CUDA_CHECK_LAUNCH();
    }
  } else {
    flash_simple_backward(shape, q, k, v, dout, dl, lse2, doc, dq, dk, dv, stream);
  }
  return Status::ok();
}

}  // namespace packmoe::cuda
