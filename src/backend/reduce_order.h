// The fixed summation orders every backend shares ("sequential" and "R32"), so a reduction gives
// the CPU reference's bits on any backend and thread count. The CPU computes R32 with sum_r32
// below; a CUDA warp computes the same tree with a strided loop and r32_butterfly
// (backend/cuda/reduce_order.cuh). Host and device (core/hd.h).
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace packmoe {

// Sequential sum over j = 0..n-1: acc = +0, then acc = acc + term_j. Used for the k terms of a
// token.
// R32 sum over i = 0..n-1 (long reductions, shaped like one CUDA warp): lane[l] = +0, then
// lane[l] = lane[l] + term_i for i = l, l + 32, l + 64, ... (l < 32); then for off = 16, 8, 4,
// 2, 1: lane[l] = lane[l] + lane[l + off] for l < off; the sum is lane[0]. (A warp computes it
// with a strided loop and __shfl_xor_sync butterflies: lane 0 gets exactly this tree.)
// Every product and quotient is one rounded FP32 operation (no FMA: -ffp-contract=off on the
// host, --fmad=false for nvcc). BF16 inputs are widened exactly; BF16 outputs round the final
// FP32 value once (RNE, f32_to_bf16).
inline constexpr int kMoeReduceLanes = 32;

// The R32 sum of term(0), ..., term(n - 1) in the accumulator type Acc (FP32; FP64 for the sums of
// squares of backend/ops/elementwise.h).
template <typename Acc = float, typename Term>
PACKMOE_HD Acc sum_r32(int64_t n, Term term) {
  Acc lane[kMoeReduceLanes] = {};
  for (int64_t i = 0; i < n; ++i) lane[i % kMoeReduceLanes] = lane[i % kMoeReduceLanes] + term(i);
  for (int off = kMoeReduceLanes / 2; off >= 1; off /= 2)
    for (int l = 0; l < off; ++l) lane[l] = lane[l] + lane[l + off];
  return lane[0];
}

// Blocked R32 over rows r = 0..n-1 (reductions across many rows, e.g. a norm weight's gradient):
// rows are cut into blocks of kReduceRowBlock; block b's partial is the R32 sum of its rows'
// terms; the result is the sequential sum of the partials in block order (acc = +0, then
// acc = acc + partial_b). A GPU reduces the blocks in parallel; the bits depend on n alone.
inline constexpr int64_t kReduceRowBlock = 1024;

template <typename Acc = float, typename Term>
PACKMOE_HD Acc sum_blocked_r32(int64_t n, Term term) {
  Acc acc = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kReduceRowBlock) {
    const int64_t len = n - b0 < kReduceRowBlock ? n - b0 : kReduceRowBlock;
    acc = acc + sum_r32<Acc>(len, [&](int64_t i) { return term(b0 + i); });
  }
  return acc;
}

}  // namespace packmoe
