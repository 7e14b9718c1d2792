// NcclCommunicator: the collectives over NCCL on device memory, one GPU per rank, queued on a
// stream (the CUDA backend's by default, or its own side stream, fenced by events, to overlap).
// Invariants: even sizes use NCCL's collective, uneven ones a group of rooted calls, chosen from
// the sizes alone (so every rank takes the same path and repeated calls give the same bits);
// floating-point sums follow NCCL's order, not rank order. A split communicator pairs an
// ncclCommSplit of this one with a split of the host channel, so both rank alike.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "dist/nccl_communicator.h"

namespace packmoe {
namespace {

ncclDataType_t nccl_type(ReduceType t) {
  switch (t) {
    case ReduceType::kF32: return ncclFloat32;
    case ReduceType::kF64: return ncclFloat64;
    case ReduceType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

bool all_equal(std::span<const int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s != sizes[0]) return false;
  }
  return true;
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(CudaBackend& cuda, std::unique_ptr<Communicator> host, ncclComm_t comm,
                   const CommOptions& options, bool whole_job)
      : Communicator(CommKind::kNccl, host->rank(), host->size(), cuda, options, whole_job),
        cuda_(cuda),
        host_(std::move(host)),
        comm_(comm) {
    int least = 0, greatest = 0;  // greatest: the highest priority (numerically lowest)
    // (this->cuda: the parameter `cuda` hides the checking member here)
    this->cuda("create", cudaDeviceGetStreamPriorityRange(&least, &greatest),
               "cudaDeviceGetStreamPriorityRange");
    this->cuda("create", cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest),
               "cudaStreamCreateWithPriority");
    this->cuda("create", cudaEventCreateWithFlags(&backend_done_, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
    this->cuda("create", cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
    start_watchdog();
  }

  ~NcclCommunicator() override {
    stop_watchdog();
    ncclCommFinalize(comm_);  // flushes the queued collectives
    ncclCommDestroy(comm_);
    cudaStreamSynchronize(side_);
    cudaStreamDestroy(side_);
    cudaEventDestroy(backend_done_);
    cudaEventDestroy(side_done_);
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  // ncclCommAbort is safe from any thread and releases this rank's queued NCCL kernels; the host
  // channel then terminates the other ranks.
  [[noreturn]] void abort_job() override {
    ncclCommAbort(comm_);
    host_->abort_job();
    std::abort();  // not reached: the host channel's abort_job() never returns
  }

 protected:
  void do_all_reduce(ReduceType type, const void* in, void* out, int64_t count, ReduceOp op,
                     StreamHandle stream) override {
    if (count == 0) return;
    const cudaStream_t s = stream_of(stream);
    nccl("all_reduce",
         ncclAllReduce(in, out, static_cast<size_t>(count), nccl_type(type),
                       op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, s),
         "ncclAllReduce");
    track("all_reduce", s);
  }

  void do_reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                          StreamHandle stream) override {
    const cudaStream_t s = stream_of(stream);
    if (all_equal(counts)) {
      if (counts[0] == 0) return;
      nccl("reduce_scatter",
           ncclReduceScatter(in, out, static_cast<size_t>(counts[0]), ncclFloat32, ncclSum, comm_, s),
           "ncclReduceScatter");
    } else {
      nccl("reduce_scatter", ncclGroupStart(), "ncclGroupStart");
      int64_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        if (counts[r] > 0)
          nccl("reduce_scatter",
               ncclReduce(in + offset, out, static_cast<size_t>(counts[r]), ncclFloat32, ncclSum, r,
                          comm_, s),
               "ncclReduce");
        offset += counts[r];
      }
      nccl("reduce_scatter", ncclGroupEnd(), "ncclGroupEnd");
    }
    track("reduce_scatter", s);
  }

  void do_all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                      StreamHandle stream) override {
    const cudaStream_t s = stream_of(stream);
    if (all_equal(bytes)) {
      if (bytes[0] == 0) return;
      nccl("all_gather",
           ncclAllGather(in, out, static_cast<size_t>(bytes[0]), ncclUint8, comm_, s),
           "ncclAllGather");
    } else {
      nccl("all_gather", ncclGroupStart(), "ncclGroupStart");
      int64_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        if (bytes[r] > 0)
          nccl("all_gather",
               ncclBroadcast(in, static_cast<char*>(out) + offset, static_cast<size_t>(bytes[r]),
                             ncclUint8, r, comm_, s),
               "ncclBroadcast");
        offset += bytes[r];
      }
      nccl("all_gather", ncclGroupEnd(), "ncclGroupEnd");
    }
    track("all_gather", s);
  }

