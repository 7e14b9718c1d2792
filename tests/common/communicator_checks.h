// The communicator checks shared by tests/dist/test_communicator.cpp (Local and MPI, host memory)
// and tests/dist/test_nccl_communicator.cpp (NCCL, device memory). Every rank regenerates every
// rank's input from (seed, case, rank), so each result is compared with an expected value computed
// independently on each rank; the seed comes from rank 0 (PACKMOE_TEST_SEED to replay it).
// Sums are compared bitwise with the left-to-right rank-ordered sum wherever that is promised.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "backend/device_buffer.h"
#include "common/dist_main.h"
#include "dist/communicator.h"

namespace packmoe::comm_checks {

using dist_test::comm;
using dist_test::download;
using dist_test::g_seed;
using dist_test::ptr;
using dist_test::run_all;
using dist_test::upload;

// ---- inputs every rank can regenerate -------------------------------------------------------------

inline std::mt19937_64 rng_for(uint64_t tag, int rank) {
  std::seed_seq seq{static_cast<uint32_t>(g_seed), static_cast<uint32_t>(g_seed >> 32),
                    static_cast<uint32_t>(tag), static_cast<uint32_t>(tag >> 32),
                    static_cast<uint32_t>(rank)};
  return std::mt19937_64(seq);
}

// Signs and exponents in [-20, 20]: sums of such values depend on the order of the additions.
template <typename T>
std::vector<T> random_values(uint64_t tag, int rank, int64_t n) {
  std::mt19937_64 rng = rng_for(tag, rank);
  std::vector<T> v(n);
  if constexpr (std::is_integral_v<T>) {
    std::uniform_int_distribution<int64_t> d(-(int64_t{1} << 40), int64_t{1} << 40);
    for (T& x : v) x = d(rng);
  } else {
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> expo(-20, 20);
    for (T& x : v) x = static_cast<T>((rng() & 1 ? -1.0 : 1.0) * std::ldexp(mant(rng), expo(rng)));
  }
  return v;
}

inline std::vector<uint8_t> random_bytes(uint64_t tag, int rank, int64_t n) {
  std::mt19937_64 rng = rng_for(tag, rank);
  std::vector<uint8_t> v(n);
  for (uint8_t& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

// Per-rank sizes in [0, max], about a third of them zero; the same on every rank for one tag.
inline std::vector<int64_t> random_sizes(uint64_t tag, int64_t max) {
  std::mt19937_64 rng = rng_for(tag, -1);
  std::vector<int64_t> s(comm().size());
  for (int64_t& x : s) x = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % (max + 1));
  return s;
}

inline int64_t prefix(std::span<const int64_t> sizes, int r) {
  int64_t o = 0;
  for (int i = 0; i < r; ++i) o += sizes[i];
  return o;
}

template <typename T>
std::vector<std::vector<T>> inputs_of_all_ranks(uint64_t tag, int64_t n) {
  std::vector<std::vector<T>> in(comm().size());
  for (int r = 0; r < comm().size(); ++r) in[r] = random_values<T>(tag, r, n);
  return in;
}

// ---- expected values ------------------------------------------------------------------------------

// Mismatches of got[i] against the sum over ranks of in[r][offset + i]: bitwise with the
// left-to-right rank-ordered sum when `ordered`, else within (N-1)u * sum|x| of the exact sum.
template <typename T>
int64_t sum_mismatches(const std::vector<T>& got, const std::vector<std::vector<T>>& in,
                       int64_t offset, bool ordered, std::string* first) {
  int64_t bad = 0;
  const int n = static_cast<int>(in.size());
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    T expected = in[0][offset + i];
    for (int r = 1; r < n; ++r) expected += in[r][offset + i];
    if constexpr (std::is_integral_v<T>) {
      ok = got[i] == expected;
    } else if (ordered) {
      ok = std::memcmp(&got[i], &expected, sizeof(T)) == 0;
    } else {
      long double exact = 0, magnitude = 0;
      for (int r = 0; r < n; ++r) {
        exact += in[r][offset + i];
        magnitude += std::fabs(static_cast<long double>(in[r][offset + i]));
      }
      const long double u = std::numeric_limits<T>::epsilon() / 2.0L;
      ok = std::fabs(static_cast<long double>(got[i]) - exact) <= 1.01L * (n - 1) * u * magnitude;
    }
    if (!ok && bad++ == 0 && first) {
      std::ostringstream os;
      os << std::setprecision(std::numeric_limits<T>::max_digits10) << "element " << i << ": got "
         << got[i] << ", rank-ordered sum " << expected;
      *first = os.str();
    }
  }
  return bad;
}

// Exact maximum; Local/MPI also define NaN (the lowest rank's) and +0/-0 (the lower rank's).
template <typename T>
T rank_ordered_max(const std::vector<std::vector<T>>& in, size_t i) {
  T m = in[0][i];
  for (size_t r = 1; r < in.size(); ++r) {
    const T x = in[r][i];
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(m)) continue;
      if (std::isnan(x)) {
        m = x;
        continue;
      }
    }
    if (x > m) m = x;
  }
  return m;
}

