// EpTokenDispatcher: expert parallelism's TokenDispatcher (nn/token_dispatcher.h) over the EP
// communicator of one expert-parallel group (dist/expert_layout.h). dispatch sends each EP peer
// the rows of its experts (contiguous: the block's rows are grouped by expert in expert order) and
// receives every peer's rows of this rank's E_local experts, source-major (source 0's rows of
// local experts 0, 1, ..., then source 1's, ...), with their S x E_local counts on the host: the
// expert MLP runs them as S x E_local groups (nn/grouped_linear.h), so a source's rows get the
// bytes they would get on that source alone and each expert's wgrad sums the sources in rank
// order. combine sends every row back to the position it left. Invariant: one count exchange per
// dispatch, whose result the row all-to-all needs on the host (one wait per forward dispatch);
// the backward's dispatch_again reuses it (same plan), so it neither exchanges nor waits.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "nn/token_dispatcher.h"

namespace packmoe {

class EpTokenDispatcher final : public TokenDispatcher {
 public:
  // ep_comm: the EP ranks of this rank's group, in EP-rank order; experts: E of the layer (a
  // multiple of ep_comm.size()); dtype: what the block's forward dispatches hand it.
  EpTokenDispatcher(Communicator& ep_comm, int64_t experts,
                    DispatchDtype dtype = DispatchDtype::kBF16);

  // all: (C, W) rows of the layer's E experts (any W bytes per row: BF16 values or a payload's),
  // counts (E,) I64 (host_counts too, or they are copied here). Returns (sum received, W) rows of
  // this rank's experts from every EP rank, counts (S * E_local,) on the host and in the backend.
  // A payload's amax (E,) F32 travels too: (S * E_local,), source-major like the counts.
  ExpertRows dispatch(const ExpertRows& all) override;
  // The row all-to-all alone, with the last dispatch's counts (no count exchange, no host wait):
  // all.rows must have that dispatch's C rows (no amax: backward's dY rows are BF16).
  ExpertRows dispatch_again(const ExpertRows& all) override;
  // rows: (sum received, W') in the last dispatch's order. Returns (C, W'): each row back at the
  // position it was sent from; rows no expert used stay unwritten.
  Tensor combine(const Tensor& rows) override;
  // The same all-to-all on the communicator's side stream (NCCL: its own CUDA stream; host
  // communicators block, so nothing overlaps there), after the backend's work so far;
  // finish_combine makes the backend's later work wait for it.
  Tensor start_combine(const Tensor& rows) override;
  void finish_combine() override;
  bool overlaps_combine() const override { return true; }
  DispatchDtype dispatch_dtype() const override { return dtype_; }
  bool needs_host_counts() const override { return true; }

  // Bytes of rows (and of the amax beside them) this rank's all-to-alls have sent so far (its own
  // experts' share included): what train::plan_all_to_all bounds.
  int64_t row_bytes_sent() const { return row_bytes_sent_; }

 private:
  ExpertRows send_rows(const ExpertRows& all);  // the row all-to-all with the last plan

  Communicator* comm_;
  int64_t experts_;
  int64_t local_;                   // E_local = E / EP
  DispatchDtype dtype_;
  std::vector<int64_t> send_rows_;  // (EP) rows the last dispatch sent to each peer
  std::vector<int64_t> recv_rows_;  // (EP) rows it received from each
  int64_t capacity_ = 0;            // C: the last dispatch's input rows
  ExpertRows received_;             // the last dispatch's counts (S * E_local), used; no rows
  Tensor in_flight_;                // start_combine's rows, read by the side stream until finish
  bool combining_ = false;          // between start_combine and finish_combine
  int64_t row_bytes_sent_ = 0;
};

}  // namespace packmoe
