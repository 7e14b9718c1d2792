// Communicator front end shared by every implementation: argument validation, the cross-rank call
// signature check, the watchdog and the abort path; plus LocalCommunicator and the environment
// helpers. Invariant: a do_* function only ever sees arguments that passed these checks on every
// rank (when verify_calls is on).
#include "dist/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

namespace packmoe {
namespace {

enum class CallOp : int32_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kBarrier,
  kAllToAll,
  kSplit
};

// all_to_allv's sizes and split's color differ per rank: their signature is the operation and
// the call number (all_to_allv's rows are checked pairwise after it).
bool sizes_per_rank(int32_t op) {
  return op == static_cast<int32_t>(CallOp::kAllToAll) || op == static_cast<int32_t>(CallOp::kSplit);
}

std::string_view call_op_name(int32_t op) {
  switch (static_cast<CallOp>(op)) {
    case CallOp::kAllReduce: return "all_reduce";
    case CallOp::kReduceScatter: return "reduce_scatter";
    case CallOp::kAllGather: return "all_gather";
    case CallOp::kBroadcast: return "broadcast";
    case CallOp::kBarrier: return "barrier";
    case CallOp::kAllToAll: return "all_to_allv";
    case CallOp::kSplit: return "split";
  }
  return "unknown call";
}

std::string_view reduce_type_name(int32_t t) {
  switch (static_cast<ReduceType>(t)) {
    case ReduceType::kF32: return "f32";
    case ReduceType::kF64: return "f64";
    case ReduceType::kI64: return "i64";
  }
  return "?";
}

int64_t reduce_type_bytes(ReduceType t) { return t == ReduceType::kF32 ? 4 : 8; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// FNV-1a over the per-rank sizes: two ranks with different vectors disagree with overwhelming
// probability, and the signature stays fixed-size.
uint64_t hash_sizes(std::span<const int64_t> sizes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int64_t v : sizes) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(b_bytes) && pb < pa + static_cast<uintptr_t>(a_bytes);
}

const char* at_offset(const void* p, int64_t bytes) {
  return static_cast<const char*>(p) + bytes;
}

}  // namespace

// Trivially copyable and free of padding: it is exchanged and compared as raw bytes.
struct Communicator::Call {
  uint64_t seq = 0;
  int32_t op = 0;       // CallOp
  int32_t type = -1;    // ReduceType (all_reduce, reduce_scatter)
  int32_t reduce = -1;  // ReduceOp
  int32_t root = -1;    // broadcast
  int64_t total = 0;    // elements (typed calls) or bytes, summed over ranks where per rank
  uint64_t sizes_hash = 0;  // per-rank sizes (reduce_scatter, all_gather)

  std::string describe() const {
    std::ostringstream os;
    os << call_op_name(op) << "(";
    if (type >= 0) os << reduce_type_name(type) << (reduce == 1 ? " max" : " sum") << ", ";
    if (!sizes_per_rank(op)) os << total << (type >= 0 ? " elements" : " bytes");
    if (sizes_hash != 0) os << ", per-rank sizes #" << std::hex << (sizes_hash & 0xffffffff);
    if (root >= 0) os << ", root " << std::dec << root;
    os << ") as call #" << std::dec << seq;
    return os.str();
  }
};

std::string_view comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::kLocal: return "local";
    case CommKind::kMpi: return "mpi";
    case CommKind::kNccl: return "nccl";
  }
  return "?";
}

Result<CommOptions> comm_options_from_env() {
  CommOptions o;
  if (const char* v = std::getenv("PACKMOE_COMM_VERIFY")) {
    const std::string s(v);
    if (s != "0" && s != "1") return Status::error("PACKMOE_COMM_VERIFY must be 0 or 1, got '" + s + "'");
    o.verify_calls = s == "1";
  }
  if (const char* v = std::getenv("PACKMOE_COMM_TIMEOUT_S")) {
    char* end = nullptr;
    const double t = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(t >= 0) || t > 1e9)
      return Status::error(std::string("PACKMOE_COMM_TIMEOUT_S must be seconds >= 0, got '") + v + "'");
    o.timeout_s = t;
  }
  return o;
}

bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

CommKind comm_kind_for(Device device) {
  if (device == Device::kCUDA) return CommKind::kNccl;
  return launched_by_mpirun() ? CommKind::kMpi : CommKind::kLocal;
}

// ---- front end --------------------------------------------------------------------------------

Communicator::Communicator(CommKind kind, int rank, int size, Backend& backend, CommOptions options,
                           bool whole_job)
    : kind_(kind), rank_(rank), size_(size), backend_(&backend), options_(options) {
  PACKMOE_CHECK(size >= 1 && rank >= 0 && rank < size, "rank " << rank << " of " << size);
  if (whole_job && size > 1) set_check_rank(rank);
}

Communicator::~Communicator() { stop_watchdog(); }

void Communicator::fail(std::string_view op, std::string_view why) {
  fail_at(call_number(), op, why);
}

void Communicator::fail_at(uint64_t seq, std::string_view op, std::string_view why) {
  std::ostringstream os;
  os << "[rank " << rank_ << "/" << size_ << "] packmoe: " << comm_kind_name(kind_) << " " << op;
  if (seq != 0) os << " (call #" << seq << ")";
  os << " failed: " << why << "; aborting the job\n";
  const std::string line = os.str();
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  abort_job();
  std::abort();  // abort_job() never returns; this keeps fail()'s promise if an override did
}

void Communicator::enter(const Call& call) {
  inflight_op_.store(call.op);
  inflight_seq_.store(call.seq);
  inflight_since_ns_.store(now_ns());
  if (options_.verify_calls && size_ > 1) verify(call);
}

void Communicator::leave() { inflight_since_ns_.store(0); }

void Communicator::verify(const Call& call) {
  static_assert(sizeof(Call) == 40, "a Call is exchanged and compared as 40 raw bytes");
  std::vector<Call> all(size_);
  exchange_host(&call, all.data(), sizeof(Call));
  std::string differ;
  for (int r = 1; r < size_; ++r) {
    if (std::memcmp(&all[r], &all[0], sizeof(Call)) != 0)
      differ += "; rank " + std::to_string(r) + ": " + all[r].describe();
  }
  if (!differ.empty())
    fail_at(call.seq, call_op_name(call.op),
            "the ranks made different calls: rank 0: " + all[0].describe() + differ);
}

// After verify(): every rank is in this all_to_allv, so the rows exchange pairs up. Rank q checks
// its recv_bytes against column q of the send rows; a mismatch is reported by the receiver.
void Communicator::verify_all_to_all(const Call& call, std::span<const int64_t> send_bytes,
                                     std::span<const int64_t> recv_bytes) {
  std::vector<int64_t> rows(static_cast<size_t>(size_) * size_);  // (N senders, N receivers)
  exchange_host(send_bytes.data(), rows.data(), size_ * static_cast<int64_t>(sizeof(int64_t)));
  std::ostringstream why;
  for (int p = 0; p < size_; ++p) {
    const int64_t sent = rows[static_cast<size_t>(p) * size_ + rank_];
    if (sent != recv_bytes[p]) {
      why << (why.tellp() > 0 ? "; " : "") << "rank " << rank_ << " expects " << recv_bytes[p]
          << " bytes from rank " << p << ", which sends " << sent << " bytes to rank " << rank_;
    }
  }
  if (why.tellp() > 0) fail_at(call.seq, call_op_name(call.op), why.str());
}

