// Causal GQA attention core (backend/ops/model.h), forward and backward, on the presets' shapes:
// one line per shape with the median ms of each and the nominal TFLOP/s. FLOPs count the causal
// pairs only: forward 4 D per pair (Q K^T and P V), backward 10 D per pair (Q K^T recomputed,
// dO V^T, P^T dO, dS^T Q, dS K), the FlashAttention convention. The exact non-FMA FP32 kernels do
// more (pass 1 recomputes Q K^T: 6 D forward, 14 D backward). --check compares the bytes of every
// output with the CPU reference on the shapes cheap enough for it. Uses the Backend interface.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "backend/ops/model.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

struct Options {
  int iters = 10;
  int warmup = 2;
  bool check = false;
  double check_limit = 1.5e9;  // pairs * D above which --check skips a shape (CPU time)
  std::string only;            // run only shapes whose name contains this
};

struct Shape {
  const char* name;
  int64_t B, S, Hq, Hkv, D;
};

// tiny, small and the Qwen3-30B-A3B layer (plus the shape of the first measurements).
const Shape kShapes[] = {
    {"tiny", 8, 64, 4, 2, 16},
    {"tiny", 8, 256, 4, 2, 16},
    {"small", 8, 512, 8, 2, 64},
    {"small", 16, 512, 8, 2, 64},
    {"ref", 1, 2048, 16, 4, 128},
    {"qwen3_30b_a3b", 1, 2048, 32, 4, 128},
    {"qwen3_30b_a3b", 1, 4096, 32, 4, 128},
};

// Uniform values in [-a, a) from a counter hash (reproducible, no zeros in practice).
std::vector<float> random_floats(int64_t n, uint64_t seed, float a) {
  std::vector<float> h(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    h[i] = (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
  }
  return h;
}

void check_ok(const Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "bench_attention: %s\n", s.message().c_str());
    std::exit(1);
  }
}

DeviceBuffer upload(Backend& be, const std::vector<float>& h) {
  DeviceBuffer d(be, h.size() * sizeof(float));
  be.copy(d.get(), h.data(), d.size(), Backend::CopyKind::kHostToDevice);
  return d;
}

// Differing bytes between a device buffer and host floats.
size_t mismatches(Backend& be, const DeviceBuffer& d, const std::vector<float>& h) {
  std::vector<uint8_t> got = d.download();
  const auto* want = reinterpret_cast<const uint8_t*>(h.data());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
  return bad;
}

float* f(const DeviceBuffer& b) { return static_cast<float*>(b.get()); }

