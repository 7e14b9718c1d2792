// The dQ kernel of the sm_90a flash attention backward (flash_attention_dq_sm90.cu), launched by
// flash_attention_bwd_sm90.cu after the preprocessing kernel: dq (B, S, Hq, D) FP32, overwritten.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/flash_attention_sm90.h"

namespace packmoe::cuda {

// dl, lse2 (B, Hq, S_pad) and doc (B, S_pad) as written by flash_backward_preprocess; has_doc:
// doc_start was given (else doc holds zeros). D = 128 and D = 64.
void launch_flash_dq_128(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                         const uint16_t* v, const uint16_t* dout, const float* dl,
                         const float* lse2, const int32_t* doc, bool has_doc, float* dq,
                         cudaStream_t stream);
void launch_flash_dq_64(const FlashAttentionShape& shape, const uint16_t* q, const uint16_t* k,
                        const uint16_t* v, const uint16_t* dout, const float* dl, const float* lse2,
                        const int32_t* doc, bool has_doc, float* dq, cudaStream_t stream);

}  // namespace packmoe::cuda
