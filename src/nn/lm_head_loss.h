// The LM head and the cross-entropy fused over chunks of tokens: per chunk, logits = h W^T (FP32),
// one cross-entropy op (per-token loss and BF16 dlogits in one pass), dh = dlogits W and the wgrad,
// so only a (chunk, V) logits buffer ever exists, never (T, V). Invariant (docs/lm-head-loss.md):
// the chunk size does not change a byte of the loss, dh or the weight gradient: every GEMM group
// is one block of block_tokens tokens, and the blocks' wgrads are summed in token order from zero,
// then added into main_grad as ONE sum per call.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "nn/grouped_param.h"

namespace packmoe {

// The token quantum of every head GEMM. 2048: a block's wgrad (V x H outputs added into FP32 once
// per block) stays compute-bound, and the dgrad of one block (2048 x H outputs) fills an H200.
inline constexpr int64_t kLmHeadBlockTokens = 2048;
// Rows of logits alive at once: one block, 2048 x V x 6 bytes (FP32 logits + BF16 dlogits).
inline constexpr int64_t kLmHeadChunkTokens = 2048;

struct LmHeadChunking {
  int64_t block_tokens = kLmHeadBlockTokens;  // fixes the bytes
  int64_t chunk_tokens = kLmHeadChunkTokens;  // a positive multiple of block_tokens; memory only
};

struct LmHeadLoss {
  float loss = 0.0f;  // mean cross-entropy over the non-ignored targets (+0 when there are none)
  int64_t valid = 0;  // non-ignored targets
  Tensor dh;          // (T, H) F32: d(loss_scale * loss) / dh; training only
};

// head: the (1, V, H) BF16 LM head (the tied embedding too). h: (T, H) BF16 in its backend's
// memory. targets: (T) host labels, -100 ignored; any other outside [0, V) is a Status error before
// anything is computed. loss_scale given (training): the gradient of loss_scale * loss, dh
// returned and the weight gradient ADDED into head's main_grad (written over it when the param says
// GradWrite::kOverwrite); absent (evaluation): the loss only.
// One host read (the loss), or none when device_loss is given: then the mean goes to that one
// F32 in the backend's memory and LmHeadLoss::loss stays 0.
Result<LmHeadLoss> lm_head_loss(GroupedParam& head, const Tensor& h,
                                const std::vector<int32_t>& targets,
                                std::optional<float> loss_scale,
                                const LmHeadChunking& chunking = {}, float* device_loss = nullptr);

}  // namespace packmoe
