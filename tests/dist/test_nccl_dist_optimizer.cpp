// DistOptimizer over NCCL, one GPU per rank: the checks of tests/common/dist_optimizer_checks.h on
// the CUDA backend. With one or two ranks every NCCL sum is one rounding of a + b, so the bitwise
// expectations hold as on MPI; more ranks sum in NCCL's own order, so the run exits 77 (skipped),
// as it does when the host has fewer GPUs than ranks.
#include <cuda_runtime.h>

#include "common/cuda_ranks.h"
#include "common/dist_optimizer_checks.h"

int main(int argc, char** argv) {
  if (!packmoe::dist_test::gpu_for_every_rank()) return 77;
  if (!packmoe::dist_test::nccl_sums_are_bitwise()) return 77;
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCUDA);
}
