// Shared pieces of the grouped kernels: the per-launch group table (one launch covers every
// group), tile -> group mapping (O(1) when every group has the same tile count, else a binary search
// over the tiles' prefix sum, in shared memory when the table fits), 16-byte memory helpers, packed
// BF16 max, the hardware FP8 conversion and the E2M1 encoders proven equal to the shared codecs.
// Invariant: a kernel never branches on anything but the table, so a packed (E, N, K) tensor and E
// discrete pointers run exactly the same instructions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/codecs.h"
#include "core/philox.h"

namespace packmoe::cuda {

// Exact unsigned division t / d for t < 2^31 by a multiply and a shift (d >= 1): with
// s = 31 + ceil(log2 d) and m = ceil(2^s / d) < 2^32, t * m / 2^s = t / d + t * e / (d * 2^s) with
// e = m * d - 2^s < d, and t * e < 2^31 * 2^ceil(log2 d) = 2^s keeps the floor exact. A hardware
// 32-bit division is ~20 instructions; kernels divide tile indices once or twice per tile.
struct FastDiv {
  uint32_t d = 1;
  uint32_t m = 1u << 31;
  uint32_t s = 31;
  FastDiv() = default;
  explicit FastDiv(uint32_t div) : d(div) {
    uint32_t l = 0;
    while ((1ull << l) < div) ++l;
    s = 31 + l;
    m = static_cast<uint32_t>(((1ull << s) + div - 1) / div);
  }
  __device__ __forceinline__ uint32_t div(uint32_t t) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(t) * m) >> s);
  }
};

// Group descriptors of one launch. Up to kInline groups travel inside the kernel parameters (the
// per-expert loop and small packs need no upload); larger tables are uploaded by one async copy.
// Each G has a `tile_begin` field: the exclusive prefix sum of the groups' tile counts.
template <typename G, int kInline>
struct GroupTable {
  const G* uploaded;  // (count,) in device memory, or null when the groups are inline
  int count;
  uint32_t total_tiles;
  // Every group owns exactly this many tiles (no empty group): group = tile / uniform_tiles. 0 when
  // the counts differ. Packed weights (E groups of N rows) always take this path.
  uint32_t uniform_tiles;
  FastDiv uniform_div;  // division by uniform_tiles
  G local[kInline];

  // The table is a __grid_constant__ parameter, so indexing `local` at run time reads parameter
  // memory in place instead of copying the array to local memory.
  __device__ __forceinline__ const G& operator[](int g) const {
    return uploaded ? uploaded[g] : local[g];
  }