void Communicator::start_watchdog() {
  if (options_.timeout_s <= 0 || watchdog_.joinable()) return;
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void Communicator::stop_watchdog() {
  if (!watchdog_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(watchdog_mutex_);
    watchdog_stop_ = true;
  }
  watchdog_wake_.notify_all();
  watchdog_.join();
}

void Communicator::watchdog_loop() {
  const double timeout = options_.timeout_s;
  const auto poll = std::chrono::duration<double>(std::clamp(timeout / 10, 0.01, 1.0));
  const auto timeout_ns = static_cast<int64_t>(timeout * 1e9);
  std::unique_lock<std::mutex> lock(watchdog_mutex_);
  while (!watchdog_wake_.wait_for(lock, poll, [this] { return watchdog_stop_; })) {
    const int64_t since = inflight_since_ns_.load();
    if (since != 0 && now_ns() - since > timeout_ns) {
      std::ostringstream why;
      why << "not complete after " << timeout
          << " s (the watchdog's limit: --comm-timeout or PACKMOE_COMM_TIMEOUT_S): another rank "
             "is not in the same call (missing, stuck "
             "or dead)";
      fail_at(inflight_seq_.load(), call_op_name(inflight_op_.load()), why.str());
    }
    const std::string stalled = stalled_device_work(timeout);
    if (!stalled.empty()) fail("queued device work", stalled);
  }
}

// ---- public collectives -------------------------------------------------------------------------

// Each public call: local checks (fail on this rank), enter (watchdog + signature check across
// ranks), the implementation, leave.
#define PACKMOE_COMM_REQUIRE(call, cond, msg)                       \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::ostringstream packmoe_comm_os_;                          \
      packmoe_comm_os_ << msg;                                      \
      fail_at((call).seq, call_op_name((call).op), packmoe_comm_os_.str()); \
    }                                                               \
  } while (0)

void Communicator::all_reduce(const float* in, float* out, int64_t count, ReduceOp op,
                              StreamHandle stream) {
  all_reduce_any(ReduceType::kF32, in, out, count, op, stream);
}
void Communicator::all_reduce(const double* in, double* out, int64_t count, ReduceOp op,
                              StreamHandle stream) {
  all_reduce_any(ReduceType::kF64, in, out, count, op, stream);
}
void Communicator::all_reduce(const int64_t* in, int64_t* out, int64_t count, ReduceOp op,
                              StreamHandle stream) {
  all_reduce_any(ReduceType::kI64, in, out, count, op, stream);
}

void Communicator::all_reduce_any(ReduceType type, const void* in, void* out, int64_t count,
                                  ReduceOp op, StreamHandle stream) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kAllReduce);
  call.type = static_cast<int32_t>(type);
  call.reduce = static_cast<int32_t>(op);
  call.total = count;
  PACKMOE_COMM_REQUIRE(call, count >= 0, "count " << count << " < 0");
  PACKMOE_COMM_REQUIRE(call, stream == kBackendStream || kind_ == CommKind::kNccl,
                       "a host communicator is blocking and takes no stream");
  const int64_t bytes = count * reduce_type_bytes(type);
  PACKMOE_COMM_REQUIRE(call, count == 0 || (in != nullptr && out != nullptr),
                       "null buffer for " << count << " elements");
  PACKMOE_COMM_REQUIRE(call, in == out || !overlaps(in, bytes, out, bytes),
                       "in and out overlap but are not equal (the in-place form is in == out)");
  enter(call);
  do_all_reduce(type, in, out, count, op, stream);
  leave();
}

void Communicator::reduce_scatter(const float* in, float* out, int64_t count, StreamHandle stream) {
  const std::vector<int64_t> counts(size_, count);
  reduce_scatterv(in, out, counts, stream);
}

