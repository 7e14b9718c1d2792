// The dQ kernel of the sm_90a flash attention backward, D = 64 or 128 (docs/attention-sm90.md):
// one CTA per 128-query tile of one head, shaped like the forward: thread 0 loads Q and dO once
// and K, V tiles (two stages, TMA on mbarriers); two warpgroups of 64 queries each recompute
// S = Q K^T and dP = dO V^T (wgmma), P = 2^(S scale log2e - lse log2e) and dS = P (dP - Dl) in
// registers, and dQ += dS K (wgmma, A from registers), then write dq once. Invariant: each dq row
// is a fixed sequence of operations on its own batch row's inputs (KV tiles in descending order):
// deterministic and batch invariant, no reduction across CTAs.
#include "backend/cuda/flash_attention_sm90_device.cuh"
#include "backend/cuda/flash_attention_sm90_dq.h"

namespace packmoe::cuda {
namespace {

using namespace flash;

template <int D>
struct DqLayout {
  static constexpr int kBM = 128, kBN = 128, kBoxes = D / 64, kStages = 2;
  static constexpr int kQBytes = kBM * D * 2;   // Q or dO: D / 64 boxes of (128, 64)
  static constexpr int kKvBytes = kBN * D * 2;  // K or V of one stage
  static constexpr int kQ = 0, kDo = kQBytes, kK = 2 * kQBytes;
  static constexpr int kV = kK + kStages * kKvBytes;
  static constexpr int kBars = kV + kStages * kKvBytes;  // full_q, full[kStages] (K and V)
  static constexpr int kSmem = kBars + (1 + kStages) * 8;
};

struct DqParams : FlashBwdRows {
  float* dq;  // (B, S, Hq, D)
};

// Thread 0 loads K and V of the it-th KV tile (n_hi - it) into stage it % kStages.
template <int D>
__device__ __forceinline__ void load_kv(const CUtensorMap* tk, const CUtensorMap* tv, uint8_t* smem,
                                        uint64_t* full, int it, int n_hi, int g, int b) {
  using L = DqLayout<D>;
  const int s = it % L::kStages, key0 = (n_hi - it) * L::kBN;
  mbar_arrive_expect_tx(&full[s], 2 * L::kKvBytes);
  for (int x = 0; x < L::kBoxes; ++x) {
    tma_load_4d(smem + L::kK + s * L::kKvBytes + x * L::kBN * 128, tk, &full[s], 64 * x, g, key0,
                b);
    tma_load_4d(smem + L::kV + s * L::kKvBytes + x * L::kBN * 128, tv, &full[s], 64 * x, g, key0,
                b);
  }
}

// 256 threads and no producer warpgroup, for the registers (S, dP and dQ accumulators: ~200;
// flash_attention_bwd_sm90.cu says why a producer warpgroup would cap them at 168). Thread 0
// reloads a stage once both warpgroups have passed the step's barrier.
template <int D>
__global__ void __launch_bounds__(256, 1)
    flash_dq_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                    const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                    const DqParams p) {
  using L = DqLayout<D>;
  extern __shared__ __align__(1024) uint8_t smem[];
  if ((smem_addr(smem) & 1023) != 0) __trap();  // 128-byte swizzle atoms
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* full_q = bars;
  uint64_t* full = bars + 1;  // [kStages]

  // Heaviest tiles first; heads of a KV group adjacent.
  const int m = p.m_tiles - 1 - static_cast<int>(blockIdx.x) / p.batch_heads;
  const int bh = static_cast<int>(blockIdx.x) % p.batch_heads;
  const int b = bh / p.Hq, h = bh % p.Hq, g = h / p.group;
  const int32_t* doc = p.doc + static_cast<int64_t>(b) * p.S_pad;
  const int row0 = m * L::kBM, row_last = min(row0 + L::kBM, p.S) - 1;
  const int n_hi = row_last / L::kBN, n_lo = p.has_doc ? doc[row0] / L::kBN : 0;
  const int n_count = n_hi - n_lo + 1;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    for (int s = 0; s < L::kStages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
    mbar_arrive_expect_tx(full_q, 2 * L::kQBytes);
    for (int x = 0; x < L::kBoxes; ++x) {
      tma_load_4d(smem + L::kQ + x * L::kBM * 128, &tq, full_q, 64 * x, h, row0, b);
      tma_load_4d(smem + L::kDo + x * L::kBM * 128, &tdo, full_q, 64 * x, h, row0, b);
    }
    for (int it = 0; it < min(n_count, L::kStages); ++it)
      load_kv<D>(&tk, &tv, smem, full, it, n_hi, g, b);
  }
  __syncthreads();

  const int c = threadIdx.x / 128;  // query rows [64 c, 64 c + 64) of the tile
  const int t = threadIdx.x % 128, w = t / 32, l = t % 32;
  const uint32_t base = smem_addr(smem);
  int rows[2], ds_row[2];
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    rows[i] = row0 + 64 * c + 16 * w + 8 * i + l / 4;  // < S_pad; rows past S have lse2 = +inf
    const int64_t r = (static_cast<int64_t>(b) * p.Hq + h) * p.S_pad + rows[i];
    lse2[i] = p.lse2[r];
    dl[i] = p.dl[r];
    ds_row[i] = doc[rows[i]];
  }
  const int ds_last = doc[row_last];

