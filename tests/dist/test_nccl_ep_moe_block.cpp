// The expert-parallel MoEBlock checks (tests/common/ep_moe_block_checks.h) over NCCL, one GPU per
// rank: the all-to-alls in device memory, the backward's combine on NCCL's side stream beside the
// wgrads. No check sums over ranks in NCCL's order, so every rank count is bitwise; a host with
// fewer GPUs than ranks exits 77 (skipped).
#include "common/cuda_ranks.h"
#include "common/ep_moe_block_checks.h"

int main(int argc, char** argv) {
  if (!packmoe::dist_test::gpu_for_every_rank()) return 77;
  return packmoe::dist_test::run_all(argc, argv, packmoe::Device::kCUDA);
}
