// What every distributed test binary shares (communicator_checks.h, dist_optimizer_harness.h):
// the process's communicator and seed, buffers in its backend memory, and run_all, the main that
// runs every test on every rank and fails on every rank if any rank failed.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/device_buffer.h"
#include "dist/communicator.h"

namespace packmoe::dist_test {

inline Communicator* g_comm = nullptr;
inline uint64_t g_seed = 0;  // rank 0's, broadcast; PACKMOE_TEST_SEED replays it

inline Communicator& comm() { return *g_comm; }

// ---- buffers in the communicator's backend memory ------------------------------------------------

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(comm().backend(), host.size() * sizeof(T));
  b.upload({reinterpret_cast<const uint8_t*>(host.data()), host.size() * sizeof(T)});
  return b;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& b) {
  const std::vector<uint8_t> bytes = b.download();
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

template <typename T>
T* ptr(const DeviceBuffer& b) {
  return static_cast<T*>(b.get());
}

// ---- main ------------------------------------------------------------------------------------------

// Prints this rank's failures with its rank; rank 0 keeps gtest's full output.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", comm().rank(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
};

// Builds the communicator for `device` from the environment, agrees on a seed, runs every test on
// every rank, and fails on every rank if any rank failed.
inline int run_all(int argc, char** argv, Device device) {
  ::testing::InitGoogleTest(&argc, argv);
  Result<std::unique_ptr<Communicator>> made = make_communicator(device);
  if (!made) {
    std::fprintf(stderr, "communicator: %s\n", made.status().message().c_str());
    return 1;
  }
  std::unique_ptr<Communicator> owned = std::move(made).value();
  g_comm = owned.get();
  if (comm().rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter);
  }
  uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
  if (const char* s = std::getenv("PACKMOE_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  DeviceBuffer seed_buf = upload(std::vector<uint64_t>{seed});
  comm().broadcast(seed_buf.get(), 8, 0);
  g_seed = download<uint64_t>(seed_buf)[0];
  if (comm().rank() == 0)
    std::printf("[dist] %d rank(s) over %s, seed %llu (replay: PACKMOE_TEST_SEED=%llu)\n",
                comm().size(), std::string(comm_kind_name(comm().kind())).c_str(),
                static_cast<unsigned long long>(g_seed), static_cast<unsigned long long>(g_seed));
  const int64_t mine_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  DeviceBuffer failed = upload(std::vector<int64_t>{mine_failed});
  comm().all_reduce(ptr<int64_t>(failed), ptr<int64_t>(failed), 1, ReduceOp::kSum);
  const int64_t ranks_failed = download<int64_t>(failed)[0];
  if (comm().rank() == 0 && ranks_failed > 0)
    std::printf("[dist] FAILED on %lld of %d rank(s), seed %llu\n",
                static_cast<long long>(ranks_failed), comm().size(),
                static_cast<unsigned long long>(g_seed));
  return ranks_failed == 0 ? 0 : 1;
}

}  // namespace packmoe::dist_test
