// Shape checks shared by the flash attention entry points, and the simple exact FP32 path for head
// dimensions other than 64 and 128 (the tiny preset's D = 16): one thread per query row (forward,
// dQ) or per key row (dK, dV), keys and queries in a fixed order, so it is deterministic and batch
// invariant like the tensor-core path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/flash_attention_sm90.h"

namespace packmoe::cuda {

// An error Status for shapes neither path supports (kv_heads not dividing q_heads, D > 256 or
// odd, scale <= 0, sizes past 32-bit indexing).
Status flash_check_shape(const FlashAttentionShape& shape);

// Per (b, h, i) row: Dl = sum_d dO * O, lse2 = lse log2(e) (+inf past S), written over
// S_pad = round_up(S, 128) rows per (b, h); doc_pad (B, S_pad): doc_start, padded with its last
// value (or zeros without doc_start). Shared by both backward paths.
void flash_backward_preprocess(const FlashAttentionShape& shape, const uint16_t* o,
                               const uint16_t* dout, const float* lse, const int32_t* doc_start,
                               float* dl, float* lse2, int32_t* doc_pad, cudaStream_t stream);

void flash_simple_forward(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                          const uint16_t* v, const int32_t* doc_start, uint16_t* o, float* lse,
                          cudaStream_t stream);

// dl, lse2, doc_pad as written by flash_backward_preprocess.
void flash_simple_backward(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                           const uint16_t* v, const uint16_t* dout, const float* dl,
                           const float* lse2, const int32_t* doc_pad, float* dq, float* dk,
                           float* dv, cudaStream_t stream);

}  // namespace packmoe::cuda