  void do_broadcast(void* buf, int64_t bytes, int root, StreamHandle stream) override {
    if (bytes == 0) return;
    const cudaStream_t s = stream_of(stream);
    nccl("broadcast",
         ncclBroadcast(buf, buf, static_cast<size_t>(bytes), ncclUint8, root, comm_, s),
         "ncclBroadcast");
    track("broadcast", s);
  }

  // One group of point-to-point calls; a pair with zero bytes is skipped on both sides alike
  // (the sizes match pairwise), and a rank with nothing to move queues nothing.
  void do_all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                      std::span<const int64_t> recv_bytes, StreamHandle stream) override {
    bool any = false;
    for (int p = 0; p < size(); ++p) any = any || send_bytes[p] > 0 || recv_bytes[p] > 0;
    if (!any) return;
    const cudaStream_t s = stream_of(stream);
    nccl("all_to_allv", ncclGroupStart(), "ncclGroupStart");
    int64_t send_offset = 0, recv_offset = 0;
    for (int p = 0; p < size(); ++p) {
      if (send_bytes[p] > 0)
        nccl("all_to_allv",
             ncclSend(static_cast<const char*>(in) + send_offset, static_cast<size_t>(send_bytes[p]),
                      ncclUint8, p, comm_, s),
             "ncclSend");
      if (recv_bytes[p] > 0)
        nccl("all_to_allv",
             ncclRecv(static_cast<char*>(out) + recv_offset, static_cast<size_t>(recv_bytes[p]),
                      ncclUint8, p, comm_, s),
             "ncclRecv");
      send_offset += send_bytes[p];
      recv_offset += recv_bytes[p];
    }
    nccl("all_to_allv", ncclGroupEnd(), "ncclGroupEnd");
    track("all_to_allv", s);
  }

  // The host channel first (MPI_Comm_split, or a new Local one), then NCCL's split (blocking, with
  // the parent's configuration and no shared resources, so either may be destroyed first); both
  // order the ranks of a color by this communicator's rank.
  std::unique_ptr<Communicator> do_split(int color) override {
    std::unique_ptr<Communicator> host = host_->split(color);
    ncclComm_t part = nullptr;
    nccl("split", ncclCommSplit(comm_, color, rank(), &part, nullptr), "ncclCommSplit");
    int nccl_rank = -1, nccl_size = -1;
    nccl("split", ncclCommUserRank(part, &nccl_rank), "ncclCommUserRank");
    nccl("split", ncclCommCount(part, &nccl_size), "ncclCommCount");
    PACKMOE_CHECK(nccl_rank == host->rank() && nccl_size == host->size(),
                  "NCCL split rank " << nccl_rank << " of " << nccl_size << ", host channel "
                                     << host->rank() << " of " << host->size());
    return std::make_unique<NcclCommunicator>(cuda_, std::move(host), part, options(),
                                              /*whole_job=*/false);
  }

  void do_barrier() override {
    cuda("barrier", cudaStreamSynchronize(cuda_.stream()), "cudaStreamSynchronize");
    cuda("barrier", cudaStreamSynchronize(side_), "cudaStreamSynchronize");
    host_->barrier();
  }

  StreamHandle side_stream() override { return side_; }

  void side_waits_for_backend() override {
    cuda("overlap", cudaEventRecord(backend_done_, cuda_.stream()), "cudaEventRecord");
    cuda("overlap", cudaStreamWaitEvent(side_, backend_done_, 0), "cudaStreamWaitEvent");
  }

  void backend_waits_for_side() override {
    cuda("overlap", cudaEventRecord(side_done_, side_), "cudaEventRecord");
    cuda("overlap", cudaStreamWaitEvent(cuda_.stream(), side_done_, 0), "cudaStreamWaitEvent");
  }

  void exchange_host(const void* mine, void* all, int64_t bytes) override {
    host_->all_gather(mine, all, bytes);
  }

