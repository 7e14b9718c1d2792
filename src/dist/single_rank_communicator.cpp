// The one-rank communicator for device memory: LocalCommunicator's copies, through the backend.
#include "dist/single_rank_communicator.h"

#include <cstring>

namespace packmoe {
namespace {

int64_t reduce_type_bytes(ReduceType t) { return t == ReduceType::kF32 ? 4 : 8; }

class DeviceLocalCommunicator final : public Communicator {
 public:
  DeviceLocalCommunicator(Backend& backend, const CommOptions& options)
      : Communicator(CommKind::kLocal, 0, 1, backend, options) {}

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
  void do_barrier() override { backend().synchronize(); }
  void exchange_host(const void* mine, void* all, int64_t bytes) override {
    std::memcpy(all, mine, static_cast<size_t>(bytes));
  }

 private:
  void copy(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0 && dst != src)
      backend().copy(dst, src, static_cast<size_t>(bytes), Backend::CopyKind::kDeviceToDevice);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_rank_communicator(Backend& backend) {
  CommOptions options;
  options.verify_calls = false;
  options.timeout_s = 0;
  if (backend.device() == Device::kCPU) return make_local_communicator(backend, options);
  return std::make_unique<DeviceLocalCommunicator>(backend, options);
}

}  // namespace packmoe
