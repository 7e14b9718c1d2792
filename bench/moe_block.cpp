// MoE layer throughput: one MoEBlock forward + backward (+ backward_dw when --delay-wgrad; no
// optimizer step) on the shapes of the PyTorch peer shared/peers/torch_moe_layer.py
// (qwen3_30b_a3b: E=128, H=2048, F=768, T=16384, k=8; small_64e: E=64, H=1024, F=512, T=8192,
// k=8), in the bf16, mxfp8 and nvfp4 recipes, against torch's figure from the same run
// (--peer-json torch_moe_layer.json, key <shape>.torch_moe_layer_fwd_bwd_ms). Like the peer:
// x ~ N(0, 1) BF16, router and expert weights N(0, 0.02), norm_topk_prob on, no aux loss; dy is
// random BF16 N(0, 1) (the peer backpropagates mean(y^2)). One line per case:
// shape recipe ms tokens/s vs_torch expert_TFLOP/s, vs_torch = torch ms / our ms.
// The low-precision primary is used: FC1 / FC2 weights are quantized once at construction (what a
// training step pays once per optimizer step, not per micro-batch), so the timed region is what
// every micro-batch pays. Device memory on one H200 (qwen3_30b_a3b, worst recipe): weights
// <= 1.2 GB (BF16 1.2 GB, MXFP8 0.6 GB), FP32 main_grads 2.4 GB, a transient 3.6 GB while the init
// is cast and quantized at construction, activations and their quantized copies about 6 GB, GEMM
// dequantize scratch about 2 GB: well under 20 GB. Host: the FP32 init (2.4 GB) twice. Backend
// interface only. On a busy CPU run it with OMP_WAIT_POLICY=passive (as CTest runs the tests):
// spinning OpenMP workers next to OpenBLAS's threads make the CPU reference much slower.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/moe_block.h"

namespace packmoe {
namespace {

struct Options {
  std::string device = "cuda";
  std::string peer_json;
  int iters = 10;
  int warmup = 3;
  bool small = false;
  bool delay_wgrad = false;
  std::string layout = "single";
  std::string recipes = "bf16,mxfp8,nvfp4";
  std::string only;  // comma-separated shape names
};

struct LayerShape {
  std::string name;
  int64_t E, H, F, T, k;
  double torch_ms = 0;  // from the peer JSON, 0 = absent
};

std::vector<LayerShape> default_shapes(bool small) {
  if (small)
    return {{"small_cpu_8e", 8, 256, 128, 512, 2}, {"small_cpu_16e", 16, 256, 128, 1024, 4}};
  return {{"qwen3_30b_a3b", 128, 2048, 768, 16384, 8}, {"small_64e", 64, 1024, 512, 8192, 8}};
}

void die(const std::string& msg) {
  std::fprintf(stderr, "bench_moe_block: %s\n", msg.c_str());
  std::exit(2);
}

// torch_moe_layer.json: {"<shape>": {"torch_moe_layer_fwd_bwd_ms": ms, ...}, "hf": ...}.
void read_peer(const std::string& path, std::vector<LayerShape>& shapes) {
  std::ifstream f(path);
  if (!f) die("cannot open --peer-json " + path);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) die(path + " is not a JSON object");
  int found = 0;
  for (LayerShape& s : shapes) {
    if (!j.contains(s.name) || !j[s.name].is_object()) continue;
    const nlohmann::json& r = j[s.name];
    if (r.contains("torch_moe_layer_fwd_bwd_ms") && r["torch_moe_layer_fwd_bwd_ms"].is_number()) {
      s.torch_ms = r["torch_moe_layer_fwd_bwd_ms"].get<double>();
      ++found;
    }
  }
  if (found == 0) die(path + " has no <shape>.torch_moe_layer_fwd_bwd_ms (is it torch_moe_layer.json?)");
}

bool listed(const std::string& csv, const std::string& name) {
  return ("," + csv + ",").find("," + name + ",") != std::string::npos;
}

std::string ratio(double torch_ms, double ms) {
  if (torch_ms <= 0 || ms <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%.2fx", torch_ms / ms);
  return b;
}

// N(0, stddev) values from a counter-based hash (SplitMix64 -> Box-Muller), filled in parallel:
// the same values for any thread count, and fast enough for the 600M weights of qwen3_30b_a3b.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void fill_normal(float* p, int64_t n, uint64_t seed, float stddev) {
  const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pairs; ++i) {
    const uint64_t z = mix64(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 1);
    // Two 32-bit uniforms in (0, 1].
    const double u1 = (static_cast<double>(z >> 32) + 1.0) / 4294967296.0;
    const double u2 = (static_cast<double>(z & 0xFFFFFFFFull) + 1.0) / 4294967296.0;
    const double r = std::sqrt(-2.0 * std::log(u1)) * stddev;
    const double a = 6.283185307179586 * u2;
    p[2 * i] = static_cast<float>(r * std::cos(a));
    if (2 * i + 1 < n) p[2 * i + 1] = static_cast<float>(r * std::sin(a));
  }
}

