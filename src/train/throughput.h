// Model FLOPs and MFU accounting for the training log: a formula over ModelConfig only (no model
// is built), so the numbers printed on every backend mean the same thing.
#pragma once

#include <cstdint>

#include "nn/model_config.h"

namespace packmoe::train {

// Model FLOPs per trained token (forward + backward), PaLM's convention (Chowdhery et al. 2022,
// appendix B) applied to MoE with the active parameters:
//   6 x N + 12 x L x S x Hq x D,
//   N = sum over layers of [ H x Hq x D (q) + 2 x H x Hkv x D (k, v) + Hq x D x H (o)
//                            + MoE: E x H (router) + k x 3 x F x H (experts) | dense: 3 x I x H ]
//       + V x H (lm_head, also when tied);
// the embedding lookup, norms and elementwise work are not counted, the attention term counts the
// full S x S scores (not halved for the causal mask) like PaLM and nanoGPT, and the per-expert
// padding to the format's block alignment is not counted (model FLOPs, not hardware FLOPs).
double model_flops_per_token(const ModelConfig& model, int64_t seq_len);
// H200 dense BF16 tensor-core peak (MXFP8 and NVFP4 compute in BF16 on Hopper), for MFU.
inline constexpr double kH200PeakFlops = 989.4e12;

}  // namespace packmoe::train
