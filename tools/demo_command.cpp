// `packmoe demo`: the main job until the trainer exists. Generates a packed expert weight
// (E, N, K) in BF16, quantizes it in every recipe as ONE call over the pack and as E separate
// (discrete) tensors through the same entry point, checks the bytes are identical, checks the
// GPU bytes equal the CPU reference when a GPU is present, and reports error and speed.
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>

#include "backend/device_buffer.h"
#include "core/codecs.h"
#include "formats/nvfp4_math.h"
#include "tools/commands.h"

namespace packmoe::tools {
namespace {

struct Recipe {
  std::string name;
  bool nvfp4;
  Mxfp8Config mx;
  Nvfp4Config nv;
};

std::vector<Recipe> recipes(const std::string& which) {
  std::vector<Recipe> all;
  Recipe r;
  r = {"mxfp8 e4m3 1x32 row+col", false, {}, {}};
  r.mx.columnwise = true;
  all.push_back(r);
  r = {"mxfp8 e4m3 32x32 (weights)", false, {}, {}};
  r.mx.two_d = true;
  r.mx.columnwise = true;
  all.push_back(r);
  r = {"nvfp4 16x16 (weights)", true, {}, {}};
  r.nv.two_d = true;
  r.nv.columnwise = true;
  all.push_back(r);
  r = {"nvfp4 1x16 +RHT +SR (grads)", true, {}, {}};
  r.nv.columnwise = true;
  r.nv.rht = true;
  r.nv.stochastic_rounding = true;
  r.nv.seed = 1234;
  all.push_back(r);
  std::vector<Recipe> out;
  for (const Recipe& x : all)
    if (which == "all" || (which == "mxfp8") != x.nvfp4) out.push_back(x);
  return out;
}

// Output buffers of one quantization: one set of per-group pointers into either one packed
// allocation per component or E separate allocations.
struct QuantOut {
  std::vector<std::vector<DeviceBuffer>> parts;  // component -> buffers (1 packed or E)
  std::vector<std::vector<void*>> ptrs;          // component -> G pointers

