// Causal GQA attention on BF16 inputs for sm_90a (FlashAttention-3 design: TMA, wgmma, warp
// specialisation; docs/attention-sm90.md), forward and backward, with optional document masking.
// Invariant: every output is a fixed function of its own batch row's inputs (deterministic and
// batch invariant: no floating-point reduction whose order depends on timing or on B).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/status.h"

namespace packmoe::cuda {

// B, S, Hq, Hkv (divides Hq), D; scale multiplies the scores q . k before the softmax.
struct FlashAttentionShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  float scale;
};

// q (B, S, Hq, D) and k, v (B, S, Hkv, D): BF16 bits. doc_start (B * S) int32 or nullptr (plain
// causal): key j is visible to query i of the same row iff doc_start[b * S + i] <= j <= i
// (doc_start nondecreasing in i within a row, doc_start[i] <= i). Query head h reads KV head
// h / (Hq / Hkv). o (B, S, Hq, D) BF16; lse (B, Hq, S) FP32, the natural-log log-sum-exp of the
// scaled scores of each query row. D 64 and 128 run on the tensor cores; any other D up to 256
// runs a simple exact FP32 kernel (the tiny preset's D = 16).
Status flash_attention_forward_sm90(const FlashAttentionShape& shape, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, const int32_t* doc_start,
                                    uint16_t* o, float* lse, cudaStream_t stream);

// Bytes of device workspace flash_attention_backward_sm90 needs for `shape` (16-byte aligned).
size_t flash_attention_backward_workspace_bytes(const FlashAttentionShape& shape);

// dq (B, S, Hq, D), dk and dv (B, S, Hkv, D): FP32, overwritten. o and dout (B, S, Hq, D) BF16;
// lse as written by the forward. Same masks and D support as the forward.
Status flash_attention_backward_sm90(const FlashAttentionShape& shape, const uint16_t* q,
                                     const uint16_t* k, const uint16_t* v, const uint16_t* o,
                                     const uint16_t* dout, const float* lse,
                                     const int32_t* doc_start, float* dq, float* dk, float* dv,
                                     void* workspace, cudaStream_t stream);

}  // namespace packmoe::cuda
