// The fuzz targets (tests/fuzz/fuzz_targets.h) on a deterministic corpus: each target's seed
// inputs, every truncation of them, and a fixed-seed stream of mutations (bit flips, hostile
// bytes, insertions, deletions, duplicated ranges, deep nesting, out-of-range numbers). A target
// must return on every input; a crash, abort or hang fails the test. Small enough for CI (each
// target stops at its mutation count or its time budget, whichever comes first); the libFuzzer
// build (-DPACKMOE_FUZZ=ON) runs the same targets for as long as one likes.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "fuzz/fuzz_targets.h"

namespace packmoe::fuzz {
namespace {

// One mutation of `b`, chosen by `rng`.
Bytes mutate(Bytes b, std::mt19937_64& rng) {
  static const std::vector<std::string> kTokens = {
      "[", "{", "]", "}", "\"", "\\", ":", ",", "-1", "0", "1e999", "18446744073709551616",
      "9223372036854775807", "-9223372036854775808", "null", "true", "\xEF\xBB\xBF",
      std::string(1, '\0'), "\\u0000", "\x1b[31m", std::string(200, '['), "\"\\ud800\""};
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const size_t at = pick(b.size() + 1);
  switch (rng() % 6) {
    case 0:  // flip a bit
      if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
      break;
    case 1: {  // set a byte to a boundary value
      static const uint8_t kValues[] = {0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF, '9', '['};
      if (!b.empty()) b[pick(b.size())] = kValues[rng() % sizeof kValues];
      break;
    }
    case 2: {  // insert a hostile token
      const std::string& t = kTokens[pick(kTokens.size())];
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), t.begin(), t.end());
      break;
    }
    case 3: {  // delete a range
      const size_t n = std::min(b.size() - std::min(at, b.size()), pick(16) + 1);
      if (at < b.size()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(at),
                                 b.begin() + static_cast<std::ptrdiff_t>(at + n));
      break;
    }
    case 4: {  // duplicate a range
      if (b.empty()) break;
      const size_t from = pick(b.size()), n = std::min(b.size() - from, pick(64) + 1);
      const Bytes piece(b.begin() + static_cast<std::ptrdiff_t>(from),
                        b.begin() + static_cast<std::ptrdiff_t>(from + n));
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), piece.begin(), piece.end());
      break;
    }
    default:  // overwrite a little-endian 64-bit word (header lengths, counts, sizes)
      if (b.size() >= 8) {
        const size_t w = pick(b.size() - 7);
        const uint64_t v = rng() % 2 ? rng() : (uint64_t{1} << (rng() % 64));
        for (int i = 0; i < 8; ++i) b[w + i] = static_cast<uint8_t>(v >> (8 * i));
      }
      break;
  }
  return b;
}

void run_corpus(const Target& t, int mutations, double budget_s) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::mt19937_64 rng(20261201);
  const std::vector<Bytes> seeds = t.seeds();
  ASSERT_FALSE(seeds.empty());
  int64_t runs = 0;
  for (const Bytes& s : seeds) {
    t.run(s.data(), s.size());
    for (size_t n = 0; n < s.size(); n += 1 + s.size() / 64, ++runs)  // truncations
      t.run(s.data(), n);
  }
  const Bytes deep = bytes_of(std::string(100000, '[') + std::string(100000, ']'));
  t.run(deep.data(), deep.size());
  int done = 0;
  for (; done < mutations && elapsed() < budget_s; ++done) {
    Bytes b = seeds[static_cast<size_t>(rng() % seeds.size())];
    for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) b = mutate(std::move(b), rng);
    t.run(b.data(), b.size());
  }
  std::printf("%s: %lld truncations, %d mutations in %.1f s\n", t.name,
              static_cast<long long>(runs), done, elapsed());
  EXPECT_GT(done, 0);
}

TEST(FuzzCorpus, EveryParserReturnsOnEveryInput) {
  for (const Target& t : targets()) {
    SCOPED_TRACE(t.name);
    const std::string name = t.name;
    const bool slow = name == "trainer_state" || name == "complete_json";  // a checkpoint each
    run_corpus(t, slow ? 300 : 3000, 6.0);
  }
}

}  // namespace
}  // namespace packmoe::fuzz