  float dq[D / 2];  // (64 queries, D)
#pragma unroll
  for (int e = 0; e < D / 2; ++e) dq[e] = 0.0f;

  mbar_wait(full_q, 0);
  for (int it = 0; it < n_count; ++it) {
    const int s = it % L::kStages, key0 = (n_hi - it) * L::kBN;
    const uint32_t sk = base + L::kK + s * L::kKvBytes, sv = base + L::kV + s * L::kKvBytes;
    mbar_wait(&full[s], (it / L::kStages) & 1);

    // S = Q K^T and dP = dO V^T: (64 queries, 128 keys).
    float sc[64], dp[64];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk / 4) * L::kBM * 128 + (kk % 4) * 32;
      wgmma_m64n128k16<0, 0>(sc, wgmma_desc(base + L::kQ + off + c * 64 * 128, 16, 1024),
                             wgmma_desc(sk + off, 16, 1024), kk > 0 ? 1u : 0u);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk / 4) * L::kBM * 128 + (kk % 4) * 32;
      wgmma_m64n128k16<0, 0>(dp, wgmma_desc(base + L::kDo + off + c * 64 * 128, 16, 1024),
                             wgmma_desc(sv + off, 16, 1024), kk > 0 ? 1u : 0u);
    }
    wgmma_commit();

    // P, masked unless every (row, key) pair of the tile is visible; then dS = P (dP - Dl).
    wgmma_wait<1>();
    const bool full_tile = key0 + L::kBN - 1 <= row0 && ds_last <= key0;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + 8 * j + 2 * (l % 4) + e;
          float& x = sc[4 * j + 2 * i + e];
          x = exp2_approx(__fmaf_rn(x, p.scale_log2, -lse2[i]));
          if (!full_tile && (key > rows[i] || key < ds_row[i])) x = 0.0f;
        }
    wgmma_wait<0>();
    uint32_t dsa[8][4];  // converted first: an in-flight wgmma's registers stay untouched
#pragma unroll
    for (int x = 0; x < 64; ++x) dp[x] = sc[x] * (dp[x] - dl[(x / 2) % 2]);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) to_a_fragment<128>(dp, kk, dsa[kk]);

    // dQ += dS K: K (128 keys, D) as the MN-major B operand.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint64_t db = wgmma_desc(sk + kk * 2048, L::kBN * 128, 1024);
      if constexpr (D == 128)
        wgmma_rs_n128<1>(dq, dsa[kk], db, 1u);
      else
        wgmma_rs_n64<1>(dq, dsa[kk], db, 1u);
    }
    wgmma_commit();
    wgmma_wait<0>();
    named_barrier_sync(1, 256);  // stage s is read by both warpgroups
    if (threadIdx.x == 0 && it + L::kStages < n_count)
      load_kv<D>(&tk, &tv, smem, full, it + L::kStages, n_hi, g, b);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rows[i] >= p.S) continue;
    float* row = p.dq + ((static_cast<int64_t>(b) * p.S + rows[i]) * p.Hq + h) * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<float2*>(row + 8 * j + 2 * (l % 4)) =
          make_float2(dq[4 * j + 2 * i] * p.scale, dq[4 * j + 2 * i + 1] * p.scale);
  }
}

template <int D>
void launch_dq(const FlashAttentionShape& sh, const uint16_t* q, const uint16_t* k,
               const uint16_t* v, const uint16_t* dout, const float* dl, const float* lse2,
               const int32_t* doc, bool has_doc, float* dq, cudaStream_t stream) {
  using L = DqLayout<D>;
  const FlashBwdMaps t = flash_bwd_maps(sh, D, L::kBM, L::kBN, q, k, v, dout);
  DqParams p;
  static_cast<FlashBwdRows&>(p) = flash_bwd_rows(sh, L::kBM, dl, lse2, doc, has_doc);
  p.dq = dq;
  static const bool configured = set_max_dynamic_smem(flash_dq_kernel<D>, L::kSmem);
  (void)configured;
  const dim3 grid(static_cast<unsigned>(p.m_tiles * p.batch_heads));
  flash_dq_kernel<D><<<grid, 256, L::kSmem, stream>>>(t.q, t.k, t.v, t.dout, p);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_flash_dq_128(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const uint16_t* dout, const float* dl,
                         const float* lse2, const int32_t* doc, bool has_doc, float* dq,
                         cudaStream_t stream) {
  launch_dq<128>(shape, q, k, v, dout, dl, lse2, doc, has_doc, dq, stream);
}
void launch_flash_dq_64(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, const uint16_t* dout, const float* dl, const float* lse2,
                        const int32_t* doc, bool has_doc, float* dq, cudaStream_t stream) {
  launch_dq<64>(shape, q, k, v, dout, dl, lse2, doc, has_doc, dq, stream);
}

}  // namespace packmoe::cuda