// Sums are bitwise rank-ordered on Local/MPI; with two ranks any order is one rounding of a + b.
inline bool sums_bitwise() { return comm().rank_ordered() || comm().size() <= 2; }

inline std::string ctx() {
  return "rank " + std::to_string(comm().rank()) + "/" + std::to_string(comm().size()) + " " +
         std::string(comm_kind_name(comm().kind())) + ", seed " + std::to_string(g_seed) +
         " (PACKMOE_TEST_SEED)";
}

// ---- the checks ----------------------------------------------------------------------------------

TEST(Communicator, RanksAreDistinctAndComplete) {
  SCOPED_TRACE(ctx());
  const int n = comm().size();
  if (const char* s = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_EQ(n, std::atoi(s));
    EXPECT_EQ(comm().rank(), std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  } else {
    EXPECT_EQ(n, 1);
  }
  const std::vector<int64_t> mine{comm().rank(), 1000 + comm().rank()};
  DeviceBuffer in = upload(mine);
  DeviceBuffer out(comm().backend(), 16 * n);
  comm().all_gather(in.get(), out.get(), 16);
  const std::vector<int64_t> all = download<int64_t>(out);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(all[2 * r], r);
    EXPECT_EQ(all[2 * r + 1], 1000 + r);
  }
}

TEST(Communicator, BroadcastFromEveryRoot) {
  SCOPED_TRACE(ctx());
  uint64_t tag = 100;
  for (int64_t bytes : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{(1 << 20) + 5}}) {
    for (int root = 0; root < comm().size(); ++root, ++tag) {
      DeviceBuffer buf = upload(random_bytes(tag, comm().rank(), bytes));  // each rank its own
      comm().broadcast(buf.get(), bytes, root);
      EXPECT_EQ(buf.download(), random_bytes(tag, root, bytes)) << bytes << " bytes from " << root;
    }
  }
}

// out prefilled with a sentinel so a stray or missing write shows; in place when asked.
inline void check_all_gatherv(uint64_t tag, const std::vector<int64_t>& sizes, bool in_place) {
  const int n = comm().size(), me = comm().rank();
  const int64_t total = prefix(sizes, n), offset = prefix(sizes, me);
  std::vector<uint8_t> expected;
  for (int r = 0; r < n; ++r) {
    const std::vector<uint8_t> part = random_bytes(tag, r, sizes[r]);
    expected.insert(expected.end(), part.begin(), part.end());
  }
  const std::vector<uint8_t> mine = random_bytes(tag, me, sizes[me]);
  std::vector<uint8_t> start(total, 0xA5);
  if (in_place) std::copy(mine.begin(), mine.end(), start.begin() + offset);
  DeviceBuffer out = upload(start);
  DeviceBuffer in = upload(mine);
  const void* src = in_place ? ptr<uint8_t>(out) + offset : in.get();
  const bool even = std::equal(sizes.begin() + 1, sizes.end(), sizes.begin());
  if (even && tag % 2 == 0)
    comm().all_gather(src, out.get(), sizes[0]);
  else
    comm().all_gatherv(src, out.get(), sizes);
  EXPECT_EQ(out.download(), expected) << "sizes " << ::testing::PrintToString(sizes)
                                      << (in_place ? " in place" : "");
}