  // Runs on the watchdog thread: NCCL's asynchronous errors, then the oldest queued collective.
  std::string stalled_device_work(double timeout_s) override {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress)
      return std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(async) +
             " (" + ncclGetLastError(comm_) + ")";
    cudaSetDevice(cuda_.device_index());  // this thread's current device, for the event queries
    std::lock_guard<std::mutex> lock(pending_mutex_);
    while (!pending_.empty() && cudaEventQuery(pending_.front().event) == cudaSuccess) {
      free_events_.push_back(pending_.front().event);
      pending_.pop_front();
    }
    if (pending_.empty()) return {};
    const Pending& oldest = pending_.front();
    if (steady_ns() - oldest.since_ns <= static_cast<int64_t>(timeout_s * 1e9)) return {};
    std::ostringstream os;
    os << oldest.op << " (call #" << oldest.seq << ") queued on the GPU has not completed after "
       << timeout_s << " s (PACKMOE_COMM_TIMEOUT_S): another rank is missing, stuck or dead";
    return os.str();
  }

 private:
  struct Pending {
    cudaEvent_t event;
    const char* op;
    uint64_t seq;
    int64_t since_ns;
  };

  cudaStream_t stream_of(StreamHandle s) const {
    return s == kBackendStream ? cuda_.stream() : static_cast<cudaStream_t>(s);
  }

  void nccl(const char* op, ncclResult_t r, const char* function) {
    if (r == ncclSuccess) return;
    fail(op, std::string(function) + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(comm_) +
                 ")");
  }

  void cuda(const char* op, cudaError_t e, const char* function) {
    if (e == cudaSuccess) return;
    fail(op, std::string(function) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }

  // An event after the collective lets the watchdog see it complete (or not).
  void track(const char* op, cudaStream_t s) {
    if (options().timeout_s <= 0) return;
    std::lock_guard<std::mutex> lock(pending_mutex_);
    cudaEvent_t e = nullptr;
    if (free_events_.empty()) {
      cuda(op, cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    } else {
      e = free_events_.back();
      free_events_.pop_back();
    }
    cuda(op, cudaEventRecord(e, s), "cudaEventRecord");
    pending_.push_back(Pending{e, op, call_number(), steady_ns()});
  }

  CudaBackend& cuda_;
  std::unique_ptr<Communicator> host_;
  ncclComm_t comm_;
  cudaStream_t side_ = nullptr;         // side_stream(): overlapped collectives
  cudaEvent_t backend_done_ = nullptr;  // side_waits_for_backend's fence
  cudaEvent_t side_done_ = nullptr;     // backend_waits_for_side's fence
  std::mutex pending_mutex_;  // the watchdog thread retires completed events
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
};

// With several ranks the others already wait in the bootstrap: abort them all.
Status bootstrap_error(Communicator& host, const std::string& why) {
  if (host.size() > 1) host.fail("nccl bootstrap", why);
  return Status::error(why);
}

}  // namespace

int cuda_device_count() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return devices;
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(std::unique_ptr<Communicator> host,
                                                             const CommOptions& options) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return bootstrap_error(*host, "no CUDA device is visible: NCCL needs one GPU per rank");
  }
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const int local_rank = local ? std::atoi(local) : 0;
  if (local_rank < 0 || local_rank >= devices)
    return bootstrap_error(*host, "local rank " + std::to_string(local_rank) + " on this host but " +
                                      std::to_string(devices) +
                                      " GPUs visible: start at most one rank per GPU");
  if (cudaSetDevice(local_rank) != cudaSuccess)
    return bootstrap_error(*host, "cudaSetDevice(" + std::to_string(local_rank) + ") failed");
  Result<Backend*> backend = cuda_backend_instance();
  if (!backend) return bootstrap_error(*host, backend.status().message());
  auto& cuda = static_cast<CudaBackend&>(*backend.value());
  if (cuda.device_index() != local_rank)
    return bootstrap_error(*host, "the CUDA backend was created on GPU " +
                                      std::to_string(cuda.device_index()) + ", this rank needs GPU " +
                                      std::to_string(local_rank) +
                                      ": create the communicator before any CUDA work");

  ncclUniqueId id{};
  if (host->rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      return bootstrap_error(*host, std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  }
  host->broadcast(&id, sizeof id, 0);
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, host->size(), id, host->rank());
  if (r != ncclSuccess)
    return bootstrap_error(*host, std::string("ncclCommInitRank: ") + ncclGetErrorString(r) + " (" +
                                      ncclGetLastError(nullptr) + ")");
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(cuda, std::move(host), comm, options, /*whole_job=*/true));
}

}  // namespace packmoe
