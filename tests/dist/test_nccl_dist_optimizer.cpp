// DistOptimizer over NCCL, one GPU per rank: the checks of tests/common/dist_optimizer_checks.h on
// the CUDA backend. With one or two ranks every NCCL sum is one rounding of a + b, so the bitwise
// expectations hold as on MPI; more ranks sum in NCCL's own order, so the run exits 77 (skipped),
// as it does when the host has fewer GPUs than ranks.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "common/dist_optimizer_checks.h"

int main(int argc, char** argv) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("skipped: no CUDA device is visible\n");
    return 77;
  }
  const char* per_host = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (per_host && std::atoi(per_host) > gpus) {
    std::printf("skipped: %s ranks on this host need as many GPUs, %d visible\n", per_host, gpus);
    return 77;
  }
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (world && std::atoi(world) > 2) {
    std::printf("skipped: %s NCCL ranks sum in NCCL's order; the bitwise checks need <= 2\n",
                world);
    return 77;
  }
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCUDA);
}
