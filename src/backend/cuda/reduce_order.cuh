// The R32 order of backend/reduce_order.h on one CUDA warp: lane l adds terms l, l + 32, ... in a
// strided loop, then r32_butterfly forms the tree. Invariant: every lane ends with exactly the
// value of the CPU's sum_r32 (IEEE addition is commutative, so the upper lanes' swapped operands
// give the same bits).
#pragma once

#include "backend/reduce_order.h"

namespace packmoe {

static_assert(kMoeReduceLanes == 32, "R32 is one warp");

constexpr unsigned kFullMask = 0xFFFFFFFFu;  // every lane of the warp takes part

// R32 second stage on one warp: lane l adds lane l ^ off for off = 16 .. 1. For l < off that is
// lane[l] + lane[l + off], reduce_order.h's tree; the upper lanes form the same sums with the
// operands swapped, so every lane ends with lane 0's value. T: float, or double (sums of squares).
template <typename T>
__device__ __forceinline__ T r32_butterfly(T acc) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) acc = acc + __shfl_xor_sync(kFullMask, acc, off);
  return acc;
}

// Two independent butterflies interleaved (their shuffles overlap).
__device__ __forceinline__ void r32_butterfly2(float& a, float& b) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    const float oa = __shfl_xor_sync(kFullMask, a, off);
    const float ob = __shfl_xor_sync(kFullMask, b, off);
    a = a + oa;
    b = b + ob;
  }
}

}  // namespace packmoe