  // The group of tile `t`: the last g with tile_begin <= t. Empty groups share tile_begin with
  // the next group, so they are never chosen.
  __device__ __forceinline__ int find(uint32_t t) const {
    if (uniform_tiles) return static_cast<int>(uniform_div.div(t));
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((*this)[mid].tile_begin <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // Whether a persistent kernel should copy the tile_begin column to shared memory (see
  // load_tile_begins): only a non-uniform uploaded table of at most kMax groups.
  template <int kMax>
  __device__ __forceinline__ bool begins_in_smem() const {
    return !uniform_tiles && uploaded && count <= kMax;
  }

  // Persistent kernels: once per CTA, the tile_begin column into `smem` (caller syncs before
  // find_smem). A binary search of global memory is a chain of ~log2(G) dependent loads per tile.
  template <int kMax>
  __device__ __forceinline__ void load_tile_begins(uint32_t* smem) const {
    if (!begins_in_smem<kMax>()) return;
    for (int g = threadIdx.x; g < count; g += blockDim.x) smem[g] = uploaded[g].tile_begin;
  }

  template <int kMax>
  __device__ __forceinline__ int find_smem(uint32_t t, const uint32_t* smem) const {
    if (!begins_in_smem<kMax>()) return find(t);
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (smem[mid] <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
};

template <typename G, int kInline>
GroupTable<G, kInline> make_group_table(CudaBackend& be, const std::vector<G>& groups,
                                        uint64_t total_tiles) {
  PACKMOE_CHECK(total_tiles < (1ull << 31), "grid of " << total_tiles << " tiles is too large");
  GroupTable<G, kInline> t{};
  t.count = static_cast<int>(groups.size());
  t.total_tiles = static_cast<uint32_t>(total_tiles);
  // Uniform when every group has the same (non-zero) tile count; tile_begin is the prefix sum, so
  // group g then starts at g * n.
  t.uniform_tiles = 0;
  if (!groups.empty() && total_tiles > 0 && total_tiles % groups.size() == 0) {
    const uint32_t n = static_cast<uint32_t>(total_tiles / groups.size());
    bool uniform = true;
    for (size_t g = 0; g < groups.size() && uniform; ++g)
      uniform = groups[g].tile_begin == static_cast<uint32_t>(g) * n;
    if (uniform) {
      t.uniform_tiles = n;
      t.uniform_div = FastDiv(n);
    }
  }
  if (groups.size() <= static_cast<size_t>(kInline)) {
    t.uploaded = nullptr;
    for (size_t g = 0; g < groups.size(); ++g) t.local[g] = groups[g];
  } else {
    t.uploaded = static_cast<const G*>(be.upload(groups.data(), groups.size() * sizeof(G)));
  }
  return t;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- memory
// ----------------------------------------------------------------------------------------

// Streaming 16-byte load of read-once input (no L1 allocation: nothing is re-read by this CTA).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte global -> shared copy that bypasses registers (sm_80+ LDGSTS); `bytes` 0 writes zeros
// (rows or columns outside the matrix). Completion: cp_async_commit / cp_async_wait.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Element i of a 16-byte chunk, as FP32 (BF16 widens exactly).
template <typename In>
__device__ __forceinline__ float chunk_elem(const uint4& v, int i);

template <>
__device__ __forceinline__ float chunk_elem<float>(const uint4& v, int i) {
  const uint32_t w = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  return __uint_as_float(w);
}

template <>
__device__ __forceinline__ float chunk_elem<uint16_t>(const uint4& v, int i) {
  const uint32_t w = (i >> 1) == 0 ? v.x : (i >> 1) == 1 ? v.y : (i >> 1) == 2 ? v.z : v.w;
  return __uint_as_float((i & 1) ? (w & 0xFFFF0000u) : (w << 16));
}

// Scalar element load for the unaligned / ragged fallback paths.
template <typename In>
__device__ __forceinline__ float load_elem(const In* p);
template <>
__device__ __forceinline__ float load_elem<float>(const float* p) {
  return __ldg(p);
}
template <>
__device__ __forceinline__ float load_elem<uint16_t>(const uint16_t* p) {
  return bf16_to_f32(__ldg(p));
}

// ---- FP8 conversion
// --------------------------------------------------------------------------------

// Hardware RNE + satfinite conversion of (lo, hi) to two FP8 bytes, lo in the low byte. Used only
// where the exhaustive self-test (selftest.cu) proved it equal to the software codec.
template <bool kE5M2>
__device__ __forceinline__ uint32_t cvt_fp8x2(float lo, float hi) {
  uint16_t r;
  if constexpr (kE5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// ---- packed BF16 max
// ----------------------------------------------------------------------------

// |a| and |b| per BF16 half, maximum per half: max.bf16x2 returns the non-NaN operand when one is
// NaN and keeps subnormals (no .ftz form exists for bf16), so the max of BF16 values is exact and
// ignores NaN like amax_update. Comparing the halves as floats afterwards (amax_of_bf16x2) keeps
// a block of NaNs at amax 0.
__device__ __forceinline__ uint32_t abs_bf16x2(uint32_t w) { return w & 0x7FFF7FFFu; }
__device__ __forceinline__ uint32_t max_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// amax_update(a, .) over both halves of a word of non-negative BF16 values (or NaNs).
__device__ __forceinline__ float amax_bf16x2(float a, uint32_t w) {
  const float lo = __uint_as_float(w << 16);
  const float hi = __uint_as_float(w & 0xFFFF0000u);
  a = lo > a ? lo : a;  // a NaN half compares false and never wins
  return hi > a ? hi : a;
}

// max(a, |x|) for a >= 0, never NaN: one FMNMX with an |x| operand. Equal to amax_update(a, x)
// (formats/mxfp8_math.h): PTX max.f32 returns the non-NaN operand when x is NaN, and with no -0
// among the operands equal values have equal bits.
__device__ __forceinline__ float amax_fast(float a, float x) { return fmaxf(a, fabsf(x)); }

// ---- E8M0 block scales (MXFP8)
// ----------------------------------------------------------------------
// Branch-free forms of f32_to_e8m0_rceil(v) and e8m0_reciprocal(code) for v = amax * (1/max_norm)
// with amax >= 0 and never NaN (Inf allowed). Used only where selftest.cu found them equal to
// mxfp8_scale_code / e8m0_reciprocal for every such amax and both FP8 elements.
// Round the exponent up when any mantissa bit is set, saturate at 0xFE (254); FP32 subnormals at
// or below 2^-127 (0x00400000) are code 0 (2^-127), larger subnormals code 1.
__device__ __forceinline__ uint32_t e8m0_code_fast(float v) {
  uint32_t b = __float_as_uint(v);
  b = b <= 0x00400000u ? 0u : b;
  return min((b + 0x007FFFFFu) >> 23, 0xFEu);
}
// 2^(127 - code) for code <= 254; code 254 gives 2^-127, an FP32 subnormal.
__device__ __forceinline__ float e8m0_rcp_fast(uint32_t code) {
  return __uint_as_float(code == 0xFEu ? 0x00400000u : (254u - code) << 23);
}

// ---- BF16 rounding
// -----------------------------------------------------------------------------------
// Hardware RNE of y to BF16, widened back to FP32. Equal to bf16_to_f32(f32_to_bf16(y)) as a value
// for every FP32 y where selftest.cu checked it (a NaN stays a NaN; only its payload may differ,
// which no later step can see: max ignores NaN and x * r turns any NaN into the canonical one).
__device__ __forceinline__ float round_bf16_hw(float y) {
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(y));
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// ---- E2M1 (NVFP4) element encoders
// ------------------------------------------------------------------
// Integer / rounding-mode formulations of f32_to_e2m1 and f32_to_e2m1_sr (core/codecs.h). They
// are used only where selftest.cu found them equal to the shared codec for every FP32 input y (and
// every random byte, for SR) on this device; otherwise the kernels call the shared functions.
// `y` must come out of an FMUL (x * r): the GPU turns every NaN product into the canonical +NaN
// 0x7FFFFFFF, which both encoders map to +6 (code 7) like the shared codec.

// RNE with saturation, by the FP adder. a = min(|y|, 6) (a NaN y gives 6: min returns the other
// operand) lies in binade j = 0, 1, 2 for a < 2, [2, 4), [4, 6], where the E2M1 grid step is
// 2^(j-1). M = 2^(22+j) with mantissa bits 2j has that step as its ulp, so a + M = M + n with
// n = RNE(a / step) (ties to even n: M's mantissa is even), and the sum's low 3 bits are 2j + n,
// the magnitude code (n <= 4, 2 + n <= 6, 4 + n <= 7: no carry). (a + M) - M = n * step exactly:
// the rounded magnitude itself. sum = bits(a + M).
struct E2m1Rounded {
  uint32_t sum;
  float m;
};
__device__ __forceinline__ E2m1Rounded e2m1_rn_round(float y) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t e = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);  // 2^j
  const uint32_t m = e + (22u << 23) + ((e >> 22) - 0xFEu);  // exponent + 22, mantissa 2j
  return {__float_as_uint(a + __uint_as_float(m)), __uint_as_float(m)};
}
__device__ __forceinline__ uint32_t e2m1_rn_fast(float y) {
  return (e2m1_rn_round(y).sum & 7u) | ((__float_as_uint(y) >> 28) & 8u);
}

// Stochastic rounding with 8 random bits r (f32_to_e2m1_sr), by the round-down adder. With lo the
// grid value at or below |y| and step the spacing above it, the shared codec rounds up exactly
// when floor(256 (|y| - lo) / step) + r >= 256 (its comparison is exact), i.e. when adding r to
// the 8 bits below the grid position carries. a and j as in e2m1_rn_round; M = 2^(14+j) with
// mantissa 512j has the ulp step / 256, so bits(a +rd M) = bits(M) + P with P = floor(256 a /
// step), and sum = bits(a +rd M) + r holds 2j + ((P + r) >> 8), the magnitude code (at most 7:
// a <= 6), in its bits 8..11 (zeros above). (sum with the low byte cleared) - M = n * step: the
// rounded magnitude.
__device__ __forceinline__ E2m1Rounded e2m1_sr_round(float y, uint32_t r) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t e = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);  // 2^j
  const uint32_t m = e + (14u << 23) + ((e >> 14) - 0xFE00u);  // exponent + 14, mantissa 512j
  return {__float_as_uint(__fadd_rd(a, __uint_as_float(m))) + r, __uint_as_float(m)};
}
__device__ __forceinline__ uint32_t e2m1_sr_fast(float y, uint32_t r) {
  return ((e2m1_sr_round(y, r).sum >> 8) & 7u) | ((__float_as_uint(y) >> 28) & 8u);
}

// The signed value of the E2M1 code of y, f32-exact: e2m1_to_f32(f32_to_e2m1(y)) (RNE) and
// e2m1_to_f32(f32_to_e2m1_sr(y, r)) (SR), for quantizers that keep a copy as its values only.
// The same adders as e2m1_rn_round / e2m1_sr_round with M's mantissa 0 (no code in the sum): the
// rounding is the same, since M and M + 2j (ulps) are both even; the sign bit of y is or-ed in (a
// zero that y rounds to keeps y's sign, as code 8 decodes to -0).
__device__ __forceinline__ float e2m1_rn_value(float y) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t e = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);  // 2^j
  const float m = __uint_as_float(e + (22u << 23));                       // 2^(22+j)
  const float g = __fsub_rn(__fadd_rn(a, m), m);
  return __uint_as_float(__float_as_uint(g) | (__float_as_uint(y) & 0x80000000u));
}
__device__ __forceinline__ float e2m1_sr_value(float y, uint32_t r) {
  const float a = fminf(fabsf(y), 6.0f);
  const uint32_t e = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);  // 2^j
  const float m = __uint_as_float(e + (14u << 23));                       // 2^(14+j)
  const uint32_t s = __float_as_uint(__fadd_rd(a, m)) + r;
  const float g = __fsub_rn(__uint_as_float(s & ~0xFFu), m);
  return __uint_as_float(__float_as_uint(g) | (__float_as_uint(y) & 0x80000000u));
}

