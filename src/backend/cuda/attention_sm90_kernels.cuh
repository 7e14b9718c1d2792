// Tiled attention kernels that keep backend/ops/model.h's exact FP32 orders (device code only; included by
// attention_sm90.cu). Invariant: every value is the CPU reference's bits. Two facts make tiling
// legal: (1) an R32 dot over d needs no warp: one thread computes lane partials in the bit-reversed
// leaf order and merges them as a binary counter, which IS the butterfly tree; (2) an R32 sum over
// keys (or query pairs) n puts term n into lane n % 32, so a CTA can finish lane after lane
// ("passes": keys j = l, l + 32, ... in order) and merge the lanes' results by the same counter,
// holding one partial vector per output instead of 32.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/ops/model.h"

namespace packmoe::attn {

#ifndef PACKMOE_ATTN_HOST_EMULATION
__device__ __forceinline__ float* attn_smem() {
  extern __shared__ float4 attn_smem_raw[];
  return reinterpret_cast<float*>(attn_smem_raw);
}
#endif

constexpr int kThreads = 256;     // 8 warps; the role layouts below assume it
constexpr int kRows = 64;         // forward / dq: query rows (heads x positions) per CTA
constexpr int kKeys = 32;         // forward / dq: keys per chunk
constexpr int kPairs = 64;        // dk / dv: query pairs per chunk
constexpr int kMaxHeadDim = 128;  // beyond: the one-warp-per-row kernels

__host__ __device__ constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }
__host__ __device__ constexpr int bit_reverse(int k, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((k >> b) & 1) << (bits - 1 - b);
  return r;
}
// Number of trailing one bits of k (the merges of a binary counter when leaf k arrives).
__host__ __device__ constexpr int trailing_ones(int k) {
  return (k & 1) ? 1 + trailing_ones(k >> 1) : 0;
}
__host__ __device__ constexpr int imin(int a, int b) { return a < b ? a : b; }

// Head-dim geometry: D padded to kDp (16, 32, 64 or 128; zeros past D add +0 terms, an identity
// on values). A row lives in shared memory as kDp / 4 "leaves" of 4 floats; leaf s holds the dims
// whose products form node s of the R32 tree's first level at which nodes hold 4 products:
//   kDp = 128: lane s's four terms d = s + 32 e, summed as the lane's chain;
//   kDp = 64:  lanes s (d = s, s + 32) and s + 16 (d = s + 16, s + 48): chain + chain;
//   kDp = 32:  lanes s, s + 16, s + 8, s + 24: (p + p) + (p + p), the tree's first two levels;
//   kDp = 16:  lanes s, s + 8, s + 4, s + 12 (the 16 lanes of D <= 16; lanes 16..31 are empty,
//              so the tree's first level adds +0 there, an identity on values).
// The tree over the leaves is then the balanced tree in bit-reversed leaf order. Outputs use the
// same positions p = 4 s + e.
template <int kDp_>
struct Geo {
  static constexpr int kDp = kDp_;
  static constexpr int kLeaves = kDp / 4;
  static constexpr int kRS = kDp + 4;           // row stride: 8 consecutive rows on distinct banks
  static constexpr int kTD = kDp / 16;          // output positions per thread (16 groups)
  static constexpr int kW = kTD < 4 ? kTD : 4;  // their vector width
  static constexpr int kNC = kTD / kW;          // vectors per thread
  static constexpr int kC0 = kDp >= 128 ? 32 : kDp / 2, kC1 = kDp >= 128 ? 64 : kDp / 4;
  static_assert(kDp == 16 || kDp == 32 || kDp == 64 || kDp == 128, "geometry");
  __host__ __device__ static constexpr int dim_of(int p) {
    return p / 4 + kC0 * (p & 1) + kC1 * ((p >> 1) & 1);
  }
  __device__ __forceinline__ static float leaf(float x0, float x1, float x2, float x3) {
    if constexpr (kDp >= 128)
      return ((x0 + x1) + x2) + x3;
    else
      return (x0 + x1) + (x2 + x3);
  }
};

template <int kN>
struct Vec;
template <>
struct Vec<1> {
  __device__ __forceinline__ static void load(const float* p, float* v) { v[0] = p[0]; }
};
template <>
struct Vec<2> {
  __device__ __forceinline__ static void load(const float* p, float* v) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x;
    v[1] = x.y;
  }
};
template <>
struct Vec<4> {
  __device__ __forceinline__ static void load(const float* p, float* v) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  }
};

