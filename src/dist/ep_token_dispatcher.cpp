// EpTokenDispatcher: the count exchange and the two row all-to-alls of expert parallelism
// (dist/ep_token_dispatcher.h).
#include "dist/ep_token_dispatcher.h"

#include <numeric>

#include "core/check.h"

namespace packmoe {
namespace {

std::vector<int64_t> scaled(const std::vector<int64_t>& rows, int64_t row_bytes) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * row_bytes;
  return out;
}

int64_t row_bytes_of(const Tensor& t) {
  PACKMOE_CHECK(t.rank() == 2, "EpTokenDispatcher: rows must be (M, W), got "
                                   << shape_string(t.shape()));
  return static_cast<int64_t>(dtype_bytes_for(t.dtype(), static_cast<size_t>(t.dim(1))));
}

}  // namespace

EpTokenDispatcher::EpTokenDispatcher(Communicator& ep_comm, int64_t experts, DispatchDtype dtype)
    : comm_(&ep_comm), experts_(experts), local_(experts / ep_comm.size()), dtype_(dtype) {
  PACKMOE_CHECK(experts > 0 && experts % ep_comm.size() == 0,
                "EpTokenDispatcher: " << experts << " experts over " << ep_comm.size()
                                      << " EP ranks");
}

ExpertRows EpTokenDispatcher::dispatch(const ExpertRows& all) {
  PACKMOE_CHECK(!combining_, "EpTokenDispatcher: dispatch while a combine is in flight");
  Backend& b = comm_->backend();
  const int ep = comm_->size();
  PACKMOE_CHECK(all.counts.dtype() == DType::kI64 && all.counts.numel() == experts_,
                "EpTokenDispatcher: dispatch needs (" << experts_ << ",) i64 counts");
  PACKMOE_CHECK(all.amax.data() == nullptr ||
                    (all.amax.dtype() == DType::kF32 && all.amax.numel() == experts_),
                "EpTokenDispatcher: a payload's amax must be (" << experts_ << ",) f32");
  std::vector<int64_t> counts = all.host_counts;  // (E) this rank's, padded
  if (counts.empty()) {
    counts.resize(static_cast<size_t>(experts_));
    b.copy(counts.data(), all.counts.data(), all.counts.nbytes(), Backend::CopyKind::kDeviceToHost);
  }
  PACKMOE_CHECK(static_cast<int64_t>(counts.size()) == experts_,
                "EpTokenDispatcher: " << counts.size() << " host counts for " << experts_
                                      << " experts");

  // Every peer's counts of this rank's experts: (EP, E_local), source-major.
  ExpertRows local;
  local.counts = Tensor::empty(b, DType::kI64, {ep * local_});
  const std::vector<int64_t> count_bytes(static_cast<size_t>(ep),
                                         local_ * static_cast<int64_t>(sizeof(int64_t)));
  comm_->all_to_allv(all.counts.data(), count_bytes, local.counts.data(), count_bytes);
  local.host_counts.assign(static_cast<size_t>(ep * local_), 0);
  b.copy(local.host_counts.data(), local.counts.data(), local.counts.nbytes(),
         Backend::CopyKind::kDeviceToHost);

  send_rows_.assign(static_cast<size_t>(ep), 0);
  recv_rows_.assign(static_cast<size_t>(ep), 0);
  for (int p = 0; p < ep; ++p)
    for (int64_t e = 0; e < local_; ++e) {
      send_rows_[p] += counts[static_cast<size_t>(p * local_ + e)];
      recv_rows_[p] += local.host_counts[static_cast<size_t>(p * local_ + e)];
    }
  const int64_t sent = std::accumulate(send_rows_.begin(), send_rows_.end(), int64_t{0});
  PACKMOE_CHECK(sent <= all.rows.dim(0), "EpTokenDispatcher: counts sum to " << sent << ", rows "
                                                                             << all.rows.dim(0));
  capacity_ = all.rows.dim(0);
  const int64_t received = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});
  local.used = Tensor::empty(b, DType::kI64, {1});
  b.copy(local.used.data(), &received, sizeof received, Backend::CopyKind::kHostToDevice);
  received_ = local;
  ExpertRows out = send_rows(all);
  if (all.amax.data() != nullptr) {  // one F32 per expert group, sent like the counts
    out.amax = Tensor::empty(b, DType::kF32, {ep * local_});
    const std::vector<int64_t> amax_bytes(static_cast<size_t>(ep),
                                          local_ * static_cast<int64_t>(sizeof(float)));
    comm_->all_to_allv(all.amax.data(), amax_bytes, out.amax.data(), amax_bytes);
    row_bytes_sent_ += ep * local_ * static_cast<int64_t>(sizeof(float));
  }
  return out;
}

