// Trainer checkpoints across world sizes on host memory (Local alone, MPI under mpirun): the
// checks of tests/common/dist_checkpoint_checks.h. CTest: --save DIR with 2 ranks, then --load DIR
// with 1, 2 and 3.
#include "common/dist_checkpoint_checks.h"

int main(int argc, char** argv) {
  return packmoe::dist_test::run_checkpoint_tests(argc, argv, packmoe::Device::kCPU, false);
}