// out[m][n] = R32 sum_d a_m[d] * b_n[d] for kM x kN rows in shared memory, the CPU's bits. Lane
// chains run without the reference's leading +0 and the tree is evaluated as a binary counter over
// the leaves in bit-reversed order; every node then equals the reference's as a value and can
// differ only in the sign of a zero, while the reference's result is never -0 (a sum started at
// +0 reaches -0 only from -0 + -0), so one final + 0.0f restores the bits.
template <class G, int kM, int kN>
__device__ __forceinline__ void exact_dots(const float* const (&a)[kM], const float* const (&b)[kN],
                                           float (&out)[kM][kN]) {
  constexpr int kLev = ilog2(G::kLeaves);
  float st[kLev + 1][kM][kN];
#pragma unroll
  for (int k = 0; k < G::kLeaves; ++k) {
    const int s = bit_reverse(k, kLev);
    float av[kM][4], bv[kN][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) Vec<4>::load(a[m] + 4 * s, av[m]);
#pragma unroll
    for (int n = 0; n < kN; ++n) Vec<4>::load(b[n] + 4 * s, bv[n]);
    const int merges = trailing_ones(k);
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        float cur = G::leaf(av[m][0] * bv[n][0], av[m][1] * bv[n][1], av[m][2] * bv[n][2],
                            av[m][3] * bv[n][3]);
#pragma unroll
        for (int lev = 0; lev < merges; ++lev) cur = st[lev][m][n] + cur;
        st[merges][m][n] = cur;
      }
  }
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int n = 0; n < kN; ++n) out[m][n] = st[kLev][m][n] + 0.0f;
}

// Rows into shared memory in the leaf layout: row r (< count) from src(r) (null: zeros), dims
// >= D zero. Leaves are the fastest index, so a warp's loads of one element e read consecutive
// dims of a row.
template <class G, class Src>
__device__ __forceinline__ void load_rows(float* dst, int count, int D, Src src) {
  for (int item = threadIdx.x; item < count * G::kLeaves; item += kThreads) {
    const int r = item / G::kLeaves, s = item % G::kLeaves;
    const float* p = src(r);
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = G::dim_of(4 * s + e);
      v[e] = (p != nullptr && d < D) ? __ldg(p + d) : 0.0f;
    }
    *reinterpret_cast<float4*>(dst + r * G::kRS + 4 * s) = float4{v[0], v[1], v[2], v[3]};
  }
}

// A thread's output block: rows (or keys) rx + 16 m, positions c * 16 kW + dg * kW + e.
template <class G, int kM>
struct OutBlock {
  float v[kM][G::kTD];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int x = 0; x < G::kTD; ++x) v[m][x] = 0.0f;
  }
  // v[m][.] += w[m] * row[positions] (row lane-major in shared memory).
  __device__ __forceinline__ void axpy(const float (&w)[kM], const float* row, int dg) {
#pragma unroll
    for (int c = 0; c < G::kNC; ++c) {
      float x[G::kW];
      Vec<G::kW>::load(row + c * 16 * G::kW + dg * G::kW, x);
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int e = 0; e < G::kW; ++e) v[m][c * G::kW + e] = v[m][c * G::kW + e] + w[m] * x[e];
    }
  }
  __device__ __forceinline__ void add_from(const OutBlock& o) {  // v = o + v
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int x = 0; x < G::kTD; ++x) v[m][x] = o.v[m][x] + v[m][x];
  }
  __device__ __forceinline__ static int position(int x, int dg) {
    return (x / G::kW) * 16 * G::kW + dg * G::kW + x % G::kW;
  }
};

// Merges the result of pass q (a leaf of the lane tree, passes in bit-reversed lane order) into
// the binary counter `stack` (levels in local memory); after the last pass `x` holds the root.
template <class T, int kLevels>
__device__ __forceinline__ void counter_push(T (&stack)[kLevels], T& x, int q, int passes) {
  int lev = 0;
  for (int c = q; c & 1; c >>= 1, ++lev) x.add_from(stack[lev]);
  if (q + 1 < passes) stack[lev] = x;
}

struct Scalar {  // a float with the OutBlock merge interface
  float v;
  __device__ __forceinline__ void add_from(const Scalar& o) { v = o.v + v; }
};

// The kA lanes of one pass are siblings in the tree (lanes l0 + s P): merge them as the tree does,
// slot s with s + kA / 2 first; the result lands in acc[0]. Fixed trip counts so that the loops
// unroll and acc stays in registers.
template <int kA, class T>
__device__ __forceinline__ void merge_slots(T (&acc)[kA]) {
#pragma unroll
  for (int lev = 0; lev < ilog2(kA); ++lev) {
    const int h = kA >> (lev + 1);
#pragma unroll
    for (int s = 0; s < kA / 2; ++s)
      if (s < h) {
        acc[s + h].add_from(acc[s]);  // acc[s + h] = acc[s] + acc[s + h]
        acc[s] = acc[s + h];
      }
  }
}