ExpertRows EpTokenDispatcher::dispatch_again(const ExpertRows& all) {
  PACKMOE_CHECK(!combining_, "EpTokenDispatcher: dispatch while a combine is in flight");
  PACKMOE_CHECK(!send_rows_.empty(), "EpTokenDispatcher: dispatch_again before dispatch");
  PACKMOE_CHECK(all.amax.data() == nullptr,
                "EpTokenDispatcher: an amax travels with a forward dispatch only");
  return send_rows(all);
}

ExpertRows EpTokenDispatcher::send_rows(const ExpertRows& all) {
  PACKMOE_CHECK(all.rows.rank() == 2 && all.rows.dim(0) == capacity_,
                "EpTokenDispatcher: dispatch_again needs the last dispatch's "
                    << capacity_ << " rows, got " << shape_string(all.rows.shape()));
  const int64_t row_bytes = row_bytes_of(all.rows);
  const int64_t received = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});
  ExpertRows local = received_;
  local.rows = Tensor::empty(comm_->backend(), all.rows.dtype(), {received, all.rows.dim(1)});
  comm_->all_to_allv(all.rows.data(), scaled(send_rows_, row_bytes), local.rows.data(),
                     scaled(recv_rows_, row_bytes));
  row_bytes_sent_ += std::accumulate(send_rows_.begin(), send_rows_.end(), int64_t{0}) * row_bytes;
  return local;
}

Tensor EpTokenDispatcher::combine(const Tensor& rows) {
  Tensor out = start_combine(rows);
  finish_combine();
  return out;
}

Tensor EpTokenDispatcher::start_combine(const Tensor& rows) {
  PACKMOE_CHECK(!send_rows_.empty(), "EpTokenDispatcher: combine before dispatch");
  PACKMOE_CHECK(!combining_, "EpTokenDispatcher: start_combine while a combine is in flight");
  const int64_t received = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});
  PACKMOE_CHECK(rows.rank() == 2 && rows.dim(0) == received,
                "EpTokenDispatcher: combine needs the " << received << " rows of the dispatch, got "
                                                        << shape_string(rows.shape()));
  const int64_t row_bytes = row_bytes_of(rows);
  Backend& b = comm_->backend();
  // Both buffers are allocated on the backend's stream before the side stream waits for it, and
  // `rows` stays referenced until finish_combine, so the pool cannot hand either to other work
  // while the transfer reads or writes it.
  Tensor out = Tensor::empty(b, rows.dtype(), {capacity_, rows.dim(1)});
  comm_->side_waits_for_backend();
  comm_->all_to_allv(rows.data(), scaled(recv_rows_, row_bytes), out.data(),
                     scaled(send_rows_, row_bytes), comm_->side_stream());
  row_bytes_sent_ += received * row_bytes;  // combine sends back what the dispatch received
  in_flight_ = rows;
  combining_ = true;
  return out;
}

void EpTokenDispatcher::finish_combine() {
  PACKMOE_CHECK(combining_, "EpTokenDispatcher: finish_combine without start_combine");
  combining_ = false;
  comm_->backend_waits_for_side();
  in_flight_ = Tensor{};  // freed in the backend's stream order, after the wait
}

}  // namespace packmoe
