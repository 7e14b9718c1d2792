// The init ops (backend/ops/init.h) on the CPU: (a) values against an independent re-derivation:
// Philox4x32-10 written here from its published definition (Salmon et al., SC'11: the two
// multipliers, the Weyl key bumps, 10 rounds, counter {lo(offset), hi(offset), stream, 0}, key
// {lo(seed), hi(seed)}) and Box-Muller in FP64 (bitwise) and in long double (within one FP32 ulp,
// which checks the formula, not only the code path); (b) the bytes do not depend on the OpenMP
// thread count; (c) random_model_weights draws parameter p from stream p, every element, and the
// norms are 1; (d) argument errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/ops/init.h"
#include "nn/model.h"
#include "train/model_config.h"

namespace packmoe {
namespace {

// ---- independent reference ---------------------------------------------------------------------

struct Ref4 {
  uint32_t x[4];
};

Ref4 ref_philox(uint64_t seed, uint64_t offset, uint32_t stream) {
  Ref4 c{{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32), stream, 0}};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53} * c.x[0];
    const uint64_t p1 = uint64_t{0xCD9E8D57} * c.x[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = Ref4{{hi1 ^ c.x[1] ^ k0, lo1, hi0 ^ c.x[3] ^ k1, lo0}};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Element i of the normal init in FP64, as the definition in backend/ops/init.h reads.
float ref_normal_f64(uint64_t seed, uint32_t stream, double stddev, int64_t i) {
  const Ref4 r = ref_philox(seed, static_cast<uint64_t>(i / 2), stream);
  const double u0 = (r.x[0] + 1.0) / 4294967296.0, u1 = (r.x[1] + 1.0) / 4294967296.0;
  const double radius = std::sqrt(-2.0 * std::log(u0));
  const double angle = 2.0 * M_PI * u1;
  return static_cast<float>(i % 2 == 0 ? stddev * radius * std::cos(angle)
                                       : stddev * radius * std::sin(angle));
}

// The same value in long double (64-bit significand): the exact value the FP32 result rounds.
long double ref_normal_ld(uint64_t seed, uint32_t stream, double stddev, int64_t i) {
  const Ref4 r = ref_philox(seed, static_cast<uint64_t>(i / 2), stream);
  const long double u0 = (r.x[0] + 1.0L) / 4294967296.0L, u1 = (r.x[1] + 1.0L) / 4294967296.0L;
  const long double radius = std::sqrt(-2.0L * std::log(u0));
  const long double angle = 2.0L * 3.14159265358979323846264338327950288L * u1;
  return stddev * radius * (i % 2 == 0 ? std::cos(angle) : std::sin(angle));
}

std::vector<float> init_normal_host(uint64_t seed, uint32_t stream, double stddev, int64_t n) {
  std::vector<float> out(n, -7.0f);
  InitNormalArgs a;
  a.seed = seed;
  a.stream = stream;
  a.stddev = stddev;
  a.out = out.data();
  a.n = n;
  const Status s = ops::init_normal(cpu_backend(), a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return out;
}

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// ---- tests -------------------------------------------------------------------------------------

TEST(InitOps, NormalMatchesAnIndependentDerivation) {
  std::mt19937_64 rng(20261201);
  for (int trial = 0; trial < 4; ++trial) {
    const uint64_t seed = rng();
    const uint32_t stream = static_cast<uint32_t>(rng());
    const double stddev = trial == 0 ? 1.0 : 0.02 * (1 + trial);
    const int64_t n = 4097 + 2 * trial;  // odd: the last draw gives one element
    const std::vector<float> got = init_normal_host(seed, stream, stddev, n);
    double sum = 0, sum2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(bits(got[i]), bits(ref_normal_f64(seed, stream, stddev, i)))
          << "element " << i << " of seed " << seed << " stream " << stream;
      const long double exact = ref_normal_ld(seed, stream, stddev, i);
      const float lo = std::nextafter(static_cast<float>(exact), -INFINITY);
      const float hi = std::nextafter(static_cast<float>(exact), INFINITY);
      ASSERT_TRUE(got[i] >= lo && got[i] <= hi) << "element " << i << ": " << got[i] << " vs "
                                                << static_cast<double>(exact);
      sum += got[i];
      sum2 += static_cast<double>(got[i]) * got[i];
    }
    // Moments of N(0, stddev^2) over 4K samples (5 sigma of the estimators).
    EXPECT_NEAR(sum / n / stddev, 0.0, 5.0 / std::sqrt(static_cast<double>(n)));
    EXPECT_NEAR(sum2 / n / (stddev * stddev), 1.0, 5.0 * std::sqrt(2.0 / n));
  }
}

TEST(InitOps, NormalBytesDoNotDependOnTheThreadCount) {
  const int saved = omp_get_max_threads();
  const int64_t n = 200003;
  std::vector<std::vector<float>> runs;
  for (int threads : {1, 2, 3, 7}) {
    omp_set_num_threads(threads);
    runs.push_back(init_normal_host(99, 5, 0.02, n));
  }
  omp_set_num_threads(saved);
  for (size_t r = 1; r < runs.size(); ++r)
    EXPECT_EQ(std::memcmp(runs[r].data(), runs[0].data(), n * sizeof(float)), 0) << "run " << r;
}

TEST(InitOps, ModelWeightsDrawParameterPFromStreamP) {
  const ModelConfig c = train::model_config_preset("tiny").value();
  const uint64_t seed = 4242;
  const ModelWeights w = random_model_weights(c, seed);
  const std::vector<ParamSpec> specs = model_param_specs(c);
  ASSERT_EQ(w.size(), specs.size());
  for (size_t p = 0; p < specs.size(); ++p) {
    const Tensor& t = w.at(specs[p].name);
    ASSERT_EQ(t.shape(), specs[p].shape);
    const float* v = t.data_as<const float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float want = specs[p].init == ParamInit::kOnes
                             ? 1.0f
                             : ref_normal_f64(seed, static_cast<uint32_t>(p),
                                              c.initializer_range, i);
      ASSERT_EQ(bits(v[i]), bits(want)) << specs[p].name << " element " << i;
    }
  }
}

TEST(InitOps, FillWritesTheValue) {
  std::vector<float> out(37, 0.0f);
  ASSERT_TRUE(ops::fill_f32(cpu_backend(), FillArgs{-2.5f, out.data(), 33}).is_ok());
  for (int i = 0; i < 37; ++i) EXPECT_EQ(out[i], i < 33 ? -2.5f : 0.0f) << i;
}

TEST(InitOps, BadArgumentsAreErrors) {
  float x = 0;
  InitNormalArgs a;
  a.out = &x;
  a.n = -1;
  EXPECT_FALSE(ops::init_normal(cpu_backend(), a).is_ok());
  a.n = 1;
  a.stddev = NAN;
  EXPECT_FALSE(ops::init_normal(cpu_backend(), a).is_ok());
  a.stddev = 1;
  a.out = nullptr;
  EXPECT_FALSE(ops::init_normal(cpu_backend(), a).is_ok());
  EXPECT_FALSE(ops::fill_f32(cpu_backend(), FillArgs{1.0f, nullptr, 3}).is_ok());
  EXPECT_TRUE(ops::fill_f32(cpu_backend(), FillArgs{1.0f, nullptr, 0}).is_ok());
}

}  // namespace
}  // namespace packmoe
