// Trainer checkpoints across world sizes over NCCL, one GPU per rank: the checks of
// tests/common/dist_checkpoint_checks.h on the CUDA backend. CTest: --save DIR with 2 ranks, then
// --load DIR with 1 and 2 (3 ranks would sum in NCCL's order and need 3 GPUs: skipped, exit 77).
#include "common/cuda_ranks.h"
#include "common/dist_checkpoint_checks.h"

int main(int argc, char** argv) {
  if (!packmoe::dist_test::gpu_for_every_rank()) return 77;
  if (!packmoe::dist_test::nccl_sums_are_bitwise()) return 77;
  return packmoe::dist_test::run_checkpoint_tests(argc, argv, packmoe::Device::kCUDA, true);
}