void Communicator::reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                                   StreamHandle stream) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kReduceScatter);
  call.type = static_cast<int32_t>(ReduceType::kF32);
  call.reduce = static_cast<int32_t>(ReduceOp::kSum);
  PACKMOE_COMM_REQUIRE(call, static_cast<int64_t>(counts.size()) == size_,
                       counts.size() << " per-rank counts for " << size_ << " ranks");
  int64_t offset = 0;
  for (int r = 0; r < size_; ++r) {
    PACKMOE_COMM_REQUIRE(call, counts[r] >= 0, "count of rank " << r << " is " << counts[r]);
    if (r < rank_) offset += counts[r];
    call.total += counts[r];
  }
  call.sizes_hash = hash_sizes(counts);
  PACKMOE_COMM_REQUIRE(call, stream == kBackendStream || kind_ == CommKind::kNccl,
                       "a host communicator is blocking and takes no stream");
  const int64_t in_bytes = call.total * 4, out_bytes = counts[rank_] * 4;
  PACKMOE_COMM_REQUIRE(call, in_bytes == 0 || in != nullptr, "in is null for " << call.total << " elements");
  PACKMOE_COMM_REQUIRE(call, out_bytes == 0 || out != nullptr, "out is null for " << counts[rank_] << " elements");
  PACKMOE_COMM_REQUIRE(call, out == in + offset || !overlaps(in, in_bytes, out, out_bytes),
                       "in and out overlap but are not the in-place form out == in + " << offset);
  enter(call);
  do_reduce_scatterv(in, out, counts, stream);
  leave();
}

void Communicator::all_gather(const void* in, void* out, int64_t bytes, StreamHandle stream) {
  const std::vector<int64_t> sizes(size_, bytes);
  all_gatherv(in, out, sizes, stream);
}

void Communicator::all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                               StreamHandle stream) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kAllGather);
  PACKMOE_COMM_REQUIRE(call, static_cast<int64_t>(bytes.size()) == size_,
                       bytes.size() << " per-rank sizes for " << size_ << " ranks");
  int64_t offset = 0;
  for (int r = 0; r < size_; ++r) {
    PACKMOE_COMM_REQUIRE(call, bytes[r] >= 0, "size of rank " << r << " is " << bytes[r]);
    if (r < rank_) offset += bytes[r];
    call.total += bytes[r];
  }
  call.sizes_hash = hash_sizes(bytes);
  PACKMOE_COMM_REQUIRE(call, stream == kBackendStream || kind_ == CommKind::kNccl,
                       "a host communicator is blocking and takes no stream");
  const int64_t mine = bytes[rank_];
  PACKMOE_COMM_REQUIRE(call, mine == 0 || in != nullptr, "in is null for " << mine << " bytes");
  PACKMOE_COMM_REQUIRE(call, call.total == 0 || out != nullptr, "out is null for " << call.total << " bytes");
  PACKMOE_COMM_REQUIRE(call, in == at_offset(out, offset) || !overlaps(in, mine, out, call.total),
                       "in and out overlap but are not the in-place form in == out + " << offset);
  enter(call);
  do_all_gatherv(in, out, bytes, stream);
  leave();
}

void Communicator::broadcast(void* buf, int64_t bytes, int root, StreamHandle stream) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kBroadcast);
  call.root = root;
  call.total = bytes;
  PACKMOE_COMM_REQUIRE(call, bytes >= 0, "size " << bytes << " < 0");
  PACKMOE_COMM_REQUIRE(call, root >= 0 && root < size_, "root " << root << " is not a rank of " << size_);
  PACKMOE_COMM_REQUIRE(call, stream == kBackendStream || kind_ == CommKind::kNccl,
                       "a host communicator is blocking and takes no stream");
  PACKMOE_COMM_REQUIRE(call, bytes == 0 || buf != nullptr, "null buffer for " << bytes << " bytes");
  enter(call);
  do_broadcast(buf, bytes, root, stream);
  leave();
}