// e4m3_to_f32 (core/codecs.h) by the hardware FP8 -> F16 conversion (exact: every E4M3 value is an
// F16 value) and F16 -> F32; NaN codes give a NaN.
__device__ __forceinline__ float e4m3_to_f32_hw(uint32_t code) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(code & 0xFFu)));
  float f;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.f32.f16 %0, l;\n\t}" : "=f"(f) : "r"(h2));
  return f;
}

// rht16_scaled (formats/nvfp4_math.h), (y + 0) * 0.25, as one FMA: y * 0.25 is the exact product
// rounded once either way, and an exact -0 product plus +0 is +0.
__device__ __forceinline__ float rht16_scaled_fma(float y) { return __fmaf_rn(y, 0.25f, 0.0f); }

// Eight E2M1 codes in one word, element i in nibble i: the magnitude is byte kByte of mag[i]
// (0..7, zeros above it), the sign bit 31 of sgn[i]. Byte permutes gather the even and the odd
// elements' bytes (prmt's sign-replicate mode spreads a byte's top bit over the byte).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
template <int kByte>
__device__ __forceinline__ uint32_t pack_e2m1x8(const uint32_t (&mag)[8],
                                                const uint32_t (&sgn)[8]) {
  auto gather = [](const uint32_t (&v)[8], int i, uint32_t sel) {  // bytes of v[i], v[i+2], ..
    return prmt(prmt(v[i], v[i + 2], sel), prmt(v[i + 4], v[i + 6], sel), 0x5410u);
  };
  constexpr uint32_t kSel = 0x40u + 0x11u * kByte;
  const uint32_t even = gather(mag, 0, kSel) | (gather(sgn, 0, 0xFBu) & 0x08080808u);
  const uint32_t odd = gather(mag, 1, kSel) | (gather(sgn, 1, 0xFBu) & 0x08080808u);
  return even | (odd << 4);
}

// Random byte j (0..15) of a 16-element block's draw, as nvfp4_sr_byte (formats/nvfp4_math.h):
// byte j % 4 of word j / 4, by one byte permute.
__device__ __forceinline__ uint32_t sr_byte(const Philox4& draw, int j) {
  return __byte_perm(draw.v[j >> 2], 0u, 0x4440u | static_cast<uint32_t>(j & 3));
}

// One grid-stride-free launch shape: ceil(n / per) blocks.
inline unsigned blocks_for(uint64_t n, uint64_t per) {
  const uint64_t b = (n + per - 1) / per;
  PACKMOE_CHECK(b < (1ull << 31), "grid of " << b << " blocks is too large");
  return static_cast<unsigned>(b);
}

}  // namespace packmoe::cuda
