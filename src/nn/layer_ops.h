// Small helpers the dense layers share: whole-tensor casts and sums as backend ops, and the
// settings of the BF16 linears (attention projections, dense MLP, LM head). Invariant: every
// arithmetic step is a Backend op (no host math on activations), so CPU and CUDA give equal bits.
#pragma once

#include "backend/backend.h"
#include "core/tensor.h"
#include "nn/grouped_linear.h"
#include "nn/grouped_param.h"

namespace packmoe {

// y = bf16(x) (RNE), same shape; x F32 in the backend's memory.
Tensor to_bf16(Backend& b, const Tensor& x);
// dst += src, both F32 of equal numel.
void add_into(Backend& b, const Tensor& dst, const Tensor& src);
// x + y as a new tensor shaped like x (one pass, neither input written), both F32 of equal numel.
Tensor add(Backend& b, const Tensor& x, const Tensor& y);
// (1, n, k) F32 host tensor from a 2-D or 1-D weight (a view of the same bytes).
Tensor as_single_group(const Tensor& w);

// A BF16 linear with FP32 outputs and dgrads (the dense weights of the model).
GroupedLinearConfig dense_linear_config(Layout layout, bool grad_accum_fusion);
// A weight that ops read in FP32 (norms, the embedding table): the param's FP32 weight (its init,
// or the replica of the optimizer's master: GroupedParam::fp32_weight), (N, K).
const float* f32_weight(const GroupedParam& p);
// main_grad of a single-group param as an F32 pointer, (N, K).
float* f32_grad(const GroupedParam& p);

}  // namespace packmoe
