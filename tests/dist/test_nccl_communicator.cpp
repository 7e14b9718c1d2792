// NCCL communicator on device memory, one GPU per rank: the shared checks of
// tests/common/communicator_checks.h (sums bitwise with two ranks, within the order-free bound
// beyond) and tests/common/communicator_ep_checks.h (all_to_allv, split), plus collectives queued
// on a caller's stream. Run alone (one rank) and under `mpirun -np 2` (3, 4) on a machine with as
// many GPUs; exits 77 (skipped) when the host has fewer GPUs than ranks.
#include <cuda_runtime.h>

#include "common/communicator_checks.h"
#include "common/communicator_ep_checks.h"
#include "common/cuda_ranks.h"

namespace packmoe::comm_checks {
namespace {

TEST(NcclCommunicator, KindAndDevice) {
  EXPECT_EQ(comm().kind(), CommKind::kNccl);
  EXPECT_FALSE(comm().rank_ordered());
  EXPECT_EQ(comm().backend().device(), Device::kCUDA);
}

// Collectives on a stream of the caller's (the overlap path): complete once that stream is.
TEST(NcclCommunicator, CallsOnASideStream) {
  SCOPED_TRACE(ctx());
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  const int n = comm().size(), me = comm().rank();
  const int64_t count = 50000;
  const std::vector<std::vector<float>> all = inputs_of_all_ranks<float>(2000, n * count);
  DeviceBuffer in = upload(all[me]);
  DeviceBuffer shard(comm().backend(), count * 4);
  DeviceBuffer gathered(comm().backend(), n * count * 4);
  comm().reduce_scatter(ptr<float>(in), ptr<float>(shard), count, side);
  comm().all_gather(shard.get(), gathered.get(), count * 4, side);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  std::string first;
  EXPECT_EQ(sum_mismatches(download<float>(gathered), all, 0, sums_bitwise(), &first), 0) << first;
  cudaStreamDestroy(side);
}

}  // namespace
}  // namespace packmoe::comm_checks

int main(int argc, char** argv) {
  if (!packmoe::dist_test::gpu_for_every_rank()) return 77;
  return packmoe::comm_checks::run_all(argc, argv, packmoe::Device::kCUDA);
}
