// Status agreement, string broadcast and u64 all-gather through device buffers of the
// communicator's backend.
#include "train/rank_agreement.h"

#include <cstring>

#include "backend/device_buffer.h"

namespace packmoe::train {
namespace {

DeviceBuffer to_device(Backend& b, const void* host, size_t bytes) {
  DeviceBuffer d(b, bytes);
  d.upload({static_cast<const uint8_t*>(host), bytes});
  return d;
}

}  // namespace

Agreement agree(Communicator& comm, const Status& mine) {
  const int world = comm.size();
  // failed[r] = 1 where rank r failed: a sum of one-hot vectors.
  std::vector<int64_t> failed(world, 0);
  failed[comm.rank()] = mine.is_ok() ? 0 : 1;
  DeviceBuffer flags = to_device(comm.backend(), failed.data(), failed.size() * sizeof(int64_t));
  comm.all_reduce(static_cast<int64_t*>(flags.get()), static_cast<int64_t*>(flags.get()), world,
                  ReduceOp::kSum);
  const std::vector<uint8_t> bytes = flags.download();
  std::memcpy(failed.data(), bytes.data(), bytes.size());
  Agreement a;
  for (int r = 0; r < world; ++r) a.failures += failed[r] != 0;
  for (int r = 0; r < world; ++r) {
    if (!failed[r]) continue;
    a.first_failed = r;
    a.message = broadcast_string(comm, mine.message(), r);
    break;
  }
  return a;
}

Status agree_on_status(Communicator& comm, const Status& mine) {
  const Agreement a = agree(comm, mine);
  if (a.failures == 0) return Status::ok();
  return Status::error(a.first_failed == 0 ? a.message
                                           : "rank " + std::to_string(a.first_failed) + ": " +
                                                 a.message);
}

std::string broadcast_string(Communicator& comm, const std::string& value, int root) {
  int64_t length = static_cast<int64_t>(value.size());
  DeviceBuffer n = to_device(comm.backend(), &length, sizeof(length));
  comm.broadcast(n.get(), sizeof(length), root);
  std::memcpy(&length, n.download().data(), sizeof(length));
  std::string out(static_cast<size_t>(length), '\0');
  DeviceBuffer text(comm.backend(), out.size());
  if (comm.rank() == root)
    text.upload({reinterpret_cast<const uint8_t*>(value.data()), out.size()});
  comm.broadcast(text.get(), length, root);
  const std::vector<uint8_t> got = text.download();
  if (length) std::memcpy(out.data(), got.data(), got.size());
  return out;
}

}  // namespace packmoe::train