// ---- forward ------------------------------------------------------------------------------------
//
// CTA: query rows r < 64 = (head h0 + r / BI, position i0 + r % BI), HC heads of one KV group
// sharing every K / V row it loads. Pass 1: chunks of 32 consecutive keys, the row max with its
// index (the reference's sequential max keeps the first of equal values, which matters for +-0).
// Pass 2: kA lanes at a time (kA = 128 / Dp keeps 32 accumulators per thread), keys j = l0 +
// u * (32 / kA) in u order; slot u % kA is lane l0 + (u % kA) * (32 / kA).

struct FwdParams {
  AttentionArgs a;
  int heads_per_cta;  // HC, a power of two dividing Hq / Hkv
  int pos_per_cta;    // BI = 64 / HC
  int i_tiles;        // ceil(S / BI)
  int head_blocks;    // Hq / HC
};

template <class G>
struct FwdSmem {
  static constexpr int kQ = 0, kK = kQ + kRows * G::kRS, kV = kK + kKeys * G::kRS,
                       kP = kV + kKeys * G::kRS, kM = kP + kKeys * kRows, kL = kM + kRows,
                       kFloats = kL + kRows;
  static_assert(kKeys * kRows >= 2 * 16 * kRows, "pass-1 reduction fits the P tile");
};

// Role layouts shared by the forward and dq kernels (256 threads):
//  score: rows srow + 16 m (m < 4), chunk columns 2 skey + n (n < 2), a warp covering 8 columns;
//         a chunk of at most 16 keys uses column skey only (4 per warp), so all warps share it.
//  axpy:  rows xrow + 16 m (m < 4), positions of group xdg.
// The P tile is (32 columns, 64 rows) with row r at (r % 16) * 4 + r / 16: the axpy role's four
// rows are one float4.
struct Roles {
  int srow, skey, xrow, xdg, warp;
  __device__ __forceinline__ Roles() {
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    warp = w;
    srow = (w >> 2) * 8 + (lane >> 2);
    skey = (w & 3) * 4 + (lane & 3);
    xrow = (w >> 1) * 4 + (lane >> 3);
    xdg = (w & 1) * 8 + (lane & 7);
  }
  __device__ __forceinline__ int first_key_of_warp() const { return (warp & 3) * 8; }
};
__device__ __forceinline__ int ptile(int r) { return (r & 15) * 4 + (r >> 4); }

