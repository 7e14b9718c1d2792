// Communicator: the collectives of data and expert parallelism over Local (1 rank, host), MPI
// (host memory) and NCCL (device memory), and sub-communicators (split). Invariants: every rank
// makes the same calls in the same order; any
// failure (bad arguments, calls that differ across ranks, an MPI/NCCL error, a call that does not
// complete in time) prints one line naming the rank and the operation and terminates the WHOLE
// job instead of hanging it. Local and MPI reduce in increasing rank order (docs/dist.md).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "backend/backend.h"
#include "core/status.h"

namespace packmoe {

enum class CommKind : uint8_t { kLocal, kMpi, kNccl };
std::string_view comm_kind_name(CommKind kind);

enum class ReduceOp : uint8_t { kSum, kMax };
enum class ReduceType : uint8_t { kF32, kF64, kI64 };

// Opaque device stream: a cudaStream_t on CUDA. kBackendStream is the stream of the
// communicator's backend, so collectives are ordered with the backend's ops and copies. Host
// communicators (Local, MPI) are blocking and accept only kBackendStream.
using StreamHandle = void*;
inline constexpr StreamHandle kBackendStream = nullptr;

struct CommOptions {
  // Before each call the ranks all-gather its signature (operation, sizes, root, call number)
  // and abort, printing both sides, when they differ: a mismatched call fails at once instead of
  // hanging or exchanging wrong bytes. Costs one small host all-gather per call.
  bool verify_calls = true;
  // A call whose host part (or, on NCCL, queued device part) has not completed after this many
  // seconds aborts the job; 0 disables the watchdog. Two minutes suit an interactive job: a
  // stopped or stuck rank is reported while the user still waits for it, and the longest
  // legitimate wait, a peer writing its checkpoint files or loading its data while the others
  // wait in the next collective, is well below it at disk speed for the presets (10 GB at
  // 100 MB/s). Larger runs raise it (train --comm-timeout).
  double timeout_s = 120.0;
};
// Defaults overridden by PACKMOE_COMM_VERIFY (0 or 1) and PACKMOE_COMM_TIMEOUT_S (seconds >= 0);
// `packmoe train --comm-timeout` overrides both.
Result<CommOptions> comm_options_from_env();

// Collectives over buffers in backend() memory. Every call is collective: all ranks call it with
// the same sizes (counts vectors included) and root, except all_to_allv (per-rank rows that must
// match pairwise) and split (a per-rank color). Sizes are elements for typed calls and bytes
// for all_gather / broadcast / all_to_allv; zero sizes are legal everywhere (a zero-length
// contribution).
// In-place forms are the ones named per call; any other overlap of in and out aborts.
// One host thread issues the calls of a communicator. NCCL calls are queued on `stream` and
// return before they complete (stream order is the completion); host calls return complete.
class Communicator {
 public:
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  CommKind kind() const { return kind_; }
  Backend& backend() const { return *backend_; }
  const CommOptions& options() const { return options_; }
  // True (Local, MPI) when a floating-point sum is in_0 + in_1 + ... + in_{N-1} evaluated left to
  // right in the element type, bitwise; false (NCCL) when the order is NCCL's own: the same bits
  // for the same N, topology and NCCL version, within (N-1)u * sum|in_r| of the exact sum.
  bool rank_ordered() const { return kind_ != CommKind::kNccl; }

  // out (count) = reduction over ranks of in (count). In place when in == out. kMax is exact;
  // Local/MPI: NaN if any rank has NaN (the lowest such rank's), of +0/-0 the lower rank's.
  void all_reduce(const float* in, float* out, int64_t count, ReduceOp op,
                  StreamHandle stream = kBackendStream);
  void all_reduce(const double* in, double* out, int64_t count, ReduceOp op,
                  StreamHandle stream = kBackendStream);
  void all_reduce(const int64_t* in, int64_t* out, int64_t count, ReduceOp op,
                  StreamHandle stream = kBackendStream);