void Communicator::all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                               std::span<const int64_t> recv_bytes, StreamHandle stream) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kAllToAll);
  PACKMOE_COMM_REQUIRE(call, static_cast<int64_t>(send_bytes.size()) == size_,
                       send_bytes.size() << " send sizes for " << size_ << " ranks");
  PACKMOE_COMM_REQUIRE(call, static_cast<int64_t>(recv_bytes.size()) == size_,
                       recv_bytes.size() << " receive sizes for " << size_ << " ranks");
  int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < size_; ++r) {
    PACKMOE_COMM_REQUIRE(call, send_bytes[r] >= 0, "send size to rank " << r << " is " << send_bytes[r]);
    PACKMOE_COMM_REQUIRE(call, recv_bytes[r] >= 0,
                         "receive size from rank " << r << " is " << recv_bytes[r]);
    send_total += send_bytes[r];
    recv_total += recv_bytes[r];
  }
  PACKMOE_COMM_REQUIRE(call, recv_bytes[rank_] == send_bytes[rank_],
                       "rank " << rank_ << " sends " << send_bytes[rank_] << " bytes to itself but expects "
                               << recv_bytes[rank_]);
  PACKMOE_COMM_REQUIRE(call, stream == kBackendStream || kind_ == CommKind::kNccl,
                       "a host communicator is blocking and takes no stream");
  PACKMOE_COMM_REQUIRE(call, send_total == 0 || in != nullptr, "in is null for " << send_total << " bytes");
  PACKMOE_COMM_REQUIRE(call, recv_total == 0 || out != nullptr, "out is null for " << recv_total << " bytes");
  PACKMOE_COMM_REQUIRE(call, !overlaps(in, send_total, out, recv_total),
                       "in and out overlap (all_to_allv has no in-place form)");
  enter(call);
  if (options_.verify_calls && size_ > 1) verify_all_to_all(call, send_bytes, recv_bytes);
  do_all_to_allv(in, send_bytes, out, recv_bytes, stream);
  leave();
}

std::unique_ptr<Communicator> Communicator::split(int color) {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kSplit);
  PACKMOE_COMM_REQUIRE(call, color >= 0, "color " << color << " < 0");
  enter(call);
  std::unique_ptr<Communicator> part = do_split(color);
  leave();
  return part;
}

void Communicator::barrier() {
  Call call;
  call.seq = ++calls_;
  call.op = static_cast<int32_t>(CallOp::kBarrier);
  enter(call);
  do_barrier();
  leave();
}

#undef PACKMOE_COMM_REQUIRE

// ---- Local --------------------------------------------------------------------------------------

namespace {

// The sum (or max) over one rank is that rank's input: every collective is a copy.
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(Backend& backend, const CommOptions& options)
      : Communicator(CommKind::kLocal, 0, 1, backend, options) {
    start_watchdog();
  }
  ~LocalCommunicator() override { stop_watchdog(); }

  [[noreturn]] void abort_job() override { std::abort(); }

 protected:
  void do_all_reduce(ReduceType type, const void* in, void* out, int64_t count, ReduceOp,
                     StreamHandle) override {
    copy(out, in, count * reduce_type_bytes(type));
  }
  void do_reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                          StreamHandle) override {
    copy(out, in, counts[0] * 4);
  }
  void do_all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                      StreamHandle) override {
    copy(out, in, bytes[0]);
  }
  void do_broadcast(void*, int64_t, int, StreamHandle) override {}
  void do_all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                      std::span<const int64_t>, StreamHandle) override {
    copy(out, in, send_bytes[0]);
  }
  std::unique_ptr<Communicator> do_split(int) override {
    return std::make_unique<LocalCommunicator>(backend(), options());
  }
  void do_barrier() override { backend().synchronize(); }
  void exchange_host(const void* mine, void* all, int64_t bytes) override {
    std::memcpy(all, mine, static_cast<size_t>(bytes));
  }

 private:
  // Within the backend's memory (host or device).
  void copy(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0 && dst != src)
      backend().copy(dst, src, static_cast<size_t>(bytes), Backend::CopyKind::kDeviceToDevice);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(Backend& backend,
                                                      const CommOptions& options) {
  return std::make_unique<LocalCommunicator>(backend, options);
}

}  // namespace packmoe
