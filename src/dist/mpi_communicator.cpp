// MpiCommunicator: the collectives over Open MPI on host memory. Invariant: MPI never adds
// floating-point numbers for us (MPI_SUM's order is implementation-defined); each element is
// reduced by the rank that owns it as in_0 + in_1 + ... + in_{N-1}, left to right, after an
// all-to-all, so results are bitwise reproducible for any N. Integer reductions use MPI's own.
// Every communicator, split ones included, holds the MpiSession: MPI is finalised with the last.
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"

namespace packmoe {
namespace {

// MPI's lifetime in this process: initialised by the first MPI communicator (unless the program
// did it), finalised with the last one (each communicator, split ones included, holds a
// shared_ptr). The thread that initialised MPI makes every MPI call.
class MpiSession {
 public:
  static Result<std::shared_ptr<MpiSession>> acquire();
  ~MpiSession() {
    if (owns_) MPI_Finalize();
  }
  bool on_mpi_thread() const { return std::this_thread::get_id() == mpi_thread_; }

 private:
  MpiSession() = default;
  bool owns_ = false;
  std::thread::id mpi_thread_;
};

Result<std::shared_ptr<MpiSession>> MpiSession::acquire() {
  static std::mutex mutex;
  static std::weak_ptr<MpiSession> current;
  std::lock_guard<std::mutex> lock(mutex);
  if (std::shared_ptr<MpiSession> s = current.lock()) return s;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    return Status::error("MPI was finalised already and cannot start twice in one process: keep "
                         "one communicator alive for the whole job");
  std::shared_ptr<MpiSession> s(new MpiSession());
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;  // FUNNELED: the watchdog thread exists but never calls MPI
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      return Status::error("MPI_Init_thread failed");
    s->owns_ = true;
  }
  s->mpi_thread_ = std::this_thread::get_id();
  current = s;
  return s;
}

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <>
MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiSession> session, MPI_Comm comm, int rank, int size,
                  Backend& backend, const CommOptions& options, bool whole_job)
      : Communicator(CommKind::kMpi, rank, size, backend, options, whole_job),
        session_(std::move(session)),
        comm_(comm) {
    start_watchdog();
  }
  ~MpiCommunicator() override {
    stop_watchdog();
    MPI_Comm_free(&comm_);
  }

  // MPI_Abort on the world (a split communicator's failure ends the whole job too) from the MPI
  // thread; from the watchdog thread (where MPI may not be called) a plain non-zero exit, on
  // which mpirun terminates the other ranks just the same.
  [[noreturn]] void abort_job() override {
    if (session_->on_mpi_thread()) MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

 protected:
  void do_all_reduce(ReduceType type, const void* in, void* out, int64_t count, ReduceOp op,
                     StreamHandle) override {
    if (type == ReduceType::kI64) {
      check("all_reduce",
            MPI_Allreduce(in == out ? MPI_IN_PLACE : in, out, to_int("all_reduce", count, "count"),
                          MPI_INT64_T, op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_),
            "MPI_Allreduce");
      return;
    }
    // Floats: an ordered reduce-scatter over near-equal parts, then an in-place all-gather of the
    // parts; every element is still reduced in rank order, by its part's owner.
    const int n = size();
    std::vector<int64_t> parts(n), part_bytes(n);
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      parts[r] = count / n + (r < count % n ? 1 : 0);
      if (r < rank()) offset += parts[r];
    }
    const int64_t elem = type == ReduceType::kF32 ? 4 : 8;
    for (int r = 0; r < n; ++r) part_bytes[r] = parts[r] * elem;
    char* mine = static_cast<char*>(out) + offset * elem;
    if (type == ReduceType::kF32)
      ordered_reduce_scatterv("all_reduce", static_cast<const float*>(in),
                              reinterpret_cast<float*>(mine), parts, op);
    else
      ordered_reduce_scatterv("all_reduce", static_cast<const double*>(in),
                              reinterpret_cast<double*>(mine), parts, op);
    gatherv("all_reduce", mine, out, part_bytes);
  }

  void do_reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                          StreamHandle) override {
    ordered_reduce_scatterv("reduce_scatter", in, out, counts, ReduceOp::kSum);
  }

  void do_all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                      StreamHandle) override {
    gatherv("all_gather", in, out, bytes);
  }

  void do_broadcast(void* buf, int64_t bytes, int root, StreamHandle) override {
    check("broadcast",
          MPI_Bcast(buf, to_int("broadcast", bytes, "size"), MPI_BYTE, root, comm_), "MPI_Bcast");
  }

  void do_all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                      std::span<const int64_t> recv_bytes, StreamHandle) override {
    const std::string_view op = "all_to_allv";
    const int n = size();
    std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    int64_t send_offset = 0, recv_offset = 0;
    for (int r = 0; r < n; ++r) {
      send_counts[r] = to_int(op, send_bytes[r], "send size");
      send_displs[r] = to_int(op, send_offset, "send offset");
      recv_counts[r] = to_int(op, recv_bytes[r], "receive size");
      recv_displs[r] = to_int(op, recv_offset, "receive offset");
      send_offset += send_bytes[r];
      recv_offset += recv_bytes[r];
    }
    check(op,
          MPI_Alltoallv(in, send_counts.data(), send_displs.data(), MPI_BYTE, out,
                        recv_counts.data(), recv_displs.data(), MPI_BYTE, comm_),
          "MPI_Alltoallv");
  }

  std::unique_ptr<Communicator> do_split(int color) override {
    MPI_Comm part = MPI_COMM_NULL;
    check("split", MPI_Comm_split(comm_, color, rank(), &part), "MPI_Comm_split");
    MPI_Comm_set_errhandler(part, MPI_ERRORS_RETURN);
    int rank = 0, size = 0;
    MPI_Comm_rank(part, &rank);
    MPI_Comm_size(part, &size);
    return std::make_unique<MpiCommunicator>(session_, part, rank, size, backend(), options(),
                                             /*whole_job=*/false);
  }

  void do_barrier() override { check("barrier", MPI_Barrier(comm_), "MPI_Barrier"); }

  void exchange_host(const void* mine, void* all, int64_t bytes) override {
    const int b = static_cast<int>(bytes);
    check("call check", MPI_Allgather(mine, b, MPI_BYTE, all, b, MPI_BYTE, comm_),
          "MPI_Allgather");
  }

 private:
  // MPI-3 counts and displacements are int: a larger buffer goes in several calls.
  int to_int(std::string_view op, int64_t v, const char* what) {
    if (v > std::numeric_limits<int>::max())
      fail(op, std::string(what) + " " + std::to_string(v) +
                   " exceeds MPI's int limit 2147483647: split the buffer into smaller buckets");
    return static_cast<int>(v);
  }

  void check(std::string_view op, int rc, const char* function) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    fail(op, std::string(function) + ": " + std::string(text, len));
  }

  // out (counts[rank]) = fold over r = 0..N-1 of block rank of rank r's in, left to right. The
  // in-place form (out inside in) is safe: the all-to-all has read in before out is written.
  template <typename T>
  void ordered_reduce_scatterv(std::string_view op, const T* in, T* out,
                               std::span<const int64_t> counts, ReduceOp reduce) {
    const int n = size();
    const int64_t mine = counts[rank()];
    std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      send_counts[r] = to_int(op, counts[r], "count");
      send_displs[r] = to_int(op, offset, "offset");
      offset += counts[r];
      recv_counts[r] = to_int(op, mine, "count");
      recv_displs[r] = to_int(op, r * mine, "staging offset");
    }
    staging_.resize(static_cast<size_t>((n * mine * static_cast<int64_t>(sizeof(T)) + 7) / 8));
    T* blocks = reinterpret_cast<T*>(staging_.data());  // (N, mine): block r from rank r
    check(op,
          MPI_Alltoallv(in, send_counts.data(), send_displs.data(), mpi_type<T>(), blocks,
                        recv_counts.data(), recv_displs.data(), mpi_type<T>(), comm_),
          "MPI_Alltoallv");
    if (mine == 0) return;
    std::memcpy(out, blocks, static_cast<size_t>(mine) * sizeof(T));
    for (int r = 1; r < n; ++r) {
      const T* b = blocks + r * mine;
      if (reduce == ReduceOp::kSum) {
        for (int64_t i = 0; i < mine; ++i) out[i] += b[i];
      } else {
        for (int64_t i = 0; i < mine; ++i) {
          if (!std::isnan(out[i]) && (std::isnan(b[i]) || b[i] > out[i])) out[i] = b[i];
        }
      }
    }
  }

  void gatherv(std::string_view op, const void* in, void* out, std::span<const int64_t> bytes) {
    const int n = size();
    std::vector<int> counts(n), displs(n);
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      counts[r] = to_int(op, bytes[r], "size");
      displs[r] = to_int(op, offset, "offset");
      offset += bytes[r];
    }
    to_int(op, offset, "total size");
    const bool in_place = in == static_cast<const char*>(out) + displs[rank()];
    check(op,
          MPI_Allgatherv(in_place ? MPI_IN_PLACE : in, counts[rank()], MPI_BYTE, out,
                         counts.data(), displs.data(), MPI_BYTE, comm_),
          "MPI_Allgatherv");
  }

  std::shared_ptr<MpiSession> session_;
  MPI_Comm comm_;
  std::vector<double> staging_;  // reduce-scatter blocks, reused across calls
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(Backend& host_backend,
                                                            const CommOptions& options) {
  if (host_backend.device() != Device::kCPU)
    return Status::error("the MPI communicator works on host memory, got backend " +
                         host_backend.name());
  Result<std::shared_ptr<MpiSession>> session = MpiSession::acquire();
  if (!session) return session.status();
  MPI_Comm comm = MPI_COMM_NULL;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &comm) != MPI_SUCCESS)
    return Status::error("MPI_Comm_dup(MPI_COMM_WORLD) failed");
  // Errors come back as codes, which fail() turns into one line naming rank and call.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(
      std::move(session).value(), comm, rank, size, host_backend, options, /*whole_job=*/true));
}

}  // namespace packmoe
