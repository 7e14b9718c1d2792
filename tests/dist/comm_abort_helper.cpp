// Not a test: the program tests/dist/test_comm_failures.cpp runs as `mpirun -np 2
// comm_abort_helper <scenario>` (or alone for the local scenario). Each scenario misuses the
// communicator on one rank; the job must end non-zero with a line naming the rank and the call,
// never hang. Reaching the end means the misuse went unnoticed: exit 0, which the test rejects.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"

using namespace packmoe;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: comm_abort_helper <scenario>\n");
    return 2;
  }
  const std::string scenario = argv[1];
  Result<std::unique_ptr<Communicator>> made = make_communicator(Device::kCPU);
  if (!made) {
    std::fprintf(stderr, "communicator: %s\n", made.status().message().c_str());
    return 2;
  }
  Communicator& c = *made.value();
  const int me = c.rank();
  std::vector<uint8_t> in(64, 1), out(64 * c.size());
  int64_t scalar = me;
  c.barrier();  // call #1 on every rank: the misuse is call #2

  if (scenario == "mismatched-size") {
    c.all_gather(in.data(), out.data(), me == 1 ? 9 : 8);
  } else if (scenario == "mismatched-call") {
    if (me == 1)
      c.broadcast(in.data(), 8, 0);
    else
      c.all_reduce(&scalar, &scalar, 1, ReduceOp::kSum);
  } else if (scenario == "bad-root") {
    c.broadcast(in.data(), 8, me == 1 ? 7 : 0);
  } else if (scenario == "missing-call") {
    if (me == 1)
      std::this_thread::sleep_for(std::chrono::seconds(60));
    else
      c.barrier();
  } else if (scenario == "check-failure") {
    PACKMOE_CHECK(me != 1, "planted programmer error outside the communicator");
    c.barrier();
  } else if (scenario == "over-int-limit") {
    // Never dereferenced: the size check fails before MPI sees the pointers.
    const auto far = reinterpret_cast<const void*>(uintptr_t{1} << 40);
    c.all_gather(far, reinterpret_cast<void*>(uintptr_t{1} << 44), int64_t{3} << 30);
  } else if (scenario == "mismatched-all-to-all") {
    // Rank 0 sends 5 bytes to rank 1, which expects 6.
    const std::vector<int64_t> send = me == 0 ? std::vector<int64_t>{4, 5} : std::vector<int64_t>{6, 7};
    const std::vector<int64_t> recv = me == 0 ? std::vector<int64_t>{4, 6} : std::vector<int64_t>{6, 7};
    c.all_to_allv(in.data(), send, out.data(), recv);
  } else if (scenario == "split-failure") {
    // Rank 1's failure on its own one-rank split ends rank 0 too, which waits in the world.
    std::unique_ptr<Communicator> alone = c.split(me);
    if (me == 1) alone->broadcast(in.data(), 8, 3);
  } else if (scenario == "local-bad-root") {
    c.broadcast(in.data(), 8, 1);
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  c.barrier();
  return 0;
}
