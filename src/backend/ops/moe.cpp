// The MoE op family (backend/ops/moe.h): argument checks shared by every backend, the host routing
// plan and the ops:: entries. Checks read only the structs, never the memory they point to.
#include "backend/ops/moe.h"

#include <climits>
#include <string>

#include "backend/arg_checks.h"
#include "backend/backend.h"

namespace packmoe {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool is_f32_or_bf16(DType t) { return t == DType::kF32 || t == DType::kBF16; }

// T, E, k of the router-side ops. The 2^24 bound keeps token counts exact in FP32 (aux loss).
Status check_router_dims(const char* op, int64_t tokens, int64_t experts, int64_t top_k) {
  const std::string ctx = std::string(op) + ": ";
  if (tokens <= 0) return Status::error(ctx + "T (tokens) must be positive, got " + num(tokens));
  if (tokens >= (int64_t{1} << 24))
    return Status::error(ctx + "T = " + num(tokens) + " tokens, at most 2^24 - 1 per call");
  if (experts <= 0) return Status::error(ctx + "E (experts) must be positive, got " + num(experts));
  if (experts > INT32_MAX) return Status::error(ctx + "E = " + num(experts) + " exceeds int32");
  if (top_k <= 0) return Status::error(ctx + "k (top-k) must be positive, got " + num(top_k));
  if (top_k > experts)
    return Status::error(ctx + "k = " + num(top_k) + " exceeds E = " + num(experts) + " experts");
  return Status::ok();
}

// T, H, k, M of the row-side ops: every (t, j) pair owns one row, so M >= T * k.
Status check_row_dims(const char* op, int64_t tokens, int64_t hidden, int64_t top_k, int64_t rows) {
  const std::string ctx = std::string(op) + ": ";
  if (tokens <= 0) return Status::error(ctx + "T (tokens) must be positive, got " + num(tokens));
  if (hidden <= 0) return Status::error(ctx + "H (hidden) must be positive, got " + num(hidden));
  if (top_k <= 0) return Status::error(ctx + "k (top-k) must be positive, got " + num(top_k));
  if (tokens > INT32_MAX / top_k)
    return Status::error(ctx + "T * k = " + num(tokens) + " * " + num(top_k) + " exceeds int32");
  if (rows < tokens * top_k)
    return Status::error(ctx + "M = " + num(rows) +
                         " rows cannot hold T * k = " + num(tokens * top_k) + " routed pairs");
  if (rows > INT32_MAX) return Status::error(ctx + "M = " + num(rows) + " rows exceeds int32");
  return Status::ok();
}

Status check_dtype(const char* op, DType t, const char* name) {
  if (!is_f32_or_bf16(t))
    return Status::error(std::string(op) + ": " + name + " must be f32 or bf16, got " +
                         std::string(dtype_name(t)));
  return Status::ok();
}

}  // namespace

Status validate_router_topk(const RouterTopkArgs& a) {
  constexpr const char* op = "router_topk";
  PACKMOE_RETURN_IF_ERROR(check_router_dims(op, a.tokens, a.experts, a.top_k));
  return require_non_null(op,
                          {{a.logits, "logits"}, {a.probs, "probs"}, {a.idx, "idx"}, {a.w, "w"}});
}

Status validate_router_topk_backward(const RouterTopkBackwardArgs& a) {
  constexpr const char* op = "router_topk_backward";
  PACKMOE_RETURN_IF_ERROR(check_router_dims(op, a.tokens, a.experts, a.top_k));
  return require_non_null(
      op, {{a.probs, "probs"}, {a.idx, "idx"}, {a.dw, "dw"}, {a.dlogits, "dlogits"}});
}

Status validate_aux_loss(const AuxLossArgs& a) {
  constexpr const char* op = "aux_loss";
  PACKMOE_RETURN_IF_ERROR(check_router_dims(op, a.tokens, a.experts, a.top_k));
  return require_non_null(op, {{a.probs, "probs"}, {a.idx, "idx"}, {a.aux, "aux"}});
}

Status validate_aux_loss_backward(const AuxLossBackwardArgs& a) {
  constexpr const char* op = "aux_loss_backward";
  PACKMOE_RETURN_IF_ERROR(check_router_dims(op, a.tokens, a.experts, a.top_k));
  return require_non_null(op, {{a.probs, "probs"}, {a.idx, "idx"}, {a.dlogits, "dlogits"}});
}

Status validate_permute(const PermuteArgs& a) {
  constexpr const char* op = "permute";
  PACKMOE_RETURN_IF_ERROR(check_row_dims(op, a.tokens, a.hidden, a.top_k, a.rows));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.dtype, "x / xp"));
  return require_non_null(op,
                          {{a.row_slot, "row_slot"}, {a.dest, "dest"}, {a.x, "x"}, {a.xp, "xp"}});
}