TEST(Communicator, AllGatherEven) {
  SCOPED_TRACE(ctx());
  uint64_t tag = 200;
  for (int64_t bytes : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{65536 + 3}}) {
    for (bool in_place : {false, true}) {
      check_all_gatherv(tag, std::vector<int64_t>(comm().size(), bytes), in_place);
      check_all_gatherv(tag + 1, std::vector<int64_t>(comm().size(), bytes), in_place);
      tag += 2;
    }
  }
}

TEST(Communicator, AllGathervUnevenAndEmpty) {
  SCOPED_TRACE(ctx());
  const int n = comm().size();
  uint64_t tag = 300;
  for (int trial = 0; trial < 6; ++trial) {
    for (bool in_place : {false, true}) {
      check_all_gatherv(tag, random_sizes(tag, 40000), in_place);
      ++tag;
    }
  }
  std::vector<int64_t> one(n, 0);
  one[n - 1] = 4099;  // only the last rank contributes
  check_all_gatherv(tag++, one, false);
  check_all_gatherv(tag++, std::vector<int64_t>(n, 0), true);
  std::vector<int64_t> ramp(n);
  for (int r = 0; r < n; ++r) ramp[r] = 31 * r;  // rank 0 empty
  check_all_gatherv(tag++, ramp, true);
}

inline void check_reduce_scatterv(uint64_t tag, const std::vector<int64_t>& counts, bool in_place) {
  const int me = comm().rank();
  const int64_t total = prefix(counts, comm().size()), offset = prefix(counts, me);
  const std::vector<std::vector<float>> all = inputs_of_all_ranks<float>(tag, total);
  DeviceBuffer in = upload(all[me]);
  DeviceBuffer out(comm().backend(), counts[me] * 4);
  float* dst = in_place ? ptr<float>(in) + offset : ptr<float>(out);
  const bool even = std::equal(counts.begin() + 1, counts.end(), counts.begin());
  if (even && tag % 2 == 0)
    comm().reduce_scatter(ptr<float>(in), dst, counts[0]);
  else
    comm().reduce_scatterv(ptr<float>(in), dst, counts);
  std::vector<float> got = download<float>(in_place ? in : out);
  if (in_place) got = std::vector<float>(got.begin() + offset, got.begin() + offset + counts[me]);
  std::string first;
  EXPECT_EQ(sum_mismatches(got, all, offset, sums_bitwise(), &first), 0)
      << "counts " << ::testing::PrintToString(counts) << (in_place ? " in place: " : ": ") << first;
}

TEST(Communicator, ReduceScatterIsTheRankOrderedSum) {
  SCOPED_TRACE(ctx());
  uint64_t tag = 400;
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4097}, int64_t{1 << 16}}) {
    for (bool in_place : {false, true}) {
      check_reduce_scatterv(tag, std::vector<int64_t>(comm().size(), count), in_place);
      check_reduce_scatterv(tag + 1, std::vector<int64_t>(comm().size(), count), in_place);
      tag += 2;
    }
  }
}

