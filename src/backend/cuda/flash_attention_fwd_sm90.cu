// Flash attention forward for sm_90a, D = 64 or 128 (docs/attention-sm90.md): a persistent grid
// of 128-query tiles (one head each), per CTA a producer warpgroup loading each tile's Q and its
// K / V tiles (two stages, TMA on mbarriers) and two consumer warpgroups of 64 query rows each:
// S = Q K^T (wgmma, both operands in shared memory), online softmax in FP32 with exp2 and the
// scale folded in, O += P V (wgmma, P from registers). Invariant: each output row is a fixed
// sequence of operations on its own row's inputs (KV tiles in descending order), whatever B, the
// other rows and the CTA that takes the tile are.
#include <algorithm>

#include "backend/cuda/flash_attention_sm90.h"
#include "backend/cuda/flash_attention_sm90_device.cuh"
#include "backend/cuda/flash_attention_sm90_simple.h"

namespace packmoe::cuda {
namespace {

using namespace flash;

template <int D>
struct FwdLayout {
  static constexpr int kBM = 128, kBN = 128, kBoxes = D / 64;
  static constexpr int kQBytes = kBM * D * 2;  // (128, D) BF16 as D / 64 boxes of (128, 64)
  static constexpr int kKvBytes = kBN * D * 2;
  static constexpr int kK = kQBytes;               // K stages
  static constexpr int kV = kK + 2 * kKvBytes;     // V stages
  static constexpr int kBars = kV + 2 * kKvBytes;  // 10 mbarriers
  static constexpr int kSmem = kBars + 10 * 8;
};

struct FwdParams {
  int S, Hq, group, m_tiles, batch_heads;
  float scale_log2;
  const int32_t* doc_start;  // (B * S) or null
  uint16_t* o;               // (B, S, Hq, D)
  float* lse;                // (B, Hq, S)
};

// Tile `tile` of the heavy-first order (most KV tiles under the causal mask first; heads of a KV
// group adjacent): query tile m of head h, batch row b, and its KV tiles [n_lo, n_hi], the only
// ones with a visible key.
struct Tile {
  int b, h, g, row0, row_last, n_lo, n_hi;
};
__device__ __forceinline__ Tile tile_of(const FwdParams& p, int tile, int bm, int bn) {
  Tile u;
  const int m = p.m_tiles - 1 - tile / p.batch_heads, bh = tile % p.batch_heads;
  u.b = bh / p.Hq;
  u.h = bh % p.Hq;
  u.g = u.h / p.group;
  u.row0 = m * bm;
  u.row_last = min(u.row0 + bm, p.S) - 1;
  u.n_hi = u.row_last / bn;
  u.n_lo = p.doc_start ? p.doc_start[static_cast<int64_t>(u.b) * p.S + u.row0] / bn : 0;
  return u;
}

template <int D>
__global__ void __launch_bounds__(384, 1)
    flash_fwd_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                     const __grid_constant__ CUtensorMap tv, const FwdParams p) {
  using L = FwdLayout<D>;
  extern __shared__ __align__(1024) uint8_t smem[];
  if ((smem_addr(smem) & 1023) != 0) __trap();  // 128-byte swizzle atoms
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;   // [2]
  uint64_t* full_v = bars + 3;   // [2]
  uint64_t* empty_k = bars + 5;  // [2]
  uint64_t* empty_v = bars + 7;  // [2]
  uint64_t* empty_q = bars + 9;
  const int tiles = p.m_tiles * p.batch_heads;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    mbar_init(empty_q, 2);
    for (int s = 0; s < 2; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], 2);
      mbar_init(&empty_v[s], 2);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  if (wg == 0) {  // producer: one thread issues every TMA load
    setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      int kv = 0;  // KV tiles loaded so far (all tiles of this CTA): stage kv % 2
      for (int tile = blockIdx.x, ti = 0; tile < tiles; tile += gridDim.x, ++ti) {
        const Tile u = tile_of(p, tile, L::kBM, L::kBN);
        mbar_wait(empty_q, (ti & 1) ^ 1);
        mbar_arrive_expect_tx(full_q, L::kQBytes);
        for (int x = 0; x < L::kBoxes; ++x)
          tma_load_4d(smem + x * L::kBM * 128, &tq, full_q, 64 * x, u.h, u.row0, u.b);
        for (int n = u.n_hi; n >= u.n_lo; --n, ++kv) {
          const int s = kv & 1;
          const uint32_t ph = (kv >> 1) & 1;
          mbar_wait(&empty_k[s], ph ^ 1);
          mbar_arrive_expect_tx(&full_k[s], L::kKvBytes);
          for (int x = 0; x < L::kBoxes; ++x)
            tma_load_4d(smem + L::kK + s * L::kKvBytes + x * L::kBN * 128, &tk, &full_k[s], 64 * x,
                        u.g, n * L::kBN, u.b);
          mbar_wait(&empty_v[s], ph ^ 1);
          mbar_arrive_expect_tx(&full_v[s], L::kKvBytes);
          for (int x = 0; x < L::kBoxes; ++x)
            tma_load_4d(smem + L::kV + s * L::kKvBytes + x * L::kBN * 128, &tv, &full_v[s], 64 * x,
                        u.g, n * L::kBN, u.b);
        }
      }
    }
    return;
  }

  setmaxnreg_inc<240>();
  const int c = wg - 1;  // query rows [64 c, 64 c + 64) of the tile
  const int t = threadIdx.x % 128, w = t / 32, l = t % 32;
  const uint32_t base = smem_addr(smem);
  int kv = 0;
  for (int tile = blockIdx.x, ti = 0; tile < tiles; tile += gridDim.x, ++ti) {
    const Tile r = tile_of(p, tile, L::kBM, L::kBN);
    const int b = r.b, h = r.h;
    const int n_count = r.n_hi - r.n_lo + 1;
    int rows[2], ds_row[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      rows[i] = r.row0 + 64 * c + 16 * w + 8 * i + l / 4;
      ds_row[i] =
          p.doc_start ? p.doc_start[static_cast<int64_t>(b) * p.S + min(rows[i], p.S - 1)] : 0;
    }
    const int ds_last = p.doc_start ? p.doc_start[static_cast<int64_t>(b) * p.S + r.row_last] : 0;

    float o[D / 2];
#pragma unroll
    for (int e = 0; e < D / 2; ++e) o[e] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY},
          row_sum[2] = {0.0f, 0.0f};  // log2 domain; partial sums

    mbar_wait(full_q, ti & 1);
    for (int it = 0; it < n_count; ++it, ++kv) {
      const int n = r.n_hi - it, s = kv & 1;
      const uint32_t ph = (kv >> 1) & 1;
      float sc[64];  // S = Q K^T, (64, 128)
      mbar_wait(&full_k[s], ph);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk / 4) * L::kBM * 128 + (kk % 4) * 32;
        const uint64_t da = wgmma_desc(base + off + c * 64 * 128, 16, 1024);
        const uint64_t db = wgmma_desc(base + L::kK + s * L::kKvBytes + off, 16, 1024);
        wgmma_m64n128k16<0, 0>(sc, da, db, kk > 0 ? 1u : 0u);
      }
      wgmma_commit();
      wgmma_wait<0>();
      if (t == 0) {
        mbar_arrive(&empty_k[s]);
        if (it == n_count - 1) mbar_arrive(empty_q);  // the tile's last read of Q
      }

      // Mask unless every (row, key) pair of the tile is visible.
      const int key0 = n * L::kBN;
      if (!(key0 + L::kBN - 1 <= r.row0 && ds_last <= key0)) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = key0 + 8 * j + 2 * (l % 4) + e;
              if (key > rows[i] || key < ds_row[i]) sc[4 * j + 2 * i + e] = -INFINITY;
            }
      }
      // Online softmax: row max over the quad's 4 lanes, p = 2^(s scale log2e - max).
      float corr[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = row_max[i];
#pragma unroll
        for (int j = 0; j < 16; ++j)
          mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * i], sc[4 * j + 2 * i + 1]) * p.scale_log2);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float use = mx == -INFINITY ? 0.0f : mx;  // a row with no visible key so far
        corr[i] = exp2_approx(row_max[i] - use);
        row_max[i] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[4 * j + 2 * i + e];
            x = exp2_approx(__fmaf_rn(x, p.scale_log2, -use));
            sum += x;
          }
        row_sum[i] = __fmaf_rn(row_sum[i], corr[i], sum);
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          o[4 * j + 2 * i] *= corr[i];
          o[4 * j + 2 * i + 1] *= corr[i];
        }

      // O += P V: P (64, 128) from registers, V (128, D) MN-major in shared memory.
      uint32_t pa[L::kBN / 16]
                 [4];  // converted first: an in-flight wgmma's registers stay untouched
