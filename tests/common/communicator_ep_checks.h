// The expert-parallel communicator checks shared by tests/dist/test_communicator.cpp (Local, MPI)
// and tests/dist/test_nccl_communicator.cpp (NCCL): all_to_allv and split. Every rank regenerates
// the size matrix and every rank's send bytes from (seed, tag, rank), so each rank computes the
// bytes it must receive independently of the communicator; out carries guard bytes on both sides
// so a stray or missing write shows.
#pragma once

#include "common/communicator_checks.h"

namespace packmoe::comm_checks {

// (n, n): entry p * n + q = bytes rank p sends rank q; about a third zero, the same on every rank
// for one tag. With `empty_lanes` (n > 1) rank `a` sends nothing and rank `b` receives nothing.
inline std::vector<int64_t> random_matrix(uint64_t tag, int n, int64_t max, bool empty_lanes) {
  std::mt19937_64 rng = rng_for(tag, -1);
  std::vector<int64_t> m(static_cast<size_t>(n) * n);
  for (int64_t& x : m) x = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % (max + 1));
  if (empty_lanes && n > 1) {
    const int a = static_cast<int>(tag % n), b = (a + 1) % n;
    for (int q = 0; q < n; ++q) m[a * n + q] = 0;
    for (int p = 0; p < n; ++p) m[p * n + b] = 0;
  }
  return m;
}

inline int64_t row_total(const std::vector<int64_t>& m, int n, int p) {
  return prefix(std::span<const int64_t>(m).subspan(static_cast<size_t>(p) * n, n), n);
}

// all_to_allv on `c` of matrix m; rank p of c sends random_bytes(tag, p, row total). On the side
// stream (between the fences) when `side`.
inline void check_all_to_allv(Communicator& c, uint64_t tag, const std::vector<int64_t>& m,
                              bool side = false) {
  constexpr int64_t kGuard = 16;
  const int n = c.size(), me = c.rank();
  const std::span<const int64_t> send(m.data() + static_cast<size_t>(me) * n, n);
  std::vector<int64_t> recv(n);
  for (int p = 0; p < n; ++p) recv[p] = m[static_cast<size_t>(p) * n + me];
  const int64_t recv_total = prefix(recv, n);

  std::vector<uint8_t> expected(kGuard, 0xA5);
  for (int p = 0; p < n; ++p) {
    const std::vector<uint8_t> theirs = random_bytes(tag, p, row_total(m, n, p));
    const int64_t at = prefix(std::span<const int64_t>(m).subspan(static_cast<size_t>(p) * n, n), me);
    expected.insert(expected.end(), theirs.begin() + at, theirs.begin() + at + recv[p]);
  }
  expected.resize(expected.size() + kGuard, 0xA5);

  const std::vector<uint8_t> mine = random_bytes(tag, me, row_total(m, n, me));
  DeviceBuffer in(c.backend(), mine.size());
  in.upload(mine);
  DeviceBuffer out(c.backend(), static_cast<size_t>(recv_total + 2 * kGuard));
  out.upload(std::vector<uint8_t>(out.size(), 0xA5));
  if (side) c.side_waits_for_backend();
  c.all_to_allv(in.get(), send, static_cast<uint8_t*>(out.get()) + kGuard, recv,
                side ? c.side_stream() : kBackendStream);
  if (side) c.backend_waits_for_side();
  EXPECT_EQ(out.download(), expected) << "rank " << me << "/" << n << ", sizes (row = sender) "
                                      << ::testing::PrintToString(m) << (side ? " on the side stream" : "");
}

TEST(Communicator, AllToAllvUnevenAndEmpty) {
  SCOPED_TRACE(ctx());
  const int n = comm().size();
  uint64_t tag = 1100;
  for (int trial = 0; trial < 8; ++trial, ++tag)
    check_all_to_allv(comm(), tag, random_matrix(tag, n, 40000, trial % 2 == 1));
  check_all_to_allv(comm(), tag++, std::vector<int64_t>(n * n, 0));     // nothing anywhere
  check_all_to_allv(comm(), tag++, std::vector<int64_t>(n * n, 4099));  // even, the EP shape
  std::vector<int64_t> self(n * n, 0), one(n * n, 0);
  for (int r = 0; r < n; ++r) self[r * n + r] = 1000 + 7 * r;  // each rank only to itself
  check_all_to_allv(comm(), tag++, self);
  one[(n - 1) * n] = (1 << 20) + 3;  // only the last rank sends, only to rank 0
  check_all_to_allv(comm(), tag++, one);
  check_all_to_allv(comm(), tag, random_matrix(tag, n, 20000, true), /*side=*/true);
}