TEST(Communicator, ReduceScattervUnevenAndEmpty) {
  SCOPED_TRACE(ctx());
  const int n = comm().size();
  uint64_t tag = 500;
  for (int trial = 0; trial < 6; ++trial) {
    for (bool in_place : {false, true}) {
      check_reduce_scatterv(tag, random_sizes(tag, 20000), in_place);
      ++tag;
    }
  }
  std::vector<int64_t> one(n, 0);
  one[0] = 777;  // only rank 0 owns elements
  check_reduce_scatterv(tag++, one, true);
  check_reduce_scatterv(tag++, std::vector<int64_t>(n, 0), false);
}

template <typename T>
void check_all_reduce(uint64_t tag, int64_t count, ReduceOp op, bool in_place) {
  const int me = comm().rank();
  const std::vector<std::vector<T>> all = inputs_of_all_ranks<T>(tag, count);
  DeviceBuffer in = upload(all[me]);
  DeviceBuffer out(comm().backend(), count * sizeof(T));
  T* dst = in_place ? ptr<T>(in) : ptr<T>(out);
  comm().all_reduce(ptr<T>(in), dst, count, op);
  const std::vector<T> got = download<T>(in_place ? in : out);
  std::string first;
  if (op == ReduceOp::kSum) {
    EXPECT_EQ(sum_mismatches(got, all, 0, sums_bitwise(), &first), 0)
        << count << " elements" << (in_place ? " in place: " : ": ") << first;
  } else {
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      const T e = rank_ordered_max(all, i);
      bad += std::memcmp(&got[i], &e, sizeof(T)) != 0;
    }
    EXPECT_EQ(bad, 0) << "max over " << count << " elements";
  }
}

template <typename T>
void check_all_reduce_cases(uint64_t tag) {
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{comm().size() - 1}, int64_t{1000},
                        int64_t{100003}}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (bool in_place : {false, true}) check_all_reduce<T>(tag++, count, op, in_place);
    }
  }
}

TEST(Communicator, AllReduceF32IsTheRankOrderedSum) {
  SCOPED_TRACE(ctx());
  check_all_reduce_cases<float>(600);
}

TEST(Communicator, AllReduceF64IsTheRankOrderedSumBitwise) {
  SCOPED_TRACE(ctx());
  check_all_reduce_cases<double>(700);
}

TEST(Communicator, AllReduceI64IsExact) {
  SCOPED_TRACE(ctx());
  check_all_reduce_cases<int64_t>(800);
}

// The grad-norm shape: one F64 scalar per rank.
TEST(Communicator, AllReduceOneScalar) {
  SCOPED_TRACE(ctx());
  double mine = 0.1 * (comm().rank() + 1) + 1e-17 * comm().rank();
  DeviceBuffer b = upload(std::vector<double>{mine});
  comm().all_reduce(ptr<double>(b), ptr<double>(b), 1, ReduceOp::kSum);
  double expected = 0.1;
  for (int r = 1; r < comm().size(); ++r) expected += 0.1 * (r + 1) + 1e-17 * r;
  const double got = download<double>(b)[0];
  if (sums_bitwise())
    EXPECT_EQ(std::memcmp(&got, &expected, 8), 0) << got << " vs " << expected;
  else
    EXPECT_NEAR(got, expected, 1e-15);
}

// Local/MPI define max over NaN and signed zeros; NCCL leaves them to NCCL.
TEST(Communicator, MaxOfNaNAndSignedZeros) {
  SCOPED_TRACE(ctx());
  if (!comm().rank_ordered()) GTEST_SKIP() << "NaN and signed-zero max are NCCL's own";
  const int n = comm().size(), me = comm().rank();
  auto value = [](int r, int i) -> float {
    switch (i) {
      case 0: return r % 2 ? -0.0f : 0.0f;  // first rank's zero wins
      case 1: return r == 1 ? std::numeric_limits<float>::quiet_NaN() : float(r);
      case 2: {
        uint32_t bits = 0x7fc00000u | static_cast<uint32_t>(r + 1);  // payload names the rank
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      }
      default: return -1e30f * (r + 1);
    }
  };
  std::vector<float> mine(4);
  std::vector<std::vector<float>> all(n, std::vector<float>(4));
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < 4; ++i) all[r][i] = value(r, i);
  }
  for (int i = 0; i < 4; ++i) mine[i] = value(me, i);
  DeviceBuffer b = upload(mine);
  comm().all_reduce(ptr<float>(b), ptr<float>(b), 4, ReduceOp::kMax);
  const std::vector<float> got = download<float>(b);
  for (int i = 0; i < 4; ++i) {
    const float e = rank_ordered_max(all, i);
    EXPECT_EQ(std::memcmp(&got[i], &e, 4), 0) << "element " << i << ": " << got[i] << " vs " << e;
  }
  EXPECT_TRUE(std::signbit(got[0]) == false);
  if (n > 1) {
    EXPECT_TRUE(std::isnan(got[1]));
  }
}

