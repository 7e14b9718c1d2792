// Global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_: norm = sqrt(sum over every
// param of sum(main_grad^2)), coefficient = min(1, max_norm / (norm + 1e-6)). Invariant: the norm
// is a fixed-order FP64 sum (the backend's sum_squares per param, then a sequential host sum in
// param order), so it is the same bits for any thread count and either layout.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "nn/grouped_param.h"

namespace packmoe {

// sqrt(sum_i sum_squares(grads[i])). One sum_squares call per storage into consecutive doubles of
// one buffer in `backend`'s memory, ONE download, the host sum from +0 in the order given. Every
// storage holds F32 and lives in `backend`'s memory. Empty: 0.
double global_grad_norm(Backend& backend, const std::vector<const GroupedStorage*>& grads);

// The factor AdamW multiplies the gradients by: min(1, max_norm / (norm + 1e-6)) computed in FP64
// and rounded once to FP32; exactly 1 when max_norm <= 0 (clipping disabled). A NaN norm gives NaN
// (the caller refuses to step on a non-finite norm).
float clip_coefficient(double norm, double max_norm);

}  // namespace packmoe
