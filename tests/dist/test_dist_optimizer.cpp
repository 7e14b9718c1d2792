// DistOptimizer under Local (alone) and MPI (mpirun -np 2 / 3), host memory: the checks of
// tests/common/dist_optimizer_checks.h, where every sum is the rank-ordered one, bitwise.
#include "common/dist_optimizer_checks.h"

int main(int argc, char** argv) {
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