  // Sum: in (size * count) holds one block per rank in rank order; out (count) receives block
  // rank() summed over ranks. In place when out == in + rank() * count.
  void reduce_scatter(const float* in, float* out, int64_t count,
                      StreamHandle stream = kBackendStream);
  // Uneven blocks: in (sum counts), block r = counts[r] elements at the prefix offset; out
  // (counts[rank()]). In place when out == in + offset(rank()). Equal counts give the same bits
  // as reduce_scatter.
  void reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                       StreamHandle stream = kBackendStream);

  // Each rank contributes `bytes` from in; out (size * bytes) holds them in rank order. In place
  // when in == out + rank() * bytes.
  void all_gather(const void* in, void* out, int64_t bytes, StreamHandle stream = kBackendStream);
  // Rank r contributes bytes[r]; out (sum bytes) holds them at the prefix offsets. In place when
  // in == out + offset(rank()).
  void all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                   StreamHandle stream = kBackendStream);

  // buf (bytes) of rank `root` is copied into buf of every rank.
  void broadcast(void* buf, int64_t bytes, int root, StreamHandle stream = kBackendStream);

  // Each rank sends send_bytes[p] bytes to rank p, from `in` at the prefix offsets of send_bytes
  // (rank order), and receives recv_bytes[p] bytes from rank p into `out` at the prefix offsets of
  // recv_bytes. Collective; recv_bytes[p] on rank q must equal send_bytes[q] on rank p (checked
  // when verify_calls is on: the ranks exchange their send-size rows and abort, naming both ranks
  // and the sizes, on a mismatch; recv_bytes[rank()] == send_bytes[rank()] is checked always).
  // in and out must not overlap. Zero sizes legal (a rank that sends or receives nothing). Both
  // spans have size() entries. NCCL: a group of ncclSend / ncclRecv, one per peer with bytes.
  void all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                   std::span<const int64_t> recv_bytes, StreamHandle stream = kBackendStream);

  // A communicator over the ranks of this one that pass the same `color` (>= 0), ranked in this
  // communicator's rank order; same kind, backend and options. Collective over this communicator.
  // Its failures abort the whole job like any other. Parent and split are independently
  // destructible, in any order (MPI is finalised with the last MPI communicator, split or not);
  // on NCCL every rank destroys its communicators in the same order (ncclCommFinalize waits for
  // the peers).
  std::unique_ptr<Communicator> split(int color);

  // Returns once every rank has entered it; NCCL first waits for this rank's work queued on the
  // backend stream.
  void barrier();

  // ---- overlap with the backend's work ------------------------------------------------------
  // A stream for collectives that run beside the backend's own work: NCCL's own CUDA stream (high
  // priority); kBackendStream for host communicators, whose calls stay blocking. The caller
  // orders it with the two fences below, both no-ops on host communicators.
  virtual StreamHandle side_stream() { return kBackendStream; }
  // Work queued on side_stream() from now on starts after all work queued on the backend stream
  // so far (an event recorded there, waited for on the side stream).
  virtual void side_waits_for_backend() {}
  // Work queued on the backend stream from now on starts after all work queued on side_stream()
  // so far.
  virtual void backend_waits_for_side() {}

  // Prints "[rank r/N] packmoe: <kind> <op> (call #k) failed: <why>; aborting the job" (the call
  // number when a collective is in flight) and terminates every rank (MPI_Abort; NCCL:
  // ncclCommAbort first). Never returns.
  [[noreturn]] void fail(std::string_view op, std::string_view why);
  // Terminates every rank of the job without printing.
  [[noreturn]] virtual void abort_job() = 0;

 protected:
  // `whole_job`: the communicator over every rank of the job, whose rank PACKMOE_CHECK's line
  // prints; false for split()'s communicators (their rank is not the job's).
  Communicator(CommKind kind, int rank, int size, Backend& backend, CommOptions options,
               bool whole_job = true);

  // The collectives after validation and verification, with per-rank sizes (size() entries).
  virtual void do_all_reduce(ReduceType type, const void* in, void* out, int64_t count,
                             ReduceOp op, StreamHandle stream) = 0;
  virtual void do_reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                                  StreamHandle stream) = 0;
  virtual void do_all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                              StreamHandle stream) = 0;
  virtual void do_broadcast(void* buf, int64_t bytes, int root, StreamHandle stream) = 0;
  virtual void do_all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                              std::span<const int64_t> recv_bytes, StreamHandle stream) = 0;
  // The new communicator of this rank's color, made with whole_job = false.
  virtual std::unique_ptr<Communicator> do_split(int color) = 0;
  virtual void do_barrier() = 0;
  // Host-memory all-gather of `bytes` per rank, for the call signatures.
  virtual void exchange_host(const void* mine, void* all, int64_t bytes) = 0;
  // Polled by the watchdog thread: a description of queued device work older than the timeout,
  // or empty. Host communicators have none.
  virtual std::string stalled_device_work(double timeout_s) { return {}; }

  // The number of the collective in flight (1, 2, ... on every rank alike), 0 when none.
  uint64_t call_number() const { return inflight_since_ns_.load() != 0 ? inflight_seq_.load() : 0; }

  // The watchdog thread calls stalled_device_work(), so a derived class starts it at the end of
  // its constructor and stops it first thing in its destructor.
  void start_watchdog();
  void stop_watchdog();

 private:
  struct Call;  // one call's signature, validated and verified in communicator.cpp
  void all_reduce_any(ReduceType type, const void* in, void* out, int64_t count, ReduceOp op,
                      StreamHandle stream);
  [[noreturn]] void fail_at(uint64_t seq, std::string_view op, std::string_view why);
  void enter(const Call& call);
  void leave();
  void verify(const Call& call);
  void verify_all_to_all(const Call& call, std::span<const int64_t> send_bytes,
                         std::span<const int64_t> recv_bytes);
  void watchdog_loop();

  CommKind kind_;
  int rank_;
  int size_;
  Backend* backend_;
  CommOptions options_;
  uint64_t calls_ = 0;  // collectives issued so far on this rank

  // The call in flight, read by the watchdog thread.
  std::atomic<int64_t> inflight_since_ns_{0};  // 0: none
  std::atomic<int> inflight_op_{0};
  std::atomic<uint64_t> inflight_seq_{0};

  std::thread watchdog_;
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;
  bool watchdog_stop_ = false;
};