void run_shape(Backend& be, const Shape& s, const Options& o) {
  const int64_t nq = s.B * s.S * s.Hq * s.D, nkv = s.B * s.S * s.Hkv * s.D;
  const int64_t rows = s.B * s.Hq * s.S;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  const std::vector<float> hq = random_floats(nq, 1, 1.5f), hk = random_floats(nkv, 2, 1.5f),
                           hv = random_floats(nkv, 3, 1.0f), hdo = random_floats(nq, 4, 1.0f);
  DeviceBuffer q = upload(be, hq), k = upload(be, hk), v = upload(be, hv), dout = upload(be, hdo);
  DeviceBuffer o_(be, nq * 4), rmax(be, rows * 4), rsum(be, rows * 4);
  DeviceBuffer dq(be, nq * 4), dk(be, nkv * 4), dv(be, nkv * 4);
  // Poison: a NaN pattern, so an element never written shows up in --check.
  for (const DeviceBuffer* b : {&o_, &rmax, &rsum, &dq, &dk, &dv}) {
    std::vector<uint8_t> p(b->size(), 0xFF);
    be.copy(b->get(), p.data(), p.size(), Backend::CopyKind::kHostToDevice);
  }
  const AttentionArgs fa{s.B,  s.S,  s.Hq, s.Hkv, s.D,     scale,
                         f(q), f(k), f(v), f(o_), f(rmax), f(rsum)};
  const AttentionBackwardArgs ba{s.B,  s.S,   s.Hq,    s.Hkv,   s.D,     scale, f(q),  f(k),
                                 f(v), f(o_), f(rmax), f(rsum), f(dout), f(dq), f(dk), f(dv)};
  check_ok(ops::attention(be, fa));
  check_ok(ops::attention_backward(be, ba));
  be.synchronize();

  std::string verdict = "-";
  const double pairs = static_cast<double>(s.B * s.Hq) * static_cast<double>(s.S) *
                       static_cast<double>(s.S + 1) / 2.0;
  if (o.check) {
    if (pairs * static_cast<double>(s.D) > o.check_limit) {
      verdict = "skipped";
    } else {
      std::vector<float> co(nq), cm(rows), cs(rows), cdq(nq), cdk(nkv), cdv(nkv);
      check_ok(attention_cpu({s.B, s.S, s.Hq, s.Hkv, s.D, scale, hq.data(), hk.data(), hv.data(),
                              co.data(), cm.data(), cs.data()}));
      check_ok(attention_backward_cpu({s.B, s.S, s.Hq, s.Hkv, s.D, scale, hq.data(), hk.data(),
                                       hv.data(), co.data(), cm.data(), cs.data(), hdo.data(),
                                       cdq.data(), cdk.data(), cdv.data()}));
      const size_t bad_f =
          mismatches(be, o_, co) + mismatches(be, rmax, cm) + mismatches(be, rsum, cs);
      const size_t bad_b =
          mismatches(be, dq, cdq) + mismatches(be, dk, cdk) + mismatches(be, dv, cdv);
      verdict = "fwd " + std::to_string(bad_f) + " bwd " + std::to_string(bad_b) + " bytes differ";
    }
  }

  const double fwd_ms = be.time_ms([&] { check_ok(ops::attention(be, fa)); }, o.warmup, o.iters);
  const double bwd_ms = be.time_ms([&] { check_ok(ops::attention_backward(be, ba)); }, o.warmup, o.iters);
  const double d = static_cast<double>(s.D);
  char shape[96];
  std::snprintf(shape, sizeof shape, "%s B%lld S%lld Hq%lld Hkv%lld D%lld", s.name,
                static_cast<long long>(s.B), static_cast<long long>(s.S),
                static_cast<long long>(s.Hq), static_cast<long long>(s.Hkv),
                static_cast<long long>(s.D));
  std::printf("%-40s %9.3f %9.3f %8.2f %8.2f  %s\n", shape, fwd_ms, bwd_ms,
              4.0 * d * pairs / (fwd_ms * 1e-3) / 1e12, 10.0 * d * pairs / (bwd_ms * 1e-3) / 1e12,
              verdict.c_str());
  std::fflush(stdout);
}

int run(const Options& o) {
  Result<Backend*> r = get_backend(Device::kCUDA);
  if (!r.is_ok()) {
    std::fprintf(stderr, "bench_attention: %s\n", r.status().message().c_str());
    return 1;
  }
  Backend& be = *r.value();
  std::printf(
      "# bench_attention on %s; median of %d iterations after %d warm-up; TFLOP/s: fwd"
      " 4 D, bwd 10 D per causal pair\n",
      be.name().c_str(), o.iters, o.warmup);
  std::printf("%-40s %9s %9s %8s %8s  %s\n", "shape", "fwd_ms", "bwd_ms", "fwd_TF", "bwd_TF",
              "check (bytes vs CPU)");
  for (const Shape& s : kShapes)
    if (o.only.empty() || std::string(s.name).find(o.only) != std::string::npos)
      run_shape(be, s, o);
  return 0;
}

}  // namespace
}  // namespace packmoe

int main(int argc, char** argv) {
  packmoe::Options o;
  CLI::App app{"packmoe attention benchmark"};
  app.add_option("--iters", o.iters, "timed iterations (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed warm-up iterations")->check(CLI::NonNegativeNumber);
  app.add_flag("--check", o.check, "compare every output's bytes with the CPU reference");
  app.add_option("--check-limit", o.check_limit, "largest pairs * D that --check runs on the CPU");
  app.add_option("--only", o.only, "run only the shapes whose name contains this");
  CLI11_PARSE(app, argc, argv);
  return packmoe::run(o);
}