#pragma unroll
      for (int kk = 0; kk < L::kBN / 16; ++kk) to_a_fragment<128>(sc, kk, pa[kk]);
      mbar_wait(&full_v[s], ph);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < L::kBN / 16; ++kk) {
        const uint64_t db =
            wgmma_desc(base + L::kV + s * L::kKvBytes + kk * 2048, L::kBN * 128, 1024);
        if constexpr (D == 128)
          wgmma_rs_n128<1>(o, pa[kk], db, 1u);
        else
          wgmma_rs_n64<1>(o, pa[kk], db, 1u);
      }
      wgmma_commit();
      wgmma_wait<0>();
      if (t == 0) mbar_arrive(&empty_v[s]);
    }

    // Epilogue: O / l in BF16, lse = (max + log2 l) ln 2.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = row_sum[i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (rows[i] >= p.S) continue;
      const float inv = 1.0f / sum;
      uint16_t* orow = p.o + ((static_cast<int64_t>(b) * p.S + rows[i]) * p.Hq + h) * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * (l % 4)) =
            pack_bf16x2(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
      if (l % 4 == 0)
        p.lse[(static_cast<int64_t>(b) * p.Hq + h) * p.S + rows[i]] =
            (row_max[i] + log2f(sum)) * kLn2;
    }
  }
}

