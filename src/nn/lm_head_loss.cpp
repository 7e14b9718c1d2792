// The chunked LM head + cross-entropy of nn/lm_head_loss.h: the loop over chunks, each chunk's
// GEMM groups of one token block, and the block-ordered weight gradient.
#include "nn/lm_head_loss.h"

#include <algorithm>
#include <string>

#include "backend/ops/elementwise.h"
#include "backend/ops/gemm.h"
#include "backend/ops/model.h"
#include "formats/grouped.h"
#include "nn/layer_ops.h"

namespace packmoe {
namespace {

constexpr int32_t kIgnoreIndex = -100;

// Token counts of the blocks of `rows` tokens: block, block, ..., the rest.
std::vector<int64_t> block_counts(int64_t rows, int64_t block) {
  std::vector<int64_t> m;
  for (int64_t r = 0; r < rows; r += block) m.push_back(std::min(block, rows - r));
  return m;
}

// A BF16 operand of G groups of rows: group g at row offset sum_{h<g} m_h of `base`.
GemmOperand bf16_rows(const void* base, const std::vector<int64_t>& m, int64_t cols) {
  GemmOperand o;
  o.format = OperandFormat::kBF16;
  for (void* p : carve_rows(const_cast<void*>(base), m, dtype_bytes_for(DType::kBF16, cols)))
    o.data.push_back(p);
  return o;
}

// The one-group weight operand w repeated for G groups (every block multiplies the same W).
GemmOperand repeat(const GemmOperand& w, size_t groups) {
  GemmOperand o = w;
  o.data.assign(groups, w.data.at(0));
  if (!w.scale.empty()) o.scale.assign(groups, w.scale.at(0));
  return o;
}

uint8_t* row(const Tensor& t, int64_t r) {
  return static_cast<uint8_t*>(t.data()) + dtype_bytes_for(t.dtype(), r * t.dim(1));
}

}  // namespace

Result<LmHeadLoss> lm_head_loss(GroupedParam& head, const Tensor& h,
                                const std::vector<int32_t>& targets,
                                std::optional<float> loss_scale, const LmHeadChunking& chunking,
                                float* device_loss) {
  Backend& b = head.backend();
  const int64_t V = head.n(), H = head.k(), Q = chunking.block_tokens;
  PACKMOE_CHECK(head.experts() == 1,
                "lm_head_loss: the head has one group, got " << head.experts());
  PACKMOE_CHECK(h.dtype() == DType::kBF16 && h.rank() == 2 && h.dim(1) == H && h.dim(0) > 0,
                "lm_head_loss: h must be (T, " << H << ") bf16, got " << shape_string(h.shape()));
  PACKMOE_CHECK(h.device() == b.device(), "lm_head_loss: h is not in the head's backend memory");
  PACKMOE_CHECK(Q > 0 && chunking.chunk_tokens > 0 && chunking.chunk_tokens % Q == 0,
                "lm_head_loss: chunk of " << chunking.chunk_tokens
                                          << " tokens is not a positive multiple of the block "
                                          << Q);
  const int64_t T = h.dim(0);
  PACKMOE_CHECK(static_cast<int64_t>(targets.size()) == T,
                "lm_head_loss: " << targets.size() << " targets for " << T << " tokens");
  LmHeadLoss out;
  for (int64_t t = 0; t < T; ++t) {
    if (targets[t] == kIgnoreIndex) continue;
    if (targets[t] < 0 || targets[t] >= V)
      return Status::error("lm_head_loss: target " + std::to_string(targets[t]) + " at position " +
                           std::to_string(t) + " outside [0, " + std::to_string(V) +
                           ") and not the ignore index -100");
    ++out.valid;
  }
  const bool train = loss_scale.has_value();
  // dloss / n, the same FP32 division for every chunk.
  const float g = train && out.valid > 0 ? *loss_scale / static_cast<float>(out.valid) : 0.0f;

  const Tensor tgt = b.to_device(
      Tensor::view(const_cast<int32_t*>(targets.data()), DType::kI32, {T}, Device::kCPU));  // (T)
  const Tensor token_loss = Tensor::empty(b, DType::kF32, {T});                             // (T)
  const int64_t C = std::min(chunking.chunk_tokens, T);
  const Tensor logits = Tensor::empty(b, DType::kF32, {C, V});  // (C, V)
  Tensor dlogits;                                               // (C, V) BF16
  head.prepare_compute();
  const GemmOperand w_fprop = head.fprop_weight();
  GemmOperand w_dgrad;
  // The batch's weight gradient: its blocks summed in order from zero (the first block
  // overwrites), then one add into main_grad, as a single wgrad's epilogue adds its sum (so data
  // parallelism stays bitwise, docs/dist.md). One block: straight into main_grad, the same bytes.
  // A main_grad of stale values (GradWrite::kOverwrite) is itself the sum: the first block
  // overwrites it, and the values are those of 0 + sum (a -0 stays -0), with no (V, H) buffer.
  float* main_grad = nullptr;  // (V, H)
  Tensor dw_sum;               // (V, H) F32, more than one block added onto a gradient only
  const int64_t blocks = (T + Q - 1) / Q;
  bool overwrite = false;
  if (train) {
    dlogits = Tensor::empty(b, DType::kBF16, {C, V});
    out.dh = Tensor::empty(b, DType::kF32, {T, H});
    w_dgrad = head.dgrad_weight();
    main_grad = f32_grad(head);
    overwrite = head.take_grad_write() == GradWrite::kOverwrite;
    if (blocks > 1 && !overwrite) dw_sum = Tensor::empty(b, DType::kF32, {V, H});
  }
  const bool into_sum = dw_sum.data() != nullptr;

  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t rows = std::min(C, T - t0);
    const std::vector<int64_t> m = block_counts(rows, Q);  // this chunk's blocks
    GroupedGemmArgs f;                                     // logits (rows, V) = h (rows, H) . W^T
    f.op = GemmOp::kFprop;
    f.n = V;
    f.k = H;
    f.m = m;
    f.lhs = bf16_rows(row(h, t0), m, H);
    f.rhs = repeat(w_fprop, m.size());
    f.out_dtype = DType::kF32;
    f.out = carve_rows(logits.data(), m, dtype_bytes_for(DType::kF32, V));
    check_op(ops::grouped_gemm(b, f), "lm head fprop");

    CrossEntropyArgs ce;
    ce.tokens = rows;
    ce.vocab = V;
    ce.ignore_index = kIgnoreIndex;
    ce.grad_scale = g;
    ce.logits = logits.data_as<const float>();
    ce.targets = tgt.data_as<const int32_t>() + t0;
    ce.loss = token_loss.data_as<float>() + t0;
    ce.dlogits = train ? dlogits.data_as<uint16_t>() : nullptr;
    check_op(ops::cross_entropy(b, ce), "cross_entropy");
    if (!train) continue;

    GroupedGemmArgs d;  // dh (rows, H) = dlogits (rows, V) . W
    d.op = GemmOp::kDgrad;
    d.n = V;
    d.k = H;
    d.m = m;
    d.lhs = bf16_rows(dlogits.data(), m, V);
    d.rhs = repeat(w_dgrad, m.size());
    d.out_dtype = DType::kF32;
    d.out = carve_rows(row(out.dh, t0), m, dtype_bytes_for(DType::kF32, H));
    check_op(ops::grouped_gemm(b, d), "lm head dgrad");

    int64_t r = 0;  // row of the block in the chunk
    for (const int64_t mb : m) {
      GroupedGemmArgs w;  // dW (V, H) (+)= dlogits_b^T (V, mb) . h_b (mb, H), one call per block
      w.op = GemmOp::kWgrad;
      w.n = V;
      w.k = H;
      w.m = {mb};
      w.lhs = bf16_rows(row(dlogits, r), {mb}, V);
      w.rhs = bf16_rows(row(h, t0 + r), {mb}, H);
      w.out_dtype = DType::kF32;
      w.out = {into_sum ? dw_sum.data() : static_cast<void*>(main_grad)};
      w.accumulate = t0 + r > 0 || (blocks == 1 && !overwrite);
      check_op(ops::grouped_gemm(b, w), "lm head wgrad");
      r += mb;
    }
  }
  if (into_sum) {
    Segments<float> dst;
    dst.ptr.push_back(main_grad);
    dst.n = V * H;
    Segments<const float> src;
    src.ptr.push_back(dw_sum.data_as<const float>());
    src.n = V * H;
    check_op(ops::add_f32(b, dst, src), "lm head gradient accumulation");
  }

  const Tensor loss = device_loss ? Tensor{} : Tensor::empty(b, DType::kF32, {1});
  CrossEntropyMeanArgs mean;
  mean.tokens = T;
  mean.valid = out.valid;
  mean.token_loss = token_loss.data_as<const float>();
  mean.loss = device_loss ? device_loss : loss.data_as<float>();
  check_op(ops::cross_entropy_mean(b, mean), "cross_entropy_mean");
  if (!device_loss)
    b.copy(&out.loss, loss.data(), sizeof(float), Backend::CopyKind::kDeviceToHost);
  return out;
}

}  // namespace packmoe