Status validate_permute_backward(const PermuteBackwardArgs& a) {
  constexpr const char* op = "permute_backward";
  PACKMOE_RETURN_IF_ERROR(check_row_dims(op, a.tokens, a.hidden, a.top_k, a.rows));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.dxp_dtype, "dxp"));
  return require_non_null(op, {{a.dest, "dest"}, {a.dxp, "dxp"}, {a.dx, "dx"}});
}

Status validate_swiglu(const SwigluArgs& a) {
  constexpr const char* op = "swiglu";
  if (a.rows <= 0 || a.ffn <= 0)
    return Status::error(std::string(op) + ": M and F must be positive, got M = " + num(a.rows) +
                         ", F = " + num(a.ffn));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.in_dtype, "in"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.out_dtype, "out"));
  return require_non_null(op, {{a.in, "in"}, {a.out, "out"}});
}

Status validate_swiglu_backward(const SwigluBackwardArgs& a) {
  constexpr const char* op = "swiglu_backward";
  if (a.rows <= 0 || a.ffn <= 0)
    return Status::error(std::string(op) + ": M and F must be positive, got M = " + num(a.rows) +
                         ", F = " + num(a.ffn));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.in_dtype, "in"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.dout_dtype, "dout"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.din_dtype, "din"));
  return require_non_null(op, {{a.in, "in"}, {a.dout, "dout"}, {a.din, "din"}});
}

Status validate_unpermute(const UnpermuteArgs& a) {
  constexpr const char* op = "unpermute";
  PACKMOE_RETURN_IF_ERROR(check_row_dims(op, a.tokens, a.hidden, a.top_k, a.rows));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.yp_dtype, "yp"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.y_dtype, "y"));
  return require_non_null(op, {{a.dest, "dest"}, {a.w, "w"}, {a.yp, "yp"}, {a.y, "y"}});
}

Status validate_unpermute_backward(const UnpermuteBackwardArgs& a) {
  constexpr const char* op = "unpermute_backward";
  PACKMOE_RETURN_IF_ERROR(check_row_dims(op, a.tokens, a.hidden, a.top_k, a.rows));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.yp_dtype, "yp"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.dy_dtype, "dy"));
  PACKMOE_RETURN_IF_ERROR(check_dtype(op, a.dyp_dtype, "dyp"));
  return require_non_null(op, {{a.dest, "dest"},
                               {a.row_slot, "row_slot"},
                               {a.w, "w"},
                               {a.yp, "yp"},
                               {a.dy, "dy"},
                               {a.dyp, "dyp"},
                               {a.dw, "dw"}});
}

namespace {

Status check_plan_args(const char* op, int64_t tokens, int64_t experts, int64_t top_k,
                       int64_t align) {
  PACKMOE_RETURN_IF_ERROR(check_router_dims(op, tokens, experts, top_k));
  if (align <= 0 || align > INT32_MAX)
    return Status::error(std::string(op) + ": align must be in [1, 2^31) (1 for bf16, 32 for " +
                         "mxfp8, 16 for nvfp4), got " + num(align));
  return Status::ok();
}

// From p.counts: padded_counts, offsets and rows.
Status finish_plan(const char* op, RoutingPlan& p) {
  p.padded_counts.resize(p.experts);
  p.offsets.assign(p.experts + 1, 0);
  for (int64_t e = 0; e < p.experts; ++e) {
    p.padded_counts[e] = (p.counts[e] + p.align - 1) / p.align * p.align;
    p.offsets[e + 1] = p.offsets[e] + p.padded_counts[e];
    // Checked per expert so the running sum itself cannot overflow.
    if (p.offsets[e + 1] > INT32_MAX)
      return Status::error(std::string(op) + ": more than 2^31 - 1 permuted rows (T * k = " +
                           num(p.tokens * p.top_k) + ", align " + num(p.align) +
                           "): rows are int32 indices");
  }
  p.rows = p.offsets[p.experts];
  return Status::ok();
}

RoutingPlan empty_plan(int64_t tokens, int64_t experts, int64_t top_k, int64_t align) {
  RoutingPlan p;
  p.tokens = tokens;
  p.experts = experts;
  p.top_k = top_k;
  p.align = align;
  p.counts.assign(experts, 0);
  return p;
}

}  // namespace