template <int D>
void launch_forward(const FlashAttentionShape& sh, const uint16_t* q, const uint16_t* k,
                    const uint16_t* v, const int32_t* doc_start, uint16_t* o, float* lse,
                    cudaStream_t stream) {
  using L = FwdLayout<D>;
  const CUtensorMap tq = make_head_map(q, sh.batch, sh.seq, sh.q_heads, D, L::kBM);
  const CUtensorMap tk = make_head_map(k, sh.batch, sh.seq, sh.kv_heads, D, L::kBN);
  const CUtensorMap tv = make_head_map(v, sh.batch, sh.seq, sh.kv_heads, D, L::kBN);
  FwdParams p;
  p.S = static_cast<int>(sh.seq);
  p.Hq = static_cast<int>(sh.q_heads);
  p.group = static_cast<int>(sh.q_heads / sh.kv_heads);
  p.m_tiles = static_cast<int>((sh.seq + L::kBM - 1) / L::kBM);
  p.batch_heads = static_cast<int>(sh.batch * sh.q_heads);
  p.scale_log2 = sh.scale * kLog2e;
  p.doc_start = doc_start;
  p.o = o;
  p.lse = lse;
  static const bool configured = set_max_dynamic_smem(flash_fwd_kernel<D>, L::kSmem);
  (void)configured;
  static const int sms = [] {
    int dev = 0, n = 0;
    PACKMOE_CUDA_CHECK(cudaGetDevice(&dev));
    PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const dim3 grid(static_cast<unsigned>(std::min(p.m_tiles * p.batch_heads, sms)));
  flash_fwd_kernel<D><<<grid, 384, L::kSmem, stream>>>(tq, tk, tv, p);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Status flash_attention_forward_sm90(const FlashAttentionShape& shape, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, const int32_t* doc_start,
                                    uint16_t* o, float* lse, cudaStream_t stream) {
  PACKMOE_RETURN_IF_ERROR(flash_check_shape(shape));
  if (shape.batch * shape.seq == 0) return Status::ok();
  if (shape.head_dim == 128)
    launch_forward<128>(shape, q, k, v, doc_start, o, lse, stream);
  else if (shape.head_dim == 64)
    launch_forward<64>(shape, q, k, v, doc_start, o, lse, stream);
  else
    flash_simple_forward(shape, q, k, v, doc_start, o, lse, stream);
  return Status::ok();
}

}  // namespace packmoe::cuda