template <int kDp>
__global__ void __launch_bounds__(kThreads, 2)
    attention_fwd_kernel(const __grid_constant__ FwdParams p) {
  using G = Geo<kDp>;
  using S = FwdSmem<G>;
  constexpr int kA = 128 / G::kDp, kPasses = 32 / kA, kPassLev = ilog2(kPasses);
  const AttentionArgs& a = p.a;
  float* sm = attn_smem();
  float* qs = sm + S::kQ;  // (64, RS)
  float* ks = sm + S::kK;  // (32, RS)
  float* vs = sm + S::kV;  // (32, RS)
  float* ps = sm + S::kP;  // (32, 64)
  float* rowm = sm + S::kM;
  float* rowl = sm + S::kL;
  const Roles ro;
  const int tid = threadIdx.x;

  const int64_t Sq = a.seq, Hq = a.q_heads, Hkv = a.kv_heads;
  const int D = static_cast<int>(a.head_dim);
  const int per_i = static_cast<int>(a.batch) * p.head_blocks;
  const int it = p.i_tiles - 1 - static_cast<int>(blockIdx.x) / per_i;  // longest rows first
  const int rem = static_cast<int>(blockIdx.x) % per_i;
  const int64_t b = rem / p.head_blocks;
  const int64_t h0 = static_cast<int64_t>(rem % p.head_blocks) * p.heads_per_cta;
  const int64_t g = h0 / (Hq / Hkv);
  const int BI = p.pos_per_cta;
  const int i0 = it * BI;
  const int i_max = imin(i0 + BI, static_cast<int>(Sq)) - 1;
  auto row_i = [&](int r) { return i0 + r % BI; };
  auto q_row = [&](int r) -> const float* {
    const int i = row_i(r);
    return i < Sq ? a.q + ((b * Sq + i) * Hq + h0 + r / BI) * D : nullptr;
  };
  auto kv_off = [&](int j) { return ((b * Sq + j) * Hkv + g) * D; };

  load_rows<G>(qs, kRows, D, q_row);

  const float* qrow[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) qrow[m] = qs + (ro.srow + 16 * m) * G::kRS;
  const float* kcol[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) kcol[n] = ks + (2 * ro.skey + n) * G::kRS;

  // ---- pass 1: row max and the index of its first occurrence ----
  float best[4];
  int best_j[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    best[m] = -f32_from_bits(0x7F800000u);
    best_j[m] = 0x7FFFFFFF;
  }
  for (int j0 = 0; j0 <= i_max; j0 += kKeys) {
    const int nvalid = imin(kKeys, i_max - j0 + 1);
    __syncthreads();
    load_rows<G>(ks, kKeys, D, [&](int c) { return c < nvalid ? a.k + kv_off(j0 + c) : nullptr; });
    __syncthreads();
    if (ro.first_key_of_warp() < nvalid) {
      float e[4][2];
      exact_dots<G>(qrow, kcol, e);
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int j = j0 + 2 * ro.skey + n;
          const float s = e[m][n] * a.scale;
          // Ascending j per thread, so strict > keeps the first occurrence; a NaN s_0 is the
          // reference's result whatever follows.
          if (j <= row_i(ro.srow + 16 * m) && (s > best[m] || (j == 0 && s != s))) {
            best[m] = s;
            best_j[m] = j;
          }
        }
    }
  }
  {
    float* red_m = ps;                                     // (16, 64)
    int* red_j = reinterpret_cast<int*>(ps) + 16 * kRows;  // (16, 64)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      red_m[ro.skey * kRows + ro.srow + 16 * m] = best[m];
      red_j[ro.skey * kRows + ro.srow + 16 * m] = best_j[m];
    }
    __syncthreads();
    if (tid < kRows) {
      float m = red_m[tid];
      int jm = red_j[tid];
      for (int t = 1; t < 16; ++t) {
        const float x = red_m[t * kRows + tid];
        const int jx = red_j[t * kRows + tid];
        if (x != x || (m == m && (x > m || (x == m && jx < jm)))) {
          m = x;
          jm = jx;
        }
      }
      rowm[tid] = m;
    }
  }

  // ---- pass 2: p, l and o, lane by lane ----
  OutBlock<G, 4> acc[kA];
  Scalar lacc[kA];
  OutBlock<G, 4> ostack[kPassLev];
  Scalar lstack[kPassLev];
  for (int q = 0; q < kPasses; ++q) {
    const int l0 = bit_reverse(q, kPassLev);
    const int n_pass = i_max >= l0 ? (i_max - l0) / kPasses + 1 : 0;
#pragma unroll
    for (int s = 0; s < kA; ++s) {
      acc[s].zero();
      lacc[s].v = 0.0f;
    }
    for (int u0 = 0; u0 < n_pass; u0 += kKeys) {
      const int nvalid = imin(kKeys, n_pass - u0);
      __syncthreads();  // the last chunk's readers of ks / vs / ps (and pass 1's of ps) are done
      auto key_src = [&](const float* base) {
        return [&, base](int c) -> const float* {
          return c < nvalid ? base + kv_off(l0 + (u0 + c) * kPasses) : nullptr;
        };
      };
      load_rows<G>(ks, kKeys, D, key_src(a.k));
      load_rows<G>(vs, kKeys, D, key_src(a.v));
      __syncthreads();
      // kN = 2: columns 2 skey + n of a chunk; kN = 1: column skey of a chunk of <= 16 keys, so
      // that every warp still has work (the axpy reads no column past 16 then).
      auto scores = [&](auto kn) {
        constexpr int kN = decltype(kn)::value;
        const int col0 = kN * ro.skey;
        if ((ro.warp & 3) * 4 * kN < nvalid) {
          const float* kc[kN];
#pragma unroll
          for (int n = 0; n < kN; ++n) kc[n] = ks + (col0 + n) * G::kRS;
          float e[4][kN];
          exact_dots<G>(qrow, kc, e);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int r = ro.srow + 16 * m;
            const float mx = rowm[r];
#pragma unroll
            for (int n = 0; n < kN; ++n) {
              const int c = col0 + n;
              const int j = l0 + (u0 + c) * kPasses;
              const float pr = moe_exp_f32(e[m][n] * a.scale - mx);
              ps[c * kRows + ptile(r)] = (c < nvalid && j <= row_i(r)) ? pr : 0.0f;
            }
          }
        } else {
#pragma unroll
          for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int n = 0; n < kN; ++n) ps[(col0 + n) * kRows + ptile(ro.srow + 16 * m)] = 0.0f;
        }
      };
      if (nvalid > kKeys / 2)
        scores(std::integral_constant<int, 2>{});
      else
        scores(std::integral_constant<int, 1>{});
      __syncthreads();
      const int nround = (nvalid + kA - 1) / kA * kA;  // columns past nvalid hold p = 0, v = 0
      for (int c = 0; c < nround; c += kA) {
#pragma unroll
        for (int s = 0; s < kA; ++s) {
          float w[4];
          Vec<4>::load(ps + (c + s) * kRows + ro.xrow * 4, w);
          acc[s].axpy(w, vs + (c + s) * G::kRS, ro.xdg);
        }
      }
      if (tid < kRows) {
        for (int c = 0; c < nround; c += kA)
#pragma unroll
          for (int s = 0; s < kA; ++s) lacc[s].v = lacc[s].v + ps[(c + s) * kRows + ptile(tid)];
      }
    }
    merge_slots<kA>(acc);
    merge_slots<kA>(lacc);
    counter_push<OutBlock<G, 4>, kPassLev>(ostack, acc[0], q, kPasses);
    counter_push<Scalar, kPassLev>(lstack, lacc[0], q, kPasses);
  }

  if (tid < kRows) rowl[tid] = lacc[0].v;
  __syncthreads();
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = ro.xrow + 16 * m;
    const int i = row_i(r);
    if (i >= Sq) continue;
    float* o = a.o + ((b * Sq + i) * Hq + h0 + r / BI) * D;
    const float l = rowl[r];