Result<RoutingPlan> build_routing_plan(const int32_t* idx, int64_t tokens, int64_t experts,
                                       int64_t top_k, int64_t align) {
  constexpr const char* op = "routing_plan";
  PACKMOE_RETURN_IF_ERROR(check_plan_args(op, tokens, experts, top_k, align));
  PACKMOE_RETURN_IF_ERROR(require_non_null(op, {{idx, "idx"}}));

  RoutingPlan p = empty_plan(tokens, experts, top_k, align);
  const int64_t slots = tokens * top_k;  // < 2^24 * 2^31: no int64 overflow
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = idx[i];
    if (e < 0 || e >= experts)
      return Status::error(std::string(op) + ": idx[" + num(i / top_k) + ", " + num(i % top_k) +
                           "] = " + num(e) + " is not an expert in [0, " + num(experts) + ")");
    ++p.counts[e];
  }
  PACKMOE_RETURN_IF_ERROR(finish_plan(op, p));

  // Walking the pairs in (t, j) order fills each expert's rows in that order: deterministic.
  std::vector<int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  p.dest.resize(slots);
  p.row_slot.assign(p.rows, -1);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t r = next[idx[i]]++;
    p.dest[i] = static_cast<int32_t>(r);
    p.row_slot[r] = static_cast<int32_t>(i);
  }
  return p;
}

int64_t routing_plan_max_rows(int64_t tokens, int64_t experts, int64_t top_k, int64_t align) {
  return tokens * top_k + experts * (align - 1);
}

Status validate_routing_plan(const RoutingPlanArgs& a) {
  constexpr const char* op = "routing_plan";
  PACKMOE_RETURN_IF_ERROR(check_plan_args(op, a.tokens, a.experts, a.top_k, a.align));
  const int64_t need = routing_plan_max_rows(a.tokens, a.experts, a.top_k, a.align);
  if (need > INT32_MAX)
    return Status::error(std::string(op) + ": up to " + num(need) +
                         " permuted rows: rows are int32 indices");
  if (a.max_rows < need)
    return Status::error(std::string(op) + ": row_slot holds " + num(a.max_rows) +
                         " rows, the plan may need " + num(need) +
                         " (routing_plan_max_rows)");
  return require_non_null(
      op, {{a.idx, "idx"},
           {a.dest, "dest"},
           {a.row_slot, "row_slot"},
           {a.counts, "counts"},
           {a.padded_counts, "padded_counts"},
           {a.rows, "rows"}});
}

Result<RoutingPlan> routing_plan_from_counts(const int64_t* counts, int64_t tokens,
                                             int64_t experts, int64_t top_k, int64_t align) {
  constexpr const char* op = "routing_plan";
  PACKMOE_RETURN_IF_ERROR(check_plan_args(op, tokens, experts, top_k, align));
  PACKMOE_RETURN_IF_ERROR(require_non_null(op, {{counts, "counts"}}));
  if (counts[experts] != 0)
    return Status::error(std::string(op) + ": " + num(counts[experts]) +
                         " router indices are not experts in [0, " + num(experts) + ")");
  RoutingPlan p = empty_plan(tokens, experts, top_k, align);
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] < 0)
      return Status::error(std::string(op) + ": negative count " + num(counts[e]) +
                           " for expert " + num(e));
    p.counts[e] = counts[e];
    total += counts[e];
  }
  if (total != tokens * top_k)
    return Status::error(std::string(op) + ": the counts sum to " + num(total) + ", not T * k = " +
                         num(tokens * top_k));
  PACKMOE_RETURN_IF_ERROR(finish_plan(op, p));
  return p;
}

// ---- entries -------------------------------------------------------------------------------
namespace ops {

Status router_topk(Backend& b, const RouterTopkArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_router_topk(a));
  return b.kernels().moe->router_topk(b, a);
}

Status router_topk_backward(Backend& b, const RouterTopkBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_router_topk_backward(a));
  return b.kernels().moe->router_topk_backward(b, a);
}

Status aux_loss(Backend& b, const AuxLossArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_aux_loss(a));
  return b.kernels().moe->aux_loss(b, a);
}

Status aux_loss_backward(Backend& b, const AuxLossBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_aux_loss_backward(a));
  return b.kernels().moe->aux_loss_backward(b, a);
}

Status permute(Backend& b, const PermuteArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_permute(a));
  return b.kernels().moe->permute(b, a);
}

Status permute_backward(Backend& b, const PermuteBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_permute_backward(a));
  return b.kernels().moe->permute_backward(b, a);
}

Status swiglu(Backend& b, const SwigluArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_swiglu(a));
  return b.kernels().moe->swiglu(b, a);
}

Status swiglu_backward(Backend& b, const SwigluBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_swiglu_backward(a));
  return b.kernels().moe->swiglu_backward(b, a);
}

Status unpermute(Backend& b, const UnpermuteArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_unpermute(a));
  return b.kernels().moe->unpermute(b, a);
}

Status unpermute_backward(Backend& b, const UnpermuteBackwardArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_unpermute_backward(a));
  return b.kernels().moe->unpermute_backward(b, a);
}

Status routing_plan(Backend& b, const RoutingPlanArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_routing_plan(a));
  return b.kernels().moe->routing_plan(b, a);
}

}  // namespace ops

}  // namespace packmoe