  void add(Backend& b, int64_t experts, size_t bytes_per_group, bool packed) {
    std::vector<DeviceBuffer> bufs;
    std::vector<void*> p;
    if (packed) {
      bufs.emplace_back(b, bytes_per_group * experts);
      p = carve(bufs.back().get(), experts, bytes_per_group);
    } else {
      for (int64_t e = 0; e < experts; ++e) {
        bufs.emplace_back(b, bytes_per_group);
        p.push_back(bufs.back().get());
      }
    }
    parts.push_back(std::move(bufs));
    ptrs.push_back(p);
  }
  std::vector<uint8_t> bytes() const {  // every component, concatenated in group order
    std::vector<uint8_t> all;
    for (const auto& comp : parts)
      for (const auto& buf : comp) {
        auto h = buf.download();
        all.insert(all.end(), h.begin(), h.end());
      }
    return all;
  }
};

// Quantizes; returns outputs. Components: data/scale for each requested copy (+ amax for NVFP4).
Result<QuantOut> quantize(Backend& b, const Recipe& r, const GroupedMatrices& in, bool packed) {
  const int64_t E = in.groups(), N = in.rows[0], K = in.cols;
  QuantOut q;
  Status s;
  if (!r.nvfp4) {
    q.add(b, E, N * K, packed);         // row data (N, K)
    q.add(b, E, N * K / 32, packed);    // row scale (N, K/32)
    q.add(b, E, N * K, packed);         // col data (N, K)
    q.add(b, E, N / 32 * K, packed);    // col scale (N/32, K)
    Mxfp8Outputs o{q.ptrs[0], q.ptrs[1], q.ptrs[2], q.ptrs[3], {}, {}};
    s = ops::quantize_mxfp8(b, in, r.mx, o);
  } else {
    q.add(b, E, N * K / 2, packed);     // row data (N, K/2)
    q.add(b, E, N * K / 16, packed);    // row scale (N, K/16)
    q.add(b, E, N * K / 2, packed);     // col data (K, N/2)
    q.add(b, E, K * N / 16, packed);    // col scale (K, N/16)
    q.add(b, 1, 2 * E * sizeof(float), true);  // row amax (E,), col amax (E,)
    Nvfp4Outputs o;
    o.row_data = q.ptrs[0];
    o.row_scale = q.ptrs[1];
    o.col_data = q.ptrs[2];
    o.col_scale = q.ptrs[3];
    o.row_amax = q.ptrs[4][0];
    o.col_amax = static_cast<float*>(q.ptrs[4][0]) + E;
    s = ops::quantize_nvfp4(b, in, r.nv, o);
  }
  if (!s) return s;
  return q;
}

// Relative RMS error of the rowwise copy, dequantized on `b`, against the BF16 input.
Result<double> rowwise_error(Backend& b, const Recipe& r, const QuantOut& q, int64_t E, int64_t N,
                             int64_t K, const std::vector<float>& ref) {
  DeviceBuffer out(b, E * N * K * sizeof(float));
  std::vector<void*> outs = carve(out.get(), E, N * K * sizeof(float));
  std::vector<const void*> data(q.ptrs[0].begin(), q.ptrs[0].end());
  std::vector<const void*> scale(q.ptrs[1].begin(), q.ptrs[1].end());
  Status s;
  if (!r.nvfp4) {
    Mxfp8Copy c{r.mx.element, false, K, std::vector<int64_t>(E, N), data, scale};
    s = ops::dequantize_mxfp8(b, c, DType::kF32, outs);
  } else {
    std::vector<uint8_t> amax_bytes = q.parts[4][0].download();  // row amax first
    std::vector<float> decode(E);
    for (int64_t e = 0; e < E; ++e) {
      float a;
      std::memcpy(&a, amax_bytes.data() + e * sizeof(float), sizeof(float));
      decode[e] = nvfp4_decode_scale(a);
    }
    DeviceBuffer dec(b, E * sizeof(float));
    dec.upload({reinterpret_cast<const uint8_t*>(decode.data()), E * sizeof(float)});
    Nvfp4Copy c{K, std::vector<int64_t>(E, N), data, scale, dec.get()};
    s = ops::dequantize_nvfp4(b, c, DType::kF32, outs);
  }
  if (!s) return s;
  std::vector<uint8_t> h = out.download();
  const float* y = reinterpret_cast<const float*>(h.data());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(y[i]) - ref[i]) * (double(y[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

void add_demo_command(CLI::App& app, DemoArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Quantize a generated packed expert weight (E, N, K) in every recipe: one call over the\n"
      "pack vs E discrete tensors (must be bitwise equal), GPU vs CPU reference (bitwise),\n"
      "rowwise round-trip error and time.");
  cmd->add_option("--device", args.device, "auto (default), cpu or cuda");
  cmd->add_option("--format", args.format, "all (default), mxfp8 or nvfp4")
      ->check(CLI::IsMember({"all", "mxfp8", "nvfp4"}));
  cmd->add_option("--experts", args.experts, "E, number of experts (default 8)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--rows", args.rows, "N, rows per expert, multiple of 32 (default 256)")
      ->check(CLI::Range(32, 1 << 20));
  cmd->add_option("--cols", args.cols, "K, columns, multiple of 32 (default 512)")
      ->check(CLI::Range(32, 1 << 20));
  cmd->add_option("--seed", args.seed, "seed of the generated weights (default 1)");
}

Status run_demo(const DemoArgs& args) {
  Result<Backend*> backend = backend_from_flag(args.device);
  if (!backend) return backend.status();
  Backend& b = *backend.value();
  const int64_t E = args.experts, N = args.rows, K = args.cols;
  if (N % 32 || K % 32) return Status::error("--rows and --cols must be multiples of 32");

  // Weights ~ N(0, 0.02) with a few large outliers, as BF16.
  std::mt19937_64 rng(args.seed);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::vector<uint16_t> w(E * N * K);
  std::vector<float> ref(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    float x = normal(rng) * (i % 997 == 0 ? 40.f : 1.f);
    w[i] = f32_to_bf16(x);
    ref[i] = bf16_to_f32(w[i]);
  }
  std::span<const uint8_t> w_bytes(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 2);

  std::printf("packmoe demo: packed expert weight (E=%lld, N=%lld, K=%lld) bf16 on %s\n",
              (long long)E, (long long)N, (long long)K, b.name().c_str());
  Backend* cpu = &cpu_backend();
  bool compare_cpu = &b != cpu;
  std::printf("%-30s %10s %12s %12s %10s\n", "recipe", "call_ms", "single==disc",
              compare_cpu ? "gpu==cpu" : "", "rel_rms");
  for (const Recipe& r : recipes(args.format)) {
    DeviceBuffer packed_in(b, w_bytes.size());
    packed_in.upload(w_bytes);
    GroupedMatrices single = packed_groups(packed_in.get(), DType::kBF16, E, N, K);
    std::vector<DeviceBuffer> expert_in;
    GroupedMatrices discrete = single;
    for (int64_t e = 0; e < E; ++e) {
      expert_in.emplace_back(b, N * K * 2);
      expert_in.back().upload(w_bytes.subspan(e * N * K * 2, N * K * 2));
      discrete.data[e] = expert_in.back().get();
    }
    Result<QuantOut> q_single = quantize(b, r, single, true);
    if (!q_single) return q_single.status();
    Result<QuantOut> q_disc = quantize(b, r, discrete, false);
    if (!q_disc) return q_disc.status();
    bool same = q_single.value().bytes() == q_disc.value().bytes();
    std::string gpu_cpu;
    if (compare_cpu) {
      GroupedMatrices host = packed_groups(w.data(), DType::kBF16, E, N, K);
      Result<QuantOut> q_cpu = quantize(*cpu, r, host, true);
      if (!q_cpu) return q_cpu.status();
      gpu_cpu = q_cpu.value().bytes() == q_single.value().bytes() ? "yes" : "NO";
    }
    double ms = b.time_ms([&] { (void)quantize(b, r, single, true); }, 1, 3);
    Result<double> err = rowwise_error(b, r, q_single.value(), E, N, K, ref);
    if (!err) return err.status();
    std::printf("%-30s %10.3f %12s %12s %10.2e\n", r.name.c_str(), ms, same ? "yes" : "NO",
                gpu_cpu.c_str(), err.value());
    if (!same || gpu_cpu == "NO")
      return Status::error("bitwise mismatch in recipe '" + r.name + "' (a bug: please report)");
  }
  return Status::ok();
}

}  // namespace packmoe::tools