// ---- implementations and factory ------------------------------------------------------------

// One rank, in the backend's memory (host or device): every collective is a copy (or nothing, in
// place); split() returns another one-rank communicator.
std::unique_ptr<Communicator> make_local_communicator(Backend& backend,
                                                      const CommOptions& options);

// All ranks of the MPI job (MPI_COMM_WORLD, duplicated), host memory. MPI is initialised at the
// first MPI communicator and finalised when the last one (split ones included) is destroyed; a
// second initialisation after that is an error (MPI forbids it), so a job keeps one communicator
// alive throughout.
Result<std::unique_ptr<Communicator>> make_mpi_communicator(Backend& host_backend,
                                                            const CommOptions& options);

// Under mpirun (OMPI_COMM_WORLD_SIZE set): kMpi for host buffers, kNccl for CUDA; otherwise
// kLocal for host buffers and a one-rank kNccl for CUDA.
CommKind comm_kind_for(Device device);
bool launched_by_mpirun();
// CUDA devices visible to this process, counted without creating the CUDA backend (which would
// bind the process to GPU 0 before a multi-rank job picks one GPU per rank); 0 in builds without
// CUDA or when none is usable.
int visible_cuda_devices();

// kLocal / kMpi use the CPU backend. kNccl selects GPU OMPI_COMM_WORLD_LOCAL_RANK before the CUDA
// backend is first created (so create the communicator before any CUDA work), bootstraps NCCL
// through MPI under mpirun, and fails in builds without CUDA. Errors are Status.
Result<std::unique_ptr<Communicator>> make_communicator(CommKind kind, const CommOptions& options);
// comm_kind_for(device) with comm_options_from_env().
Result<std::unique_ptr<Communicator>> make_communicator(Device device);

}  // namespace packmoe