// The parent ranks of `color` under color_of, in parent rank order: the split's ranks.
template <typename ColorOf>
std::vector<int> members_of(int color, int n, ColorOf color_of) {
  std::vector<int> members;
  for (int r = 0; r < n; ++r) {
    if (color_of(r) == color) members.push_back(r);
  }
  return members;
}

// A split `part` of comm() with parent ranks `members`: shape, then an F64 and an I64 all-reduce
// (inputs named by parent rank) and an all_to_allv, each against the expected values.
inline void check_split(Communicator& part, const std::vector<int>& members, uint64_t tag) {
  const int me = comm().rank();
  ASSERT_EQ(part.size(), static_cast<int>(members.size()));
  ASSERT_EQ(members[part.rank()], me) << "the split keeps the parent's rank order";
  EXPECT_EQ(part.kind(), comm().kind());
  EXPECT_EQ(&part.backend(), &comm().backend());
  EXPECT_EQ(part.options().verify_calls, comm().options().verify_calls);
  EXPECT_EQ(part.options().timeout_s, comm().options().timeout_s);

  const int64_t count = 3001;
  std::vector<std::vector<double>> inputs;
  for (int r : members) inputs.push_back(random_values<double>(tag, r, count));
  DeviceBuffer values = upload(random_values<double>(tag, me, count));
  part.all_reduce(ptr<double>(values), ptr<double>(values), count, ReduceOp::kSum);
  std::string first;
  EXPECT_EQ(sum_mismatches(download<double>(values), inputs, 0,
                           part.rank_ordered() || part.size() <= 2, &first), 0)
      << first;

  DeviceBuffer rank_sum = upload(std::vector<int64_t>{me});
  part.all_reduce(ptr<int64_t>(rank_sum), ptr<int64_t>(rank_sum), 1, ReduceOp::kSum);
  int64_t expected = 0;
  for (int r : members) expected += r;
  EXPECT_EQ(download<int64_t>(rank_sum)[0], expected);

  // Tags differ per group (its lowest parent rank), so the groups move different bytes.
  const uint64_t a2a_tag = tag + 1 + 7919 * static_cast<uint64_t>(members[0]);
  check_all_to_allv(part, a2a_tag, random_matrix(a2a_tag, part.size(), 30000, true));
}

// Two colors by parity; the split is destroyed before its parent (comm()), which still works.
TEST(Communicator, SplitByParity) {
  SCOPED_TRACE(ctx());
  const int n = comm().size(), me = comm().rank();
  auto parity = [](int r) { return r % 2; };
  {
    std::unique_ptr<Communicator> part = comm().split(parity(me));
    check_split(*part, members_of(parity(me), n, parity), 1200);
  }
  check_all_to_allv(comm(), 1210, random_matrix(1210, n, 10000, false));
}

// Splits of a split outlive it: the middle one is destroyed first and its children still work.
// Colors need not be dense (3r + 1: every rank alone).
TEST(Communicator, SplitsOutliveTheirParent) {
  SCOPED_TRACE(ctx());
  const int n = comm().size(), me = comm().rank();
  auto everyone = [](int) { return 0; };
  auto halves = [n](int r) { return r < (n + 1) / 2 ? 0 : 1; };
  auto alone = [](int r) { return 3 * r + 1; };
  std::unique_ptr<Communicator> whole = comm().split(everyone(me));
  check_split(*whole, members_of(0, n, everyone), 1300);
  std::unique_ptr<Communicator> half = whole->split(halves(me));
  std::unique_ptr<Communicator> single = whole->split(alone(me));
  whole.reset();
  check_split(*half, members_of(halves(me), n, halves), 1310);
  check_split(*single, members_of(alone(me), n, alone), 1320);
  half.reset();
  check_split(*single, members_of(alone(me), n, alone), 1330);
}

}  // namespace packmoe::comm_checks
