// Quantizer throughput: MXFP8 / NVFP4 casts of packed expert weights (one launch over the pack vs
// a per-expert loop) and of activations, against the device copy bandwidth measured in the same
// run and, optionally, PyTorch's peer figures (shared/peers/torch_grouped_gemm_and_quant.py).
// One line per case: case ms GB/s %copy vs_torch packed_vs_loop. GB/s counts the logical bytes
// read + written once each: input + data + scales + amax (NVFP4's second read of the input for
// its amax pass is not counted, so its GB/s is the effective rate). Uses the Backend interface.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "core/codecs.h"

namespace packmoe {
namespace {

struct Options {
  std::string device = "cuda";
  std::string peer_json;
  int iters = 20;
  int warmup = 3;
  bool small = false;
  bool no_loop = false;  // skip the per-expert loops and host timings (e.g. under a profiler)
};

// The Qwen3-30B-A3B expert FC1 shape of the peer script: E experts of (2F, H) = (1536, 2048), and
// T*k = 131072 routed activation rows of H = 2048.
struct Shapes {
  int64_t experts, n, k, tokens;
  size_t copy_bytes;
};

Shapes shapes_for(bool small) {
  if (small) return {8, 256, 512, 4096, size_t{64} << 20};
  return {128, 1536, 2048, 131072, size_t{2} << 30};
}

// Byte `off` of a device buffer.
uint8_t* at(const DeviceBuffer& b, size_t off) { return static_cast<uint8_t*>(b.get()) + off; }

// Host wall time of one call of `body` in microseconds: the mean over `reps` back-to-back calls,
// timed up to the last enqueue (the device work is drained afterwards and not counted).
double host_us_per_call(Backend& be, const std::function<void()>& body, int reps) {
  body();  // warm: first-use setup (self-tests, occupancy queries) stays out
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) body();
  const auto t1 = std::chrono::steady_clock::now();
  be.synchronize();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / reps;
}

// Random BF16 values, generated on the host once per buffer and copied: a counter-based hash per
// element (parallel, reproducible), magnitudes spread over 2^-8 .. 2^8 with random signs.
void fill_random_bf16(Backend& be, void* dst, int64_t n, uint64_t seed) {
  std::vector<uint16_t> host(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const uint32_t sign = static_cast<uint32_t>(z >> 63) << 31;
    const uint32_t exp = 119u + static_cast<uint32_t>((z >> 40) % 17);  // 2^-8 .. 2^8
    const uint32_t man = static_cast<uint32_t>(z) & 0x7FFFFFu;
    host[i] = f32_to_bf16(f32_from_bits(sign | (exp << 23) | man));
  }
  be.copy(dst, host.data(), n * sizeof(uint16_t), Backend::CopyKind::kHostToDevice);
}

struct Peer {
  double mxfp8_weights_gbps = 0;  // counts 2 B read + 1 B + 1/32 B written per element (rowwise)
  double mxfp8_weights_ms = 0;
  double mxfp8_loop_ms = 0;
  bool have = false;
};

Peer read_peer(const std::string& path) {
  Peer p;
  if (path.empty()) return p;
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "bench_quantize: cannot open --peer-json %s\n", path.c_str());
    std::exit(2);
  }
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.contains("qwen3_30b_a3b")) {
    std::fprintf(stderr, "bench_quantize: %s is not a torch_peers.json (no qwen3_30b_a3b)\n",
                 path.c_str());
    std::exit(2);
  }
  const auto& q = j["qwen3_30b_a3b"];
  p.mxfp8_weights_gbps = q.value("torch_mxfp8_quant_weights_GBps", 0.0);
  p.mxfp8_weights_ms = q.value("torch_mxfp8_quant_weights_ms", 0.0);
  p.mxfp8_loop_ms = q.value("torch_mxfp8_quant_loop_ms", 0.0);
  p.have = p.mxfp8_weights_ms > 0;
  return p;
}

std::string ratio(double r) {
  if (r <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%.2fx", r);
  return b;
}

class Bench {
 public:
  Bench(Backend& be, const Options& o) : be_(be), o_(o) {}

  // Median ms of `body` over o_.iters runs after o_.warmup.
  double time(const std::function<void()>& body) { return be_.time_ms(body, o_.warmup, o_.iters); }

  // One result line. The first line printed is the copy, the reference of %copy.
  void line(const std::string& name, double bytes, double ms, const std::string& vs_torch = "-",
            const std::string& packed_vs_loop = "-", const std::string& note = "") {
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    if (copy_gbps_ == 0) copy_gbps_ = gbps;
    std::printf("%-40s %9.3f %9.1f %6.1f%% %10s %14s%s%s\n", name.c_str(), ms, gbps,
                100.0 * gbps / copy_gbps_, vs_torch.c_str(), packed_vs_loop.c_str(),
                note.empty() ? "" : "  # ", note.c_str());
    std::fflush(stdout);
  }
  void run(const std::string& name, double bytes, const std::function<void()>& body,
           const std::string& note = "") {
    line(name, bytes, time(body), "-", "-", note);
  }

 private:
  Backend& be_;
  const Options& o_;
  double copy_gbps_ = 0;
};

void check(const Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "bench_quantize: %s\n", s.message().c_str());
    std::exit(1);
  }
}