#pragma unroll
    for (int x = 0; x < G::kTD; ++x) {
      const int d = G::dim_of(OutBlock<G, 4>::position(x, ro.xdg));
      if (d < D) o[d] = acc[0].v[m][x] / l;
    }
  }
  if (tid < kRows && row_i(tid) < Sq) {
    const int64_t row = (b * Hq + h0 + tid / BI) * Sq + row_i(tid);
    a.row_max[row] = rowm[tid];
    a.row_sum[row] = rowl[tid];
  }
}

// ---- backward: dq -------------------------------------------------------------------------------
//
// The forward's pass 2 with P_ij = exp(s - row_max) / row_sum from the saved statistics and
// dS_ij = P_ij (dP_ij - Dl_i) summed against k_j; dq = sum * scale.

struct BwdParams {
  AttentionBackwardArgs a;
  const float* dl;    // (B, Hq, S)
  int heads_per_cta;  // dq: as FwdParams
  int pos_per_cta;
  int i_tiles;
  int head_blocks;
  int u_tiles;  // dk / dv: key tiles per residue class
};

template <class G>
struct DqSmem {
  static constexpr int kQ = 0, kDo = kQ + kRows * G::kRS, kK = kDo + kRows * G::kRS,
                       kV = kK + kKeys * G::kRS, kP = kV + kKeys * G::kRS, kM = kP + kKeys * kRows,
                       kL = kM + kRows, kDl = kL + kRows, kFloats = kDl + kRows;
};

