// Device helpers of the sm_90a flash attention kernels (flash_attention_fwd_sm90.cu,
// flash_attention_bwd_sm90.cu, flash_attention_dq_sm90.cu): the m64nNk16 BF16 wgmma forms that
// grouped_gemm_sm90_ptx.cuh lacks (N = 64 from shared memory; A from registers, N = 64 and 128),
// 4-D TMA tile loads, 1-D bulk loads, BF16 packing, exp2, the host-side 4-D tensor map of a
// (B, S, H, D) tensor, and the launch parameters the two backward kernels share.
// Only files compiled for sm_90a include this.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/flash_attention_sm90.h"
#include "backend/cuda/grouped_gemm_sm90_ptx.cuh"

namespace packmoe::cuda::flash {

using namespace packmoe::sm90;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The wgmma wrappers below take the accumulator fragment as operands: thread t of the warpgroup
// (warp w = t / 32, lane l) holds d[4j + 2i + c] = D[16 w + 8 i + l / 4][8 j + 2 (l % 4) + c]. The
// A fragment of a register wgmma holds the same positions of a 64 x 16 tile, packed in BF16 pairs:
// a[2 jj + i] = A[16 w + 8 i + l / 4][8 jj + 2 (l % 4) + {0, 1}] (i, jj in {0, 1}), so a 64 x 16
// block of an accumulator converts in place (to_a_fragment).
// D (64 x 64) (+)= A (64 x 16, shared) . B (16 x 64, shared); scale_d = 0 ignores D.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                             uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// D (64 x 64) (+)= A (64 x 16, registers: fragment a) . B (16 x 64, shared); scale_d = 0 ignores D.
template <int kTransB>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4],
                                             uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
}

// D (64 x 128) (+)= A (64 x 16, registers: fragment a) . B (16 x 128, shared); scale_d = 0
// ignores D.
template <int kTransB>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4],
                                              uint64_t desc_b, uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
}

// 2^x on the special-function unit (relative error ~2^-22; -inf gives 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// lo in the low half, hi in the high half, each rounded to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Columns [16 kk, 16 kk + 16) of a 64 x N accumulator fragment as the A fragment of a register
// wgmma (the positions coincide, see above).
template <int kN>
__device__ __forceinline__ void to_a_fragment(const float (&acc)[kN / 2], int kk,
                                              uint32_t (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = pack_bf16x2(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
}

// Box at element coordinates (c0 innermost .. c3) of the 4-D tensor `map` into shared `dst`; its
// bytes complete transactions on `bar`. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5, %6}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// completing transactions on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// The 4-D map {D, H, S, B} (innermost first) of a (B, S, H, D) BF16 tensor with boxes of
// 64 x 1 x `rows` x 1 (one 128-byte swizzled row per sequence position): a tile of one head's
// rows. Rows past S of a batch row arrive as zeros.
inline CUtensorMap make_head_map(const uint16_t* base, int64_t batch, int64_t seq, int64_t heads,
                                 int64_t dim, int rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    PACKMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                        cudaEnableDefault, &q));
    PACKMOE_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                  "the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  const int64_t el = 2;  // bytes per element
  CUtensorMap m;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(dim * el),
                                 static_cast<cuuint64_t>(heads * dim * el),
                                 static_cast<cuuint64_t>(seq * heads * dim * el)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r =
      encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<uint16_t*>(base), dims, strides,
             box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PACKMOE_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (" << static_cast<int>(r) << ")");
  return m;
}

// Raises `kernel`'s dynamic shared memory limit to `bytes` (a launcher calls it once per kernel
// instantiation, from a function-local static).
template <typename Kernel>
bool set_max_dynamic_smem(Kernel kernel, int bytes) {
  PACKMOE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return true;
}

// ---- what the two backward kernels share (dK / dV: flash_attention_bwd_sm90.cu, dQ:
// flash_attention_dq_sm90.cu); each kernel's tiles, loops and outputs differ by design ---------

// The parameters both backward kernels read: sizes, the softmax scale and the preprocessing's
// rows (flash_backward_preprocess).
struct FlashBwdRows {
  int S, S_pad, Hq, group, m_tiles, batch_heads;
  float scale, scale_log2;
  bool has_doc;
  const float* dl;     // (B, Hq, S_pad)
  const float* lse2;   // (B, Hq, S_pad)
  const int32_t* doc;  // (B, S_pad)
};

// Query tiles of bm rows (m_tiles); has_doc: doc_start was given (else doc holds zeros).
inline FlashBwdRows flash_bwd_rows(const FlashAttentionShape& sh, int bm, const float* dl,
                                   const float* lse2, const int32_t* doc, bool has_doc) {
  FlashBwdRows p;
  p.S = static_cast<int>(sh.seq);
  p.S_pad = static_cast<int>((sh.seq + 127) / 128 * 128);
  p.Hq = static_cast<int>(sh.q_heads);
  p.group = static_cast<int>(sh.q_heads / sh.kv_heads);
  p.m_tiles = static_cast<int>((sh.seq + bm - 1) / bm);
  p.batch_heads = static_cast<int>(sh.batch * sh.q_heads);
  p.scale = sh.scale;
  p.scale_log2 = sh.scale * kLog2e;
  p.has_doc = has_doc;
  p.dl = dl;
  p.lse2 = lse2;
  p.doc = doc;
  return p;
}

// The tensor maps both backward kernels load: Q and dO in tiles of bm query rows, K and V in
// tiles of bn keys (head dimension d).
struct FlashBwdMaps {
  CUtensorMap q, dout, k, v;
};
inline FlashBwdMaps flash_bwd_maps(const FlashAttentionShape& sh, int d, int bm, int bn,
                                   const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   const uint16_t* dout) {
  return {make_head_map(q, sh.batch, sh.seq, sh.q_heads, d, bm),
          make_head_map(dout, sh.batch, sh.seq, sh.q_heads, d, bm),
          make_head_map(k, sh.batch, sh.seq, sh.kv_heads, d, bn),
          make_head_map(v, sh.batch, sh.seq, sh.kv_heads, d, bn)};
}

}  // namespace packmoe::cuda::flash