Tensor normal_f32(Shape shape, uint64_t seed, float stddev) {
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  fill_normal(t.data_as<float>(), t.numel(), seed, stddev);
  return t;
}

// (rows, cols) BF16 of N(0, stddev) in `be`'s memory.
Tensor normal_bf16(Backend& be, int64_t rows, int64_t cols, uint64_t seed, float stddev) {
  const Tensor f = normal_f32({rows, cols}, seed, stddev);
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, {rows, cols});
  const float* src = f.data_as<const float>();
  uint16_t* dst = h.data_as<uint16_t>();
  const int64_t n = h.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  return be.to_device(h);
}

Recipe parse_recipe(const std::string& r) {
  if (r == "bf16") return Recipe::kBF16;
  if (r == "mxfp8") return Recipe::kMxfp8;
  if (r == "nvfp4") return Recipe::kNvfp4;
  die("unknown recipe " + r + " (bf16, mxfp8, nvfp4)");
  return Recipe::kBF16;
}

std::vector<std::string> split_csv(const std::string& csv) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= csv.size()) {
    const size_t comma = csv.find(',', at);
    const std::string item = csv.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

int run(const Options& o) {
  const Device dev = o.device == "cpu" ? Device::kCPU : Device::kCUDA;
  Result<Backend*> r = get_backend(dev);
  if (!r.is_ok()) {
    std::fprintf(stderr, "bench_moe_block: %s\n", r.status().message().c_str());
    return 1;
  }
  Backend& be = *r.value();
  std::vector<LayerShape> shapes = default_shapes(o.small);
  if (!o.peer_json.empty()) {
    if (o.small)
      std::printf("# --small: torch peer figures ignored (they are for the full shapes)\n");
    else
      read_peer(o.peer_json, shapes);
  }
  if (!o.only.empty()) {
    std::vector<LayerShape> keep;
    for (const LayerShape& s : shapes)
      if (listed(o.only, s.name)) keep.push_back(s);
    shapes = keep;
  }
  std::vector<Recipe> recipes;
  for (const std::string& name : split_csv(o.recipes)) recipes.push_back(parse_recipe(name));
  const Layout layout = o.layout == "discrete" ? Layout::kDiscrete : Layout::kSingle;

  std::printf("# bench_moe_block on %s; median of %d after %d warm-up (+1 untimed check run)\n",
              be.name().c_str(), o.iters, o.warmup);
  std::printf(
      "# timed: forward + backward%s of ONE MoE layer: router GEMM, softmax/top-k, routing plan\n"
      "# (on the device; the host waits once for the E expert counts), permute, FC1 and FC2\n"
      "# grouped linears (activation quantization, fprop, dgrad, wgrad into the FP32 main_grad,\n"
      "# accumulating, fused), SwiGLU, unpermute + combine, and the router backward; activation\n"
      "# buffers come from the backend's stream-ordered pool per op, included.\n"
      "# Primary weight: LOW precision (%s layout), quantized once at construction, so per-step\n"
      "# weight quantization is excluded; no optimizer step (like the peer). tokens/s = T / time;\n"
      "# expert_TFLOP/s = 3 * (2*T*k*H*2F + 2*T*k*F*H) / time (the peer's formula, padding not\n"
      "# counted); vs_torch = torch ms / our ms (torch_moe_layer.py: BF16 torch._grouped_mm layer)\n",
      o.delay_wgrad ? " + backward_dw (delayed wgrads)" : "",
      layout == Layout::kSingle ? "single" : "discrete");
  std::printf("%-16s %-6s %9s %12s %9s %15s\n", "shape", "recipe", "ms", "tokens/s", "vs_torch",
              "expert_TFLOP/s");
  std::fflush(stdout);

  for (const LayerShape& s : shapes) {
    // The peer's init: weights N(0, 0.02), x N(0, 1); one init for every recipe of the shape.
    const MoEBlockInit init{normal_f32({s.E, s.H}, 1, 0.02f),
                            normal_f32({s.E, 2 * s.F, s.H}, 2, 0.02f),
                            normal_f32({s.E, s.H, s.F}, 3, 0.02f)};
    const Tensor x = normal_bf16(be, s.T, s.H, 4, 1.0f);
    const Tensor dy = normal_bf16(be, s.T, s.H, 5, 1.0f);
    const double flops =
        3.0 * (2.0 * s.T * s.k * s.H * 2 * s.F + 2.0 * s.T * s.k * s.F * s.H);
    for (Recipe rec : recipes) {
      MoEBlockConfig cfg;
      cfg.top_k = s.k;
      cfg.norm_topk_prob = true;
      cfg.aux_loss_coef = 0.0f;
      cfg.recipe = {rec, false, /*sr_seed=*/1234};
      cfg.primary = PrimaryWeight::kLowPrecision;
      cfg.layout = layout;
      cfg.grad_accum_fusion = true;
      cfg.delay_wgrad = o.delay_wgrad;
      cfg.out_dtype = DType::kBF16;
      cfg.activation_dtype = DType::kBF16;
      MoEBlock block(be, cfg, init);
      auto body = [&] {
        const Tensor y = block.forward(x);
        const Tensor dx = block.backward(dy, GradAccum::kAccumulate);
        if (o.delay_wgrad) block.backward_dw();
      };
      body();  // errors surface before timing; the plan below is this run's
      be.synchronize();
      const RoutingPlan& plan = block.plan();
      const int64_t lo = *std::min_element(plan.counts.begin(), plan.counts.end());
      const int64_t hi = *std::max_element(plan.counts.begin(), plan.counts.end());
      const double ms = be.time_ms(body, o.warmup, o.iters);
      std::printf("%-16s %-6s %9.3f %12.4g %9s %15.3g   # M=%lld rows (%lld padding), tokens per "
                  "expert %lld..%lld\n",
                  s.name.c_str(), recipe_name(rec), ms, s.T / (ms * 1e-3),
                  ratio(s.torch_ms, ms).c_str(), flops / (ms * 1e-3) / 1e12,
                  static_cast<long long>(plan.rows),
                  static_cast<long long>(plan.rows - s.T * s.k), static_cast<long long>(lo),
                  static_cast<long long>(hi));
      std::fflush(stdout);
    }
    if (s.torch_ms > 0)
      std::printf("# torch %s: %.3f ms forward+backward (BF16), %.4g tokens/s\n", s.name.c_str(),
                  s.torch_ms, s.T / (s.torch_ms * 1e-3));
  }
  return 0;
}

}  // namespace
}  // namespace packmoe

int main(int argc, char** argv) {
  packmoe::Options o;
  CLI::App app{"packmoe MoE layer (MoEBlock forward + backward) benchmark"};
  app.add_option("--device", o.device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--peer-json", o.peer_json,
                 "torch_moe_layer.json from shared/peers/torch_moe_layer.py");
  app.add_option("--iters", o.iters, "timed iterations (median; --small: 3)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed warm-up iterations (--small: 1)")->check(CLI::NonNegativeNumber);
  app.add_option("--recipes", o.recipes, "comma-separated: bf16,mxfp8,nvfp4");
  app.add_option("--layout", o.layout, "single or discrete")
      ->check(CLI::IsMember({"single", "discrete"}));
  app.add_option("--only", o.only, "comma-separated shape names");
  app.add_flag("--delay-wgrad", o.delay_wgrad, "queue the expert wgrads and time backward_dw too");
  app.add_flag("--small", o.small, "small shapes (seconds on a CPU)");
  CLI11_PARSE(app, argc, argv);
  if (o.small) {  // seconds on a CPU unless asked otherwise
    if (app.count("--iters") == 0) o.iters = 3;
    if (app.count("--warmup") == 0) o.warmup = 1;
  }
  return packmoe::run(o);
}
