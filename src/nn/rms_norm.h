// RmsNorm layer: y = x / rms(x) * weight over the last dim D, with its weight (1, 1, D) as a
// GroupedParam whose FP32 weight is what the op reads. Invariant: backward ADDS dweight into
// main_grad; the forward's input and rstd are kept until its backward (or release).
#pragma once

#include "backend/backend.h"
#include "core/tensor.h"
#include "nn/grouped_param.h"

namespace packmoe {

class RmsNorm {
 public:
  // init: (D) F32 host.
  RmsNorm(Backend& backend, Layout layout, float eps, const Tensor& init);

  GroupedParam& param() { return param_; }
  int64_t dim() const { return param_.k(); }

  // x: (N, D) F32 (any rank whose last dim is D). Returns y with x's shape, F32.
  Tensor forward(const Tensor& x);
  // forward's y as BF16 (RNE of the same FP32 values, the bits to_bf16(forward(x)) gives) in one
  // pass, for a norm whose output feeds a BF16 GEMM; keeps the same state for backward.
  Tensor forward_bf16(const Tensor& x);
  // dy: like y. Returns dx F32; adds dweight into main_grad.
  Tensor backward(const Tensor& dy);
  // residual_grad + backward(dy) (F32, like x) in one pass: a pre-norm residual block's dx, with
  // the bits add_into of the two would give.
  Tensor backward(const Tensor& dy, const Tensor& residual_grad);
  // Frees what forward kept (activation recomputation, nn/recompute.h: a forward runs again
  // before backward).
  void release();

 private:
  Backend* backend_;
  float eps_;
  GroupedParam param_;  // (1, 1, D)
  Tensor x_;            // (N, D) the forward's input
  Tensor rstd_;         // (N)

  // forward with the output in `dtype` (F32 or BF16); backward with an optional residual_grad.
  Tensor run_forward(const Tensor& x, DType dtype);
  Tensor run_backward(const Tensor& dy, const Tensor* residual_grad);
};

}  // namespace packmoe
