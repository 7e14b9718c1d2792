// Data-parallel training through the Trainer on host memory: Local alone, MPI under mpirun -np 2
// and 3; the checks are tests/common/dist_train_checks.h (N ranks == one process with N
// micro-batches, the overlapped reduce-scatter included).
#include "common/dist_train_checks.h"

int main(int argc, char** argv) {
  return packmoe::dist_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