template <int kDp>
__global__ void __launch_bounds__(kThreads, 2)
    attention_dq_kernel(const __grid_constant__ BwdParams p) {
  using G = Geo<kDp>;
  using S = DqSmem<G>;
  constexpr int kA = 128 / G::kDp, kPasses = 32 / kA, kPassLev = ilog2(kPasses);
  const AttentionBackwardArgs& a = p.a;
  float* sm = attn_smem();
  float* qs = sm + S::kQ;
  float* dos = sm + S::kDo;
  float* ks = sm + S::kK;
  float* vs = sm + S::kV;
  float* ps = sm + S::kP;  // dS tile (32, 64)
  float* rowm = sm + S::kM;
  float* rowl = sm + S::kL;
  float* rowd = sm + S::kDl;
  const Roles ro;
  const int tid = threadIdx.x;

  const int64_t Sq = a.seq, Hq = a.q_heads, Hkv = a.kv_heads;
  const int D = static_cast<int>(a.head_dim);
  const int per_i = static_cast<int>(a.batch) * p.head_blocks;
  const int it = p.i_tiles - 1 - static_cast<int>(blockIdx.x) / per_i;
  const int rem = static_cast<int>(blockIdx.x) % per_i;
  const int64_t b = rem / p.head_blocks;
  const int64_t h0 = static_cast<int64_t>(rem % p.head_blocks) * p.heads_per_cta;
  const int64_t g = h0 / (Hq / Hkv);
  const int BI = p.pos_per_cta;
  const int i0 = it * BI;
  const int i_max = imin(i0 + BI, static_cast<int>(Sq)) - 1;
  auto row_i = [&](int r) { return i0 + r % BI; };
  auto q_off = [&](int r) { return ((b * Sq + row_i(r)) * Hq + h0 + r / BI) * D; };
  auto kv_off = [&](int j) { return ((b * Sq + j) * Hkv + g) * D; };

  load_rows<G>(qs, kRows, D,
               [&](int r) -> const float* { return row_i(r) < Sq ? a.q + q_off(r) : nullptr; });
  load_rows<G>(dos, kRows, D,
               [&](int r) -> const float* { return row_i(r) < Sq ? a.dout + q_off(r) : nullptr; });
  if (tid < kRows) {
    const bool ok = row_i(tid) < Sq;
    const int64_t row = (b * Hq + h0 + tid / BI) * Sq + row_i(tid);
    rowm[tid] = ok ? a.row_max[row] : 0.0f;
    rowl[tid] = ok ? a.row_sum[row] : 1.0f;
    rowd[tid] = ok ? p.dl[row] : 0.0f;
  }

  const float* qrow[4];
  const float* drow[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    qrow[m] = qs + (ro.srow + 16 * m) * G::kRS;
    drow[m] = dos + (ro.srow + 16 * m) * G::kRS;
  }

  OutBlock<G, 4> acc[kA];
  OutBlock<G, 4> ostack[kPassLev];
  for (int q = 0; q < kPasses; ++q) {
    const int l0 = bit_reverse(q, kPassLev);
    const int n_pass = i_max >= l0 ? (i_max - l0) / kPasses + 1 : 0;
#pragma unroll
    for (int s = 0; s < kA; ++s) acc[s].zero();
    for (int u0 = 0; u0 < n_pass; u0 += kKeys) {
      const int nvalid = imin(kKeys, n_pass - u0);
      __syncthreads();
      auto key_src = [&](const float* base) {
        return [&, base](int c) -> const float* {
          return c < nvalid ? base + kv_off(l0 + (u0 + c) * kPasses) : nullptr;
        };
      };
      load_rows<G>(ks, kKeys, D, key_src(a.k));
      load_rows<G>(vs, kKeys, D, key_src(a.v));
      __syncthreads();
      auto scores = [&](auto kn) {  // as in the forward
        constexpr int kN = decltype(kn)::value;
        const int col0 = kN * ro.skey;
        if ((ro.warp & 3) * 4 * kN < nvalid) {
          const float* kc[kN];
          const float* vc[kN];
#pragma unroll
          for (int n = 0; n < kN; ++n) {
            kc[n] = ks + (col0 + n) * G::kRS;
            vc[n] = vs + (col0 + n) * G::kRS;
          }
          float es[4][kN], ep[4][kN];
          exact_dots<G>(qrow, kc, es);
          exact_dots<G>(drow, vc, ep);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int r = ro.srow + 16 * m;
            const float mx = rowm[r], sum = rowl[r], dl = rowd[r];
#pragma unroll
            for (int n = 0; n < kN; ++n) {
              const int c = col0 + n;
              const int j = l0 + (u0 + c) * kPasses;
              const float P = moe_exp_f32(es[m][n] * a.scale - mx) / sum;
              const float dS = P * (ep[m][n] - dl);
              ps[c * kRows + ptile(r)] = (c < nvalid && j <= row_i(r)) ? dS : 0.0f;
            }
          }
        } else {
#pragma unroll
          for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int n = 0; n < kN; ++n) ps[(col0 + n) * kRows + ptile(ro.srow + 16 * m)] = 0.0f;
        }
      };
      if (nvalid > kKeys / 2)
        scores(std::integral_constant<int, 2>{});
      else
        scores(std::integral_constant<int, 1>{});
      __syncthreads();
      const int nround = (nvalid + kA - 1) / kA * kA;
      for (int c = 0; c < nround; c += kA) {
#pragma unroll
        for (int s = 0; s < kA; ++s) {
          float w[4];
          Vec<4>::load(ps + (c + s) * kRows + ro.xrow * 4, w);
          acc[s].axpy(w, ks + (c + s) * G::kRS, ro.xdg);
        }
      }
    }
    merge_slots<kA>(acc);
    counter_push<OutBlock<G, 4>, kPassLev>(ostack, acc[0], q, kPasses);
  }

#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = ro.xrow + 16 * m;
    if (row_i(r) >= Sq) continue;
    float* dq = a.dq + q_off(r);
#pragma unroll
    for (int x = 0; x < G::kTD; ++x) {
      const int d = G::dim_of(OutBlock<G, 4>::position(x, ro.xdg));
      if (d < D) dq[d] = acc[0].v[m][x] * a.scale;
    }
  }
}

// ---- backward: dk, dv ---------------------------------------------------------------------------
//
// dk_j / dv_j sum over the pairs n = (h, i) of key j (h over the KV group ascending, then i = j ..
// S-1), lane n % 32 with n = hl (S - j) + i - j. That lane depends on j only through j mod 32, so
// a CTA takes 16 keys of ONE residue class, j_u = jbase + 32 u, and every pass reads the same
// pairs for all of them. A pass takes kA lanes l0 + k P (P = 32 / kA, k < kA): per head hl the
// pairs i = i_first + P v (i_first the first i >= jbase in the class), whose slot k advances by
// one per v. Each head's run is preceded by k0 (the slot of its first pair) and followed by
// dummy pairs up to a multiple of 16, so slot = position % kA and every 16-pair block lies in one
// head (i increasing). Dummies and pairs with i < j_u are zero terms (+0 added to a sum that
// started at +0: an identity), and whole blocks of them are skipped.
//  score: keys kb * 8 + kl, pairs pb * 16 + pl + 4 n (n < 4); warp (kb, pb), 8 keys x 16 pairs.
//  axpy:  key xrow (a warp: 4 consecutive keys), positions of group xdg.