int run(const Options& o) {
  const Device dev = o.device == "cpu" ? Device::kCPU : Device::kCUDA;
  Result<Backend*> r = get_backend(dev);
  if (!r.is_ok()) {
    std::fprintf(stderr, "bench_quantize: %s\n", r.status().message().c_str());
    return 1;
  }
  Backend& be = *r.value();
  const Shapes sh = shapes_for(o.small);
  // Torch's figures are for the full shapes: with --small there is nothing to compare.
  Peer peer = read_peer(o.peer_json);
  if (o.small && peer.have) {
    std::printf("# --small: torch peer figures ignored (they are for the full shapes)\n");
    peer.have = false;
  }
  std::printf(
      "# bench_quantize on %s; median of %d iterations after %d warm-up; GB/s = bytes read"
      " + written / time; %%copy against the copy line\n",
      be.name().c_str(), o.iters, o.warmup);
  std::printf("# weights E=%lld x (%lld x %lld) BF16, activations %lld x %lld BF16\n",
              static_cast<long long>(sh.experts), static_cast<long long>(sh.n),
              static_cast<long long>(sh.k), static_cast<long long>(sh.tokens),
              static_cast<long long>(sh.k));
  if (peer.have)
    std::printf(
        "# torch peer (qwen3_30b_a3b): MXFP8 weight cast %.1f GB/s (%.3f ms, rowwise only:"
        " 2 B read + 1 + 1/32 B written per element), per-expert loop %.3f ms\n",
        peer.mxfp8_weights_gbps, peer.mxfp8_weights_ms, peer.mxfp8_loop_ms);
  std::printf("%-40s %9s %9s %7s %10s %14s\n", "case", "ms", "GB/s", "%copy", "vs_torch",
              "packed_vs_loop");
  Bench bench(be, o);

  // ---- device copy: bytes read + written ----
  {
    DeviceBuffer a(be, sh.copy_bytes), b(be, sh.copy_bytes);
    be.fill_zero(a.get(), sh.copy_bytes);
    bench.run(
        "copy d2d", 2.0 * sh.copy_bytes,
        [&] { be.copy(b.get(), a.get(), sh.copy_bytes, Backend::CopyKind::kDeviceToDevice); },
        "bytes read + written");
  }

  const int64_t E = sh.experts, N = sh.n, K = sh.k;
  const int64_t w_elems = E * N * K;
  DeviceBuffer w(be, w_elems * 2);  // (E, N, K) BF16, packed
  fill_random_bf16(be, w.get(), w_elems, 0x5EED0001);

  // ---- MXFP8 E4M3 weights ----
  {
    const double elems = static_cast<double>(w_elems);
    DeviceBuffer rd(be, w_elems), rs(be, w_elems / 32), cd(be, w_elems), cs(be, w_elems / 32);
    auto outputs = [&](int64_t first, int64_t count, bool col) {
      Mxfp8Outputs out;
      for (int64_t e = first; e < first + count; ++e) {
        out.row_data.push_back(at(rd, e * N * K));
        out.row_scale.push_back(at(rs, e * N * K / 32));
        if (col) {
          out.col_data.push_back(at(cd, e * N * K));
          out.col_scale.push_back(at(cs, e * N * K / 32));
        }
      }
      return out;
    };
    const GroupedMatrices packed = packed_groups(w.get(), DType::kBF16, E, N, K);
    Mxfp8Config row_only{DType::kE4M3, true, false, false};
    Mxfp8Config both{DType::kE4M3, true, true, false};

    // Like for like with torch's figure: rowwise only, the same bytes counted, so the GB/s
    // ratio is also torch ms / our ms.
    const Mxfp8Outputs o_row = outputs(0, E, false);
    const double row_bytes = elems * (2 + 1 + 1.0 / 32);
    const double ms_row = bench.time([&] { check(ops::quantize_mxfp8(be, packed, row_only, o_row)); });
    bench.line("mxfp8 e4m3 row   weights packed", row_bytes, ms_row,
               peer.have ? ratio(peer.mxfp8_weights_ms / ms_row) : "-", "-",
               peer.have ? "same work as torch's cast" : "");

    // Rowwise + columnwise in one pass: what training needs (fprop and dgrad copies). Torch's
    // figure is rowwise only, so vs_torch here is the ratio of times for the same tensor
    // (torch doing less work), not of GB/s.
    const Mxfp8Outputs o_both = outputs(0, E, true);
    const double both_bytes = elems * (2 + 1 + 1 + 2.0 / 32);
    std::vector<Mxfp8Outputs> o_each;
    std::vector<GroupedMatrices> g_each;
    for (int64_t e = 0; e < E; ++e) {
      o_each.push_back(outputs(e, 1, true));
      g_each.push_back(packed_groups(at(w, e * N * K * 2), DType::kBF16, 1, N, K));
    }
    const double ms_packed = bench.time([&] { check(ops::quantize_mxfp8(be, packed, both, o_both)); });
    const double ms_loop = o.no_loop ? 0.0 : bench.time([&] {
      for (int64_t e = 0; e < E; ++e) check(ops::quantize_mxfp8(be, g_each[e], both, o_each[e]));
    });
    bench.line("mxfp8 e4m3 row+col weights packed", both_bytes, ms_packed,
               peer.have ? ratio(peer.mxfp8_weights_ms / ms_packed) : "-",
               ratio(ms_loop / ms_packed),
               peer.have ? "vs_torch = torch row-only ms / our row+col ms" : "");
    if (!o.no_loop) {
      bench.line("mxfp8 e4m3 row+col weights loop(E)", both_bytes, ms_loop,
                 peer.have ? ratio(peer.mxfp8_loop_ms / ms_loop) : "-", "-",
                 peer.have ? "vs_torch = torch row-only loop ms / our row+col loop ms" : "");
      int64_t next = 0;
      const double us_one = host_us_per_call(
          be, [&] { check(ops::quantize_mxfp8(be, g_each[next % E], both, o_each[next % E])), ++next; },
          static_cast<int>(E));
      const double us_pack =
          host_us_per_call(be, [&] { check(ops::quantize_mxfp8(be, packed, both, o_both)); }, 20);
      std::printf("# host time per mxfp8 call (validate, group table, launch; enqueue only):"
                  " one expert %.1f us, packed E=%lld %.1f us\n",
                  us_one, static_cast<long long>(E), us_pack);
    }
  }

  // ---- NVFP4 2D weights (16x16 tiles), rowwise + columnwise (transposed) ----
  {
    const double elems = static_cast<double>(w_elems);
    DeviceBuffer rd(be, w_elems / 2), rs(be, w_elems / 16), cd(be, w_elems / 2), cs(be, w_elems / 16);
    DeviceBuffer ra(be, E * 4), ca(be, E * 4);
    const GroupedMatrices packed = packed_groups(w.get(), DType::kBF16, E, N, K);
    Nvfp4Config cfg;
    cfg.rowwise = cfg.columnwise = cfg.two_d = true;
    Nvfp4Outputs all;
    std::vector<Nvfp4Outputs> each(E);
    std::vector<GroupedMatrices> g_each;
    for (int64_t e = 0; e < E; ++e) {
      all.row_data.push_back(at(rd, e * N * K / 2));
      all.row_scale.push_back(at(rs, e * N * K / 16));
      all.col_data.push_back(at(cd, e * N * K / 2));
      all.col_scale.push_back(at(cs, e * N * K / 16));
      each[e].row_data = {at(rd, e * N * K / 2)};
      each[e].row_scale = {at(rs, e * N * K / 16)};
      each[e].col_data = {at(cd, e * N * K / 2)};
      each[e].col_scale = {at(cs, e * N * K / 16)};
      each[e].row_amax = at(ra, e * 4);
      each[e].col_amax = at(ca, e * 4);
      g_each.push_back(packed_groups(at(w, e * N * K * 2), DType::kBF16, 1, N, K));
    }
    all.row_amax = ra.get();
    all.col_amax = ca.get();
    const double bytes = elems * (2 + 0.5 + 0.5 + 2.0 / 16) + 2.0 * E * 4;
    const double ms_packed = bench.time([&] { check(ops::quantize_nvfp4(be, packed, cfg, all)); });
    const double ms_loop = o.no_loop ? 0.0 : bench.time([&] {
      for (int64_t e = 0; e < E; ++e) check(ops::quantize_nvfp4(be, g_each[e], cfg, each[e]));
    });
    bench.line("nvfp4 2d row+col weights packed", bytes, ms_packed, "-", ratio(ms_loop / ms_packed),
               "two launches (amax, quantize) over the pack");
    if (!o.no_loop) {
      bench.line("nvfp4 2d row+col weights loop(E)", bytes, ms_loop);
      int64_t next = 0;
      const double us_one = host_us_per_call(
          be, [&] { check(ops::quantize_nvfp4(be, g_each[next % E], cfg, each[next % E])), ++next; },
          static_cast<int>(E));
      std::printf("# host time per nvfp4 call (validate, group table, memset + 2 launches; enqueue"
                  " only): one expert %.1f us\n",
                  us_one);
    }
  }

  // ---- activations / gradients (T x H) ----
  {
    const int64_t T = sh.tokens;
    const int64_t n = T * K;
    const double elems = static_cast<double>(n);
    DeviceBuffer x(be, n * 2);
    fill_random_bf16(be, x.get(), n, 0x5EED0002);
    const GroupedMatrices in = packed_groups(x.get(), DType::kBF16, 1, T, K);
    {
      DeviceBuffer rd(be, n), rs(be, n / 32), cd(be, n), cs(be, n / 32);
      Mxfp8Config cfg{DType::kE4M3, true, true, false};
      Mxfp8Outputs out{{rd.get()}, {rs.get()}, {cd.get()}, {cs.get()}, {}, {}};
      bench.run("mxfp8 e4m3 row+col activations", elems * (2 + 1 + 1 + 2.0 / 32),
                [&] { check(ops::quantize_mxfp8(be, in, cfg, out)); });
      // A gradient as GroupedLinear quantizes it: both copies' BF16 values written too.
      DeviceBuffer rv(be, n * 2), cv(be, n * 2);
      out.row_bf16 = {rv.get()};
      out.col_bf16 = {cv.get()};
      bench.run("mxfp8 e4m3 row+col + bf16 values", elems * (2 + 1 + 1 + 2.0 / 32 + 4),
                [&] { check(ops::quantize_mxfp8(be, in, cfg, out)); });
    }
    {
      DeviceBuffer rd(be, n / 2), rs(be, n / 16), cd(be, n / 2), cs(be, n / 16), ra(be, 4), ca(be, 4);
      Nvfp4Config cfg;
      cfg.rowwise = cfg.columnwise = cfg.rht = cfg.stochastic_rounding = true;
      cfg.seed = 1234;
      Nvfp4Outputs out;
      out.row_data = {rd.get()};
      out.row_scale = {rs.get()};
      out.row_amax = ra.get();
      out.col_data = {cd.get()};
      out.col_scale = {cs.get()};
      out.col_amax = ca.get();
      bench.run(
          "nvfp4 1x16 row+col rht+sr activations", elems * (2 + 0.5 + 0.5 + 2.0 / 16) + 8,
          [&] { check(ops::quantize_nvfp4(be, in, cfg, out)); },
          "two launches (amax incl. post-RHT amax, quantize)");
      // As the NVFP4 recipe quantizes an activation (RNE) and a gradient (SR): the rowwise copy
      // kept as its BF16 values only, the columnwise one through the RHT (nn/recipe_nvfp4.cpp).
      DeviceBuffer rv(be, n * 2);
      Nvfp4Outputs step;
      step.row_bf16 = {rv.get()};
      step.row_amax = ra.get();
      step.col_data = {cd.get()};
      step.col_scale = {cs.get()};
      step.col_amax = ca.get();
      for (const bool sr : {false, true}) {
        cfg.stochastic_rounding = sr;
        bench.run(sr ? "nvfp4 row bf16 + col rht+sr (gradient)" : "nvfp4 row bf16 + col rht (activation)",
                  elems * (2 + 2 + 0.5 + 1.0 / 16) + 8,
                  [&] { check(ops::quantize_nvfp4(be, in, cfg, step)); },
                  "two launches; as nn/recipe_nvfp4.cpp");
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace packmoe

int main(int argc, char** argv) {
  packmoe::Options o;
  CLI::App app{"packmoe quantizer benchmark"};
  app.add_option("--device", o.device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--peer-json", o.peer_json,
                 "torch_peers.json written by shared/peers/torch_grouped_gemm_and_quant.py");
  app.add_option("--iters", o.iters, "timed iterations (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed warm-up iterations")->check(CLI::NonNegativeNumber);
  app.add_flag("--small", o.small, "small shapes (seconds on a CPU)");
  app.add_flag("--no-loop", o.no_loop, "skip the per-expert loops and host timings");
  CLI11_PARSE(app, argc, argv);
  return packmoe::run(o);
}
