// The expert-parallel MoEBlock checks (tests/common/ep_moe_block_checks.h) on Local and MPI, host
// memory, np 1-4.
#include "common/ep_moe_block_checks.h"

int main(int argc, char** argv) {
  return packmoe::dist_test::run_all(argc, argv, packmoe::Device::kCPU);
}