template <class G>
struct DkvSmem {
  static constexpr int kBR = 16;  // keys per CTA
  static constexpr int kK = 0, kV = kK + kBR * G::kRS, kQ = kV + kBR * G::kRS,
                       kDo = kQ + kPairs * G::kRS, kP = kDo + kPairs * G::kRS,
                       kDs = kP + kPairs * kBR, kPi = kDs + kPairs * kBR, kPh = kPi + kPairs,
                       kPm = kPh + kPairs, kPl = kPm + kPairs, kPd = kPl + kPairs,
                       kFloats = kPd + kPairs;
};

// The pairs of head hl in a pass (lane base l0, stride P) for keys jbase + 32 u.
struct HeadRun {
  int first;  // i of the first pair
  int count;  // real pairs
  int lead;   // dummies before them (the first pair's slot)
  int len;    // lead + count rounded up to 16; 0 without pairs
};
__device__ __forceinline__ HeadRun head_run(int S, int jbase, int l0, int P, int hl) {
  auto mod = [](int x, int m) { return ((x % m) + m) % m; };
  const int sj32 = mod(S - jbase, 32);
  const int first = jbase + mod(mod(l0 + jbase - hl * sj32, P) - jbase, P);
  HeadRun r{first, first < S ? (S - 1 - first) / P + 1 : 0, 0, 0};
  if (r.count > 0) {
    const int lane = mod(hl * sj32 + first - jbase, 32);  // = l0 + lead * P
    r.lead = (lane - l0) / P;
    r.len = (r.lead + r.count + 15) / 16 * 16;
  }
  return r;
}

