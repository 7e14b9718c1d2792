// Local and MPI communicators on host memory: the shared checks of
// tests/common/communicator_checks.h, run alone (Local) and under mpirun -np 2 and -np 3 (MPI),
// where every floating-point sum must equal the left-to-right rank-ordered sum bitwise.
#include "common/communicator_checks.h"

namespace packmoe::comm_checks {
namespace {

TEST(Communicator, KindFollowsTheLauncher) {
  EXPECT_EQ(comm().kind(), launched_by_mpirun() ? CommKind::kMpi : CommKind::kLocal);
  EXPECT_TRUE(comm().rank_ordered());
  EXPECT_EQ(comm().backend().device(), Device::kCPU);
}

}  // namespace
}  // namespace packmoe::comm_checks

int main(int argc, char** argv) {
  return packmoe::comm_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
