// The start of main in the NCCL test binaries: a test with one GPU per rank is skipped (exit 77)
// when no CUDA device is visible or the host runs more ranks than it has GPUs, and the bitwise
// ones also with more than 2 ranks.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace packmoe::dist_test {

// False, after printing why, when this host cannot give every rank of it a GPU of its own.
inline bool gpu_for_every_rank() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("skipped: no CUDA device is visible\n");
    return false;
  }
  const char* per_host = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (per_host && std::atoi(per_host) > gpus) {
    std::printf("skipped: %s ranks on this host need as many GPUs, %d visible\n", per_host, gpus);
    return false;
  }
  return true;
}

// False, after printing why, when the NCCL sums are not one rounding of a + b: with more than 2
// ranks NCCL sums in its own order, so the bitwise checks of the dist tests do not apply.
inline bool nccl_sums_are_bitwise() {
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (world && std::atoi(world) > 2) {
    std::printf("skipped: %s NCCL ranks sum in NCCL's order; the bitwise checks need <= 2\n",
                world);
    return false;
  }
  return true;
}

}  // namespace packmoe::dist_test