// The inputs make the order of additions visible, so the bitwise checks above are strict: with 3
// or more ranks, right-to-left differs from left-to-right in many elements.
TEST(Communicator, InputsMakeTheSummationOrderVisible) {
  SCOPED_TRACE(ctx());
  const int n = comm().size();
  if (n < 3) GTEST_SKIP() << "with two ranks a + b == b + a";
  const std::vector<std::vector<float>> all = inputs_of_all_ranks<float>(900, 10000);
  int64_t differ = 0;
  for (size_t i = 0; i < 10000; ++i) {
    float forward = all[0][i], backward = all[n - 1][i];
    for (int r = 1; r < n; ++r) forward += all[r][i];
    for (int r = n - 2; r >= 0; --r) backward += all[r][i];
    differ += forward != backward;
  }
  EXPECT_GT(differ, 100);
}

// The same call on the same inputs gives the same bits (NCCL: for a fixed N and topology).
TEST(Communicator, RepeatedReductionsAreBitwiseEqual) {
  SCOPED_TRACE(ctx());
  const std::vector<int64_t> counts = random_sizes(1000, 30000);
  const int64_t total = prefix(counts, comm().size());
  const std::vector<float> mine = random_values<float>(1001, comm().rank(), total);
  DeviceBuffer in = upload(mine);
  DeviceBuffer a(comm().backend(), counts[comm().rank()] * 4), b(comm().backend(), counts[comm().rank()] * 4);
  comm().reduce_scatterv(ptr<float>(in), ptr<float>(a), counts);
  comm().reduce_scatterv(ptr<float>(in), ptr<float>(b), counts);
  EXPECT_EQ(a.download(), b.download());
  DeviceBuffer c = upload(mine), d = upload(mine);
  comm().all_reduce(ptr<float>(c), ptr<float>(c), total, ReduceOp::kSum);
  comm().all_reduce(ptr<float>(d), ptr<float>(d), total, ReduceOp::kSum);
  EXPECT_EQ(c.download(), d.download());
}

// No rank leaves the barrier before the last one entered it. The ranks share one host, so the
// steady clock (CLOCK_MONOTONIC) is common to them.
TEST(Communicator, BarrierWaitsForTheLastRank) {
  SCOPED_TRACE(ctx());
  using Clock = std::chrono::steady_clock;
  std::this_thread::sleep_for(std::chrono::milliseconds(40 * comm().rank()));
  const int64_t entered = Clock::now().time_since_epoch().count();
  comm().barrier();
  const int64_t left = Clock::now().time_since_epoch().count();
  DeviceBuffer in = upload(std::vector<int64_t>{entered, left});
  DeviceBuffer out(comm().backend(), 16 * comm().size());
  comm().all_gather(in.get(), out.get(), 16);
  const std::vector<int64_t> t = download<int64_t>(out);
  int64_t last_entered = 0, first_left = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < comm().size(); ++r) {
    last_entered = std::max(last_entered, t[2 * r]);
    first_left = std::min(first_left, t[2 * r + 1]);
  }
  EXPECT_GE(first_left, last_entered);
}

}  // namespace packmoe::comm_checks
