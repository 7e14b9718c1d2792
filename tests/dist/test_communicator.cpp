// Local and MPI communicators on host memory: the shared checks of
// tests/common/communicator_checks.h and tests/common/communicator_ep_checks.h (all_to_allv,
// split), run alone (Local) and under mpirun -np 2, 3 and 4 (MPI), where every floating-point sum
// must equal the left-to-right rank-ordered sum bitwise.
#include <cstdlib>
#include <string>

#include "common/communicator_checks.h"
#include "common/communicator_ep_checks.h"

namespace packmoe::comm_checks {
namespace {

TEST(Communicator, KindFollowsTheLauncher) {
  EXPECT_EQ(comm().kind(), launched_by_mpirun() ? CommKind::kMpi : CommKind::kLocal);
  EXPECT_EQ(comm_kind_for(Device::kCPU), comm().kind());
  EXPECT_EQ(comm_kind_for(Device::kCUDA), CommKind::kNccl);
  EXPECT_TRUE(comm().rank_ordered());
  EXPECT_EQ(comm().backend().device(), Device::kCPU);
}

// PACKMOE_COMM_VERIFY / PACKMOE_COMM_TIMEOUT_S are user input: bad values are a Status.
TEST(CommOptions, FromEnvironment) {
  const char* verify = std::getenv("PACKMOE_COMM_VERIFY");
  const char* timeout = std::getenv("PACKMOE_COMM_TIMEOUT_S");
  const std::string saved_verify = verify ? verify : "", saved_timeout = timeout ? timeout : "";
  unsetenv("PACKMOE_COMM_VERIFY");
  unsetenv("PACKMOE_COMM_TIMEOUT_S");
  ASSERT_TRUE(comm_options_from_env().is_ok());
  EXPECT_TRUE(comm_options_from_env().value().verify_calls);
  EXPECT_EQ(comm_options_from_env().value().timeout_s, 120.0);
  setenv("PACKMOE_COMM_VERIFY", "0", 1);
  setenv("PACKMOE_COMM_TIMEOUT_S", "2.5", 1);
  ASSERT_TRUE(comm_options_from_env().is_ok());
  EXPECT_FALSE(comm_options_from_env().value().verify_calls);
  EXPECT_EQ(comm_options_from_env().value().timeout_s, 2.5);
  setenv("PACKMOE_COMM_VERIFY", "yes", 1);
  EXPECT_EQ(comm_options_from_env().status().message(), "PACKMOE_COMM_VERIFY must be 0 or 1, got 'yes'");
  setenv("PACKMOE_COMM_VERIFY", "1", 1);
  for (const char* bad : {"-1", "", "10s", "nan"}) {
    setenv("PACKMOE_COMM_TIMEOUT_S", bad, 1);
    EXPECT_FALSE(comm_options_from_env().is_ok()) << "'" << bad << "'";
  }
  if (verify) setenv("PACKMOE_COMM_VERIFY", saved_verify.c_str(), 1); else unsetenv("PACKMOE_COMM_VERIFY");
  if (timeout) setenv("PACKMOE_COMM_TIMEOUT_S", saved_timeout.c_str(), 1); else unsetenv("PACKMOE_COMM_TIMEOUT_S");
}

}  // namespace
}  // namespace packmoe::comm_checks

int main(int argc, char** argv) {
  return packmoe::comm_checks::run_all(argc, argv, packmoe::Device::kCPU);
}