template <int kDp>
__global__ void __launch_bounds__(kThreads, 2)
    attention_dkv_kernel(const __grid_constant__ BwdParams p) {
  using G = Geo<kDp>;
  using S = DkvSmem<G>;
  constexpr int kBR = S::kBR;
  constexpr int kA = 256 / kDp, kP = 32 / kA, kPassLev = ilog2(kP);
  static_assert(16 % kA == 0 && kPairs % 16 == 0, "slots align with the 16-pair blocks");
  const AttentionBackwardArgs& a = p.a;
  float* sm = attn_smem();
  float* ks = sm + S::kK;                         // (16, RS)
  float* vs = sm + S::kV;                         // (16, RS)
  float* qc = sm + S::kQ;                         // (64, RS) the chunk's q rows
  float* dc = sm + S::kDo;                        // (64, RS) its dout rows
  float* ps = sm + S::kP;                         // (64, 16) P
  float* dss = sm + S::kDs;                       // (64, 16) dS
  int* pi = reinterpret_cast<int*>(sm + S::kPi);  // (64) i of the pair, -1 for a dummy
  int* ph = reinterpret_cast<int*>(sm + S::kPh);  // (64) its head h (absolute)
  float* pm = sm + S::kPm;                        // row_max, row_sum, Dl of the pair
  float* pl = sm + S::kPl;
  float* pd = sm + S::kPd;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;

  const int64_t Sq = a.seq, Hq = a.q_heads, Hkv = a.kv_heads;
  const int Sn = static_cast<int>(Sq);
  const int Gq = static_cast<int>(Hq / Hkv);
  const int D = static_cast<int>(a.head_dim);
  const int per_u = static_cast<int>(a.batch * Hkv) * 32;
  const int ut = static_cast<int>(blockIdx.x) / per_u;  // most pairs first
  const int rem = static_cast<int>(blockIdx.x) % per_u;
  const int64_t b = rem / (static_cast<int>(Hkv) * 32);
  const int64_t g = (rem / 32) % Hkv;
  const int jbase = ut * 32 * kBR + rem % 32;
  auto key_j = [&](int u) { return jbase + 32 * u; };
  auto kv_off = [&](int u) { return ((b * Sq + key_j(u)) * Hkv + g) * D; };

  load_rows<G>(ks, kBR, D,
               [&](int u) -> const float* { return key_j(u) < Sq ? a.k + kv_off(u) : nullptr; });
  load_rows<G>(vs, kBR, D,
               [&](int u) -> const float* { return key_j(u) < Sq ? a.v + kv_off(u) : nullptr; });

  // Score role.
  const int kb = w >> 2, pb = w & 3, kl = lane >> 2, plane = lane & 3;
  const int skey = kb * 8 + kl;
  const float* krow[1] = {ks + skey * G::kRS};
  const float* vrow[1] = {vs + skey * G::kRS};
  const float* qcol[4];
  const float* dcol[4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    qcol[n] = qc + (pb * 16 + plane + 4 * n) * G::kRS;
    dcol[n] = dc + (pb * 16 + plane + 4 * n) * G::kRS;
  }
  const int score_first_j = key_j(kb * 8);
  // Axpy role.
  const int xrow = (w >> 1) * 4 + (lane >> 3), xdg = (w & 1) * 8 + (lane & 7);
  const int axpy_first_j = key_j((w >> 1) * 4);

  OutBlock<G, 1> acc_k[kA], acc_v[kA];
  OutBlock<G, 1> kstack[kPassLev], vstack[kPassLev];
  for (int q = 0; q < kP; ++q) {
    const int l0 = bit_reverse(q, kPassLev);
    int total = 0;
    for (int hl = 0; hl < Gq; ++hl) total += head_run(Sn, jbase, l0, kP, hl).len;
#pragma unroll
    for (int s = 0; s < kA; ++s) {
      acc_k[s].zero();
      acc_v[s].zero();
    }
    for (int p0 = 0; p0 < total; p0 += kPairs) {
      const int nvalid = imin(kPairs, total - p0);  // a multiple of 16
      __syncthreads();                              // previous chunk's readers are done
      if (tid < kPairs) {
        int i = -1, h = 0;
        if (tid < nvalid) {
          int idx = p0 + tid, hl = 0;
          for (;; ++hl) {
            const HeadRun r = head_run(Sn, jbase, l0, kP, hl);
            if (idx < r.len) {
              const int v = idx - r.lead;
              if (v >= 0 && v < r.count) i = r.first + kP * v;
              break;
            }
            idx -= r.len;
          }
          h = static_cast<int>(g) * Gq + hl;
        }
        pi[tid] = i;
        ph[tid] = h;
        const int64_t row = (b * Hq + h) * Sq + i;
        pm[tid] = i >= 0 ? a.row_max[row] : 0.0f;
        pl[tid] = i >= 0 ? a.row_sum[row] : 1.0f;
        pd[tid] = i >= 0 ? p.dl[row] : 0.0f;
      }
      __syncthreads();
      auto pair_src = [&](const float* base) {
        return [&, base](int c) -> const float* {
          return pi[c] >= 0 ? base + ((b * Sq + pi[c]) * Hq + ph[c]) * D : nullptr;
        };
      };
      load_rows<G>(qc, kPairs, D, pair_src(a.q));
      load_rows<G>(dc, kPairs, D, pair_src(a.dout));
      __syncthreads();
      // The block's pairs lie in one head with i increasing (dummies: -1), so its last entry
      // that is not a dummy is its largest i; the block is all zero terms for these 8 keys when
      // even that i is below the smallest key.
      int block_max_i = -1;
      for (int c = pb * 16; c < pb * 16 + 16; ++c)
        block_max_i = pi[c] > block_max_i ? pi[c] : block_max_i;
      if (block_max_i >= score_first_j) {
        float es[1][4], ep[1][4];
        exact_dots<G>(krow, qcol, es);
        exact_dots<G>(vrow, dcol, ep);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int c = pb * 16 + plane + 4 * n;
          const bool ok = pi[c] >= key_j(skey);
          const float P = moe_exp_f32(es[0][n] * a.scale - pm[c]) / pl[c];
          const float dS = P * (ep[0][n] - pd[c]);
          ps[c * kBR + skey] = ok ? P : 0.0f;
          dss[c * kBR + skey] = ok ? dS : 0.0f;
        }
      } else {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int c = pb * 16 + plane + 4 * n;
          ps[c * kBR + skey] = 0.0f;
          dss[c * kBR + skey] = 0.0f;
        }
      }
      __syncthreads();
      for (int c = 0; c < nvalid; c += kA) {
#pragma unroll
        for (int s = 0; s < kA; ++s) {
          if (pi[c + s] >= axpy_first_j) {  // else zero terms for this warp's 4 keys
            const float wp[1] = {ps[(c + s) * kBR + xrow]}, wd[1] = {dss[(c + s) * kBR + xrow]};
            acc_v[s].axpy(wp, dc + (c + s) * G::kRS, xdg);
            acc_k[s].axpy(wd, qc + (c + s) * G::kRS, xdg);
          }
        }
      }
    }
    merge_slots<kA>(acc_k);
    merge_slots<kA>(acc_v);
    counter_push<OutBlock<G, 1>, kPassLev>(kstack, acc_k[0], q, kP);
    counter_push<OutBlock<G, 1>, kPassLev>(vstack, acc_v[0], q, kP);
  }

  if (key_j(xrow) < Sq) {
    float* dk = a.dk + kv_off(xrow);
    float* dv = a.dv + kv_off(xrow);
#pragma unroll
    for (int x = 0; x < G::kTD; ++x) {
      const int d = G::dim_of(OutBlock<G, 1>::position(x, xdg));
      if (d < D) {
        dk[d] = acc_k[0].v[0][x] * a.scale;
        dv[d] = acc_v[0].v[0][x];
      }
    }
  }
}

}  // namespace packmoe::attn
