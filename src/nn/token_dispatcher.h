// TokenDispatcher: the seam between an MoEBlock's token side and its expert MLP. After permute the
// block holds rows grouped by expert (every expert of the layer, padded counts); dispatch hands
// the expert MLP the rows of the experts this rank holds, combine brings the MLP's output rows
// back into the block's order. Backward uses the same two calls (dY rows go to the experts like
// the inputs did, dX rows come back like the outputs), so a dispatcher is its own adjoint.
// Invariant: combine(dispatch(rows)) returns rows in the order dispatch received them; counts stay
// in the backend's memory (no host synchronisation inside a micro-batch).
// LocalTokenDispatcher (one rank holds every expert) is the identity; expert parallelism (tokens
// sent to the ranks that hold their experts by all-to-all) implements the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "nn/recipe.h"

namespace packmoe {

// Rows grouped by expert: (capacity, C), expert g's counts[g] rows after g-1's. The counts live in
// the backend's memory (nothing waits on the host for them) and sum to `used` <= capacity: the
// rows past it are unused.
// A dispatcher that brought the rows from S ranks (expert parallelism) gives S x G counts,
// source-major, and knows them on the host too (host_counts; empty otherwise). A caller may give
// dispatch the counts on the host as well, which the dispatcher then need not copy.
// With DispatchDtype::kRecipe the forward's rows are a DispatchPayload's (nn/dispatch_payload.h):
// rows (capacity, W) U8 in its group-major layout and NVFP4's per-group amax, which travels with
// its group.
struct ExpertRows {
  Tensor rows;
  Tensor counts;                     // (G,) or (S * G,) I64, multiples of the token alignment
  Tensor used;                       // (1,) I64, the sum of counts
  std::vector<int64_t> host_counts;  // counts on the host, when the dispatcher has them
  Tensor amax;                       // (G,) or (S * G,) F32: a payload's NVFP4 amax; else empty
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  // all: the rows of every one of the layer's E experts (counts as the routing plan pads them),
  // in the backend's memory. Returns the rows of this rank's experts.
  virtual ExpertRows dispatch(const ExpertRows& all) = 0;
  // dispatch of rows laid out as the last dispatch's input, with its counts (backward's dY rows
  // after the forward's x rows): a dispatcher may reuse what that dispatch exchanged. The
  // default dispatches anew.
  virtual ExpertRows dispatch_again(const ExpertRows& all) { return dispatch(all); }
  // rows: (M_local, C), the expert MLP's output for the last dispatch's rows. Returns (M, C) in
  // that dispatch's input order.
  virtual Tensor combine(const Tensor& rows) = 0;
  // combine, split so that independent work runs beside the transfer: the returned (M, C) tensor
  // holds its rows for work queued on the backend after finish_combine(); the backend work queued
  // in between (MoEBlock's backward: the expert wgrads and the router's backward) overlaps it.
  // The dispatcher keeps `rows` alive until then. Defaults: combine, and nothing to wait for.
  virtual Tensor start_combine(const Tensor& rows) { return combine(rows); }
  virtual void finish_combine() {}
  // True when start_combine's transfer runs beside the backend's later work (expert parallelism),
  // so the block queues the expert wgrads behind it; otherwise each wgrad follows its dgrad.
  virtual bool overlaps_combine() const { return false; }
  // How the block hands dispatch its forward rows: BF16, or (kRecipe) as the FC1 recipe's payload.
  virtual DispatchDtype dispatch_dtype() const { return DispatchDtype::kBF16; }
  // True when dispatch reads the counts on the host (it copies them itself unless the caller
  // gives them, which lets the caller choose when the host waits for them).
  virtual bool needs_host_counts() const { return false; }
};

// Every expert is local: dispatch and combine return their input.
class LocalTokenDispatcher final : public TokenDispatcher {
 public:
  ExpertRows dispatch(const ExpertRows& all) override { return all; }
  Tensor combine(const Tensor& rows) override { return rows; }
};

}  // namespace packmoe
