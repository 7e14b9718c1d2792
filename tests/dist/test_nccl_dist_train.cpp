// Data-parallel training through the Trainer over NCCL, one GPU per rank: the checks of
// tests/common/dist_train_checks.h on the CUDA backend (2 ranks vs one GPU process with
// grad_accum_steps = 2). Two-rank NCCL sums are one rounding of a + b, as on MPI; more ranks sum
// in NCCL's order, so the run exits 77 (skipped), as it does with fewer GPUs than ranks.
#include "common/cuda_ranks.h"
#include "common/dist_train_checks.h"

int main(int argc, char** argv) {
  if (!packmoe::dist_test::gpu_for_every_rank()) return 77;
  if (!packmoe::dist_test::nccl_sums_are_bitwise()) return 77;
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCUDA);
}
