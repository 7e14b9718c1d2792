// Grouped GEMM throughput: fprop / dgrad / wgrad over the MoE shapes of the PyTorch peer
// (bench/torch_grouped_gemm.py), in the bf16, mxfp8 (E4M3) and nvfp4 recipes, against torch's
// figures from the same run (--peer-json; its token splits are used, so both sides multiply the
// same problems). One line per case, both implementations (the sm_90a wgmma kernel and cuBLASLt
// per group, chosen through the KernelPolicy of backend/cuda/kernel_policy.h): shape op recipe ms
// TFLOP/s for each, and vs_* = torch ms / our ms. Quantized operands are prepared once outside the
// timed region; the time covers the grouped_gemm call only (with its dequantize, a pre-pass or
// inside the sm90 kernel; mx-pre forces the pre-pass). Backend interface only.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/kernel_policy.h"
#include "backend/device_buffer.h"
#include "backend/ops/gemm.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

struct Options {
  std::string device = "cuda";
  std::string peer_json;
  int iters = 20;
  // Unset (< 0): 1500 ms on CUDA (200 ms left a power-capped H200 in the state the previous
  // measurement left it: docs/gemm-sm90.md), 200 ms on the CPU.
  double warmup_ms = -1;
  bool small = false;
  std::string only;     // comma-separated shape names
  std::string recipes = "bf16,mxfp8,nvfp4";  // comma-separated subset
  bool no_cublas = false;  // time the sm90 kernel only
};

// Whether `name` is one of the comma-separated names in `list`.
bool listed(const std::string& list, const std::string& name) {
  return ("," + list + ",").find("," + name + ",") != std::string::npos;
}

// The median ms of o.iters back-to-back calls (an event pair each, read after one sync), after
// calling `body` for at least o.warmup_ms of wall time so that the GPU's clocks have settled under
// this call's own load (a short warm-up inherits the state the previous measurement left).
// bench/torch_grouped_gemm.py times torch the same way.
double timed_ms(Backend& be, const Options& o, const std::function<void()>& body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int n = 1;; ++n) {
    body();
    if (n % 4 == 0) be.synchronize();  // wall time follows the GPU, not the launch queue
    const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
    if (dt.count() >= o.warmup_ms) break;
  }
  return be.time_ms(body, 0, o.iters);
}

// One MoE FC1 shape: E experts of W (N, K) = (2F, H), M routed rows split over the experts.
struct Shape {
  std::string name;
  int64_t E = 0, N = 0, K = 0;
  std::vector<int64_t> splits;
  int64_t M() const {
    int64_t m = 0;
    for (int64_t s : splits) m += s;
    return m;
  }
  // torch's figures (ms), absent = 0
  double gmm_fprop = 0, gmm_dgrad = 0, gmm_wgrad = 0, loop_fprop = 0, scaled_fprop = 0;
};

void die(const std::string& msg) {
  std::fprintf(stderr, "bench_grouped_gemm: %s\n", msg.c_str());
  std::exit(2);
}

// Uneven splits like the peer's (weights in [0.5, 1.5), multiples of 16, remainder to the last),
// rounded up to 32; used when no peer JSON gives them.
std::vector<int64_t> own_splits(int64_t E, int64_t M) {
  std::mt19937 rng(0);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<double> w(E);
  double sum = 0;
  for (double& x : w) sum += (x = u(rng));
  std::vector<int64_t> s(E);
  int64_t tot = 0;
  for (int64_t e = 0; e < E; ++e) tot += (s[e] = static_cast<int64_t>(w[e] / sum * M / 16) * 16);
  s[E - 1] += M - tot;
  for (int64_t& v : s) v = (v + 31) / 32 * 32;
  return s;
}

std::vector<Shape> default_shapes(bool small) {
  struct D {
    const char* name;
    int64_t E, H, F, M;
  };
  std::vector<D> d = small ? std::vector<D>{{"small_cpu_8e", 8, 512, 128, 2048},
                                            {"small_cpu_4e", 4, 256, 256, 1024}}
                           : std::vector<D>{{"qwen3_30b_a3b", 128, 2048, 768, 131072},
                                            {"deepseek_v3_ep8", 32, 7168, 2048, 65536},
                                            {"mixtral_8x7b", 8, 4096, 14336, 16384},
                                            {"small_64e", 64, 1024, 512, 65536}};
  std::vector<Shape> out;
  for (const D& x : d) {
    Shape s;
    s.name = x.name;
    s.E = x.E;
    s.N = 2 * x.F;
    s.K = x.H;
    s.splits = own_splits(x.E, x.M);
    out.push_back(s);
  }
  return out;
}

double ms_of(const nlohmann::json& r, const char* key) {
  if (!r.contains(key) || !r[key].is_number()) return 0;
  return r[key].get<double>();
}

// Shapes and splits from torch_gemm_peers.json (bench/torch_grouped_gemm.py).
std::vector<Shape> peer_shapes(const std::string& path) {
  std::ifstream f(path);
  if (!f) die("cannot open --peer-json " + path);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) die(path + " is not JSON");
  std::vector<Shape> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const nlohmann::json& r = it.value();
    if (!r.is_object() || !r.contains("splits")) continue;
    Shape s;
    s.name = it.key();
    s.E = r.at("E").get<int64_t>();
    s.N = r.at("N").get<int64_t>();
    s.K = r.at("K").get<int64_t>();
    s.splits = r.at("splits").get<std::vector<int64_t>>();
    if (static_cast<int64_t>(s.splits.size()) != s.E) die(s.name + ": splits do not match E");
    for (int64_t v : s.splits)
      if (v % 32) die(s.name + ": split " + std::to_string(v) + " is not a multiple of 32");
    s.gmm_fprop = ms_of(r, "grouped_mm_fprop_ms");
    s.gmm_dgrad = ms_of(r, "grouped_mm_dgrad_ms");
    s.gmm_wgrad = ms_of(r, "grouped_mm_wgrad_ms");
    s.loop_fprop = ms_of(r, "loop_fprop_ms");
    s.scaled_fprop = ms_of(r, "scaled_grouped_mm_fprop_ms");
    out.push_back(s);
  }
  if (out.empty()) die(path + " has no shapes with splits (is it torch_gemm_peers.json?)");
  return out;
}

void check(const Status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", s.message().c_str());
    std::exit(1);
  }
}

// The speed of `ms` against `base_ms` ("1.05x": ms is 5% faster), or "-" where either is missing.
std::string ratio(double base_ms, double ms) {
  if (base_ms <= 0 || ms <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%.2fx", base_ms / ms);
  return b;
}

// Fills n BF16 values by tiling one random block of normal values (mean 0, deviation `sigma`):
// the distributions of the torch peer (X and dY N(0, 1), W N(0, 0.02^2)), since at the GPU's power
// limit the data's bits move the clock. GEMM timing needs random bits, not independent ones, and
// tiling keeps multi-GB fills to device copies.
class Filler {
 public:
  Filler(Backend& be, double sigma) : be_(be) {
    std::vector<uint16_t> h(kBlock);
    std::mt19937_64 rng(static_cast<uint64_t>(sigma * 1e6) + 1);
    std::normal_distribution<double> normal(0.0, sigma);
    for (int64_t i = 0; i < kBlock; ++i) h[i] = f32_to_bf16(static_cast<float>(normal(rng)));
    block_ = std::make_unique<DeviceBuffer>(be, kBlock * 2);
    be.copy(block_->get(), h.data(), kBlock * 2, Backend::CopyKind::kHostToDevice);
  }
  void fill(void* dst, int64_t n) {
    for (int64_t at = 0; at < n; at += kBlock)
      be_.copy(static_cast<uint16_t*>(dst) + at, block_->get(), std::min(kBlock, n - at) * 2,
               Backend::CopyKind::kDeviceToDevice);
  }

 private:
  static constexpr int64_t kBlock = (int64_t{1} << 23) + 7;  // odd: rows do not repeat in step
  Backend& be_;
  std::unique_ptr<DeviceBuffer> block_;
};

std::vector<const void*> cv(const std::vector<void*>& v) { return {v.begin(), v.end()}; }

// Device buffers of one shape, and the GEMM arguments of every (op, recipe).
class ShapeCase {
 public:
  ShapeCase(Backend& be, Filler& fill, Filler& fill_w, const Shape& s) : be_(be), s_(s) {
    const int64_t M = s.M(), N = s.N, K = s.K, E = s.E;
    x_ = buf(M * K * 2);
    dy_ = buf(M * N * 2);
    w_ = buf(E * N * K * 2);
    fill.fill(x_, M * K);
    fill.fill(dy_, M * N);
    fill_w.fill(w_, E * N * K);
    y_ = buf(M * N * 2);
    dx_ = buf(M * K * 2);
    dw_bf16_ = buf(E * N * K * 2);
    dw_f32_ = buf(E * N * K * 4);
    be.fill_zero(dw_f32_, E * N * K * 4);
  }

  GemmOperand bf16(void* base, bool per_expert, int64_t row_bytes) {
    GemmOperand o;
    o.format = OperandFormat::kBF16;
    o.data = cv(per_expert ? carve(base, s_.E, s_.N * s_.K * 2) : carve_rows(base, s_.splits, row_bytes));
    return o;
  }

  // MXFP8 E4M3 rowwise + columnwise copies of X (M, K), dY (M, N), W (E, N, K): one launch each.
  void quantize_mxfp8() {
    const int64_t M = s_.M(), N = s_.N, K = s_.K, E = s_.E;
    const Mxfp8Config cfg{DType::kE4M3, true, true, false};
    auto one = [&](void* src, int64_t rows_total, int64_t cols, const std::vector<int64_t>& rows,
                   Mx& q) {
      q.rd = buf(rows_total * cols);
      q.rs = buf(rows_total * cols / 32);
      q.cd = buf(rows_total * cols);
      q.cs = buf(rows_total * cols / 32);
      GroupedMatrices in;
      in.dtype = DType::kBF16;
      in.cols = cols;
      in.rows = rows;
      in.data = cv(carve_rows(src, rows, cols * 2));
      Mxfp8Outputs o{carve_rows(q.rd, rows, cols), carve_rows(q.rs, rows, cols / 32),
                     carve_rows(q.cd, rows, cols), carve_rows(q.cs, rows, cols / 32), {}, {}};
      check(ops::quantize_mxfp8(be_, in, cfg, o));
      q.o = o;
    };
    one(x_, M, K, s_.splits, mx_x_);
    one(dy_, M, N, s_.splits, mx_dy_);
    one(w_, E * N, K, std::vector<int64_t>(E, N), mx_w_);
    be_.synchronize();
  }

  // NVFP4: X and dY 1x16 rowwise + RHT columnwise (dY with stochastic rounding), W 2D 16x16.
  void quantize_nvfp4() {
    const int64_t M = s_.M(), N = s_.N, K = s_.K, E = s_.E;
    auto one = [&](void* src, int64_t rows_total, int64_t cols, const std::vector<int64_t>& rows,
                   const Nvfp4Config& cfg, Nv& q) {
      const int64_t G = static_cast<int64_t>(rows.size());
      q.rd = buf(rows_total * cols / 2);
      q.rs = buf(rows_total * cols / 16);
      q.cd = buf(rows_total * cols / 2);
      q.cs = buf(rows_total * cols / 16);
      void* ra = buf(G * 4);
      void* ca = buf(G * 4);
      GroupedMatrices in;
      in.dtype = DType::kBF16;
      in.cols = cols;
      in.rows = rows;
      in.data = cv(carve_rows(src, rows, cols * 2));
      Nvfp4Outputs o;
      o.row_data = carve_rows(q.rd, rows, cols / 2);
      o.row_scale = carve_rows(q.rs, rows, cols / 16);
      o.col_data = carve_rows(q.cd, rows, cols / 2);  // (cols, rows_g / 2) per group
      o.col_scale = carve_rows(q.cs, rows, cols / 16);
      o.row_amax = ra;
      o.col_amax = ca;
      check(ops::quantize_nvfp4(be_, in, cfg, o));
      q.o = o;
      // Decode scales from the amaxes (host round trip, outside any timing).
      for (int which = 0; which < 2; ++which) {
        std::vector<float> amax(G), sdec(G);
        be_.copy(amax.data(), which ? ca : ra, G * 4, Backend::CopyKind::kDeviceToHost);
        for (int64_t g = 0; g < G; ++g) sdec[g] = nvfp4_decode_scale(amax[g]);
        void* d = buf(G * 4);
        be_.copy(d, sdec.data(), G * 4, Backend::CopyKind::kHostToDevice);
        (which ? q.col_sdec : q.row_sdec) = d;
      }
    };
    Nvfp4Config act;
    act.rowwise = act.columnwise = act.rht = true;
    Nvfp4Config grad = act;
    grad.stochastic_rounding = true;
    grad.seed = 1234;
    Nvfp4Config wcfg;
    wcfg.rowwise = wcfg.columnwise = wcfg.two_d = true;
    one(x_, M, K, s_.splits, act, nv_x_);
    one(dy_, M, N, s_.splits, grad, nv_dy_);
    one(w_, E * N, K, std::vector<int64_t>(E, N), wcfg, nv_w_);
    be_.synchronize();
  }

  // Arguments of one (op, recipe). wgrad_acc: wgrad into the FP32 main_grad, accumulating.
  GroupedGemmArgs args(GemmOp op, OperandFormat f, bool wgrad_acc) {
    const int64_t N = s_.N, K = s_.K, E = s_.E;
    GroupedGemmArgs a;
    a.op = op;
    a.n = N;
    a.k = K;
    a.m = s_.splits;
    a.out_dtype = DType::kBF16;
    switch (op) {
      case GemmOp::kFprop: a.out = carve_rows(y_, s_.splits, N * 2); break;
      case GemmOp::kDgrad: a.out = carve_rows(dx_, s_.splits, K * 2); break;
      case GemmOp::kWgrad:
        a.out = wgrad_acc ? carve(dw_f32_, E, N * K * 4) : carve(dw_bf16_, E, N * K * 2);
        a.out_dtype = wgrad_acc ? DType::kF32 : DType::kBF16;
        a.accumulate = wgrad_acc;
        break;
    }
    auto mx = [&](const Mx& q, bool col) {
      GemmOperand o;
      o.format = OperandFormat::kMxfp8;
      o.element = DType::kE4M3;
      o.data = cv(col ? q.o.col_data : q.o.row_data);
      o.scale = cv(col ? q.o.col_scale : q.o.row_scale);
      return o;
    };
    auto nv = [&](const Nv& q, bool col) {
      GemmOperand o;
      o.format = OperandFormat::kNvfp4;
      o.data = cv(col ? q.o.col_data : q.o.row_data);
      o.scale = cv(col ? q.o.col_scale : q.o.row_scale);
      o.decode_scale = col ? q.col_sdec : q.row_sdec;
      return o;
    };
    switch (f) {
      case OperandFormat::kBF16:
        if (op == GemmOp::kFprop) a.lhs = bf16(x_, false, K * 2), a.rhs = bf16(w_, true, 0);
        if (op == GemmOp::kDgrad) a.lhs = bf16(dy_, false, N * 2), a.rhs = bf16(w_, true, 0);
        if (op == GemmOp::kWgrad) a.lhs = bf16(dy_, false, N * 2), a.rhs = bf16(x_, false, K * 2);
        break;
      case OperandFormat::kMxfp8:
        if (op == GemmOp::kFprop) a.lhs = mx(mx_x_, false), a.rhs = mx(mx_w_, false);
        if (op == GemmOp::kDgrad) a.lhs = mx(mx_dy_, false), a.rhs = mx(mx_w_, true);
        if (op == GemmOp::kWgrad) a.lhs = mx(mx_dy_, true), a.rhs = mx(mx_x_, true);
        break;
      case OperandFormat::kNvfp4:
        if (op == GemmOp::kFprop) a.lhs = nv(nv_x_, false), a.rhs = nv(nv_w_, false);
        if (op == GemmOp::kDgrad) a.lhs = nv(nv_dy_, false), a.rhs = nv(nv_w_, true);
        if (op == GemmOp::kWgrad) a.lhs = nv(nv_dy_, true), a.rhs = nv(nv_x_, true);
        break;
    }
    return a;
  }

  // The same call with the token counts in device memory (m_device, m_capacity = M): each
  // token-side operand as one packed buffer (its group-0 pointer). No host synchronisation.
  GroupedGemmArgs with_device_counts(GroupedGemmArgs a) {
    if (m_dev_ == nullptr) {
      m_dev_ = buf(s_.E * 8);
      be_.copy(m_dev_, s_.splits.data(), s_.E * 8, Backend::CopyKind::kHostToDevice);
    }
    a.m.clear();
    a.m_device = m_dev_;
    a.groups = s_.E;
    a.m_capacity = s_.M();
    auto packed = [](GemmOperand& o) {  // group 0's pointers start the packed buffers
      o.data = {o.data.at(0)};
      if (!o.scale.empty()) o.scale = {o.scale.at(0)};
    };
    packed(a.lhs);
    if (a.op == GemmOp::kWgrad)
      packed(a.rhs);
    else
      a.out.resize(1);
    return a;
  }

 private:
  struct Mx {
    void *rd = nullptr, *rs = nullptr, *cd = nullptr, *cs = nullptr;
    Mxfp8Outputs o;
  };
  struct Nv {
    void *rd = nullptr, *rs = nullptr, *cd = nullptr, *cs = nullptr;
    void *row_sdec = nullptr, *col_sdec = nullptr;
    Nvfp4Outputs o;
  };
  void* buf(int64_t bytes) {
    bufs_.push_back(std::make_unique<DeviceBuffer>(be_, static_cast<size_t>(std::max<int64_t>(bytes, 16))));
    return bufs_.back()->get();
  }

  Backend& be_;
  const Shape& s_;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs_;
  void *x_, *dy_, *w_, *y_, *dx_, *dw_bf16_, *dw_f32_;
  void* m_dev_ = nullptr;  // (E,) int64 splits, for with_device_counts
  Mx mx_x_, mx_dy_, mx_w_;
  Nv nv_x_, nv_dy_, nv_w_;
};

// The grouped GEMM policy of one measured route (everything else the defaults).
KernelPolicy policy(GemmImpl impl, Sm90Dequant dequant) {
  KernelPolicy p;
  p.gemm.impl = impl;
  p.gemm.dequant = dequant;
  return p;
}

const char* op_text(GemmOp op) {
  return op == GemmOp::kFprop ? "fprop" : op == GemmOp::kDgrad ? "dgrad" : "wgrad";
}

int run(const Options& o) {
  const Device dev = o.device == "cpu" ? Device::kCPU : Device::kCUDA;
  Result<Backend*> r = get_backend(dev);
  if (!r.is_ok()) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", r.status().message().c_str());
    return 1;
  }
  Backend& be = *r.value();
  std::vector<Shape> shapes;
  if (!o.peer_json.empty() && !o.small) {
    shapes = peer_shapes(o.peer_json);
  } else {
    if (!o.peer_json.empty()) std::printf("# --small: torch peer figures ignored (full shapes)\n");
    shapes = default_shapes(o.small);
  }
  if (!o.only.empty()) {
    std::vector<Shape> keep;
    for (const Shape& s : shapes)
      if (listed(o.only, s.name)) keep.push_back(s);
    shapes = keep;
  }

  std::printf("# bench_grouped_gemm on %s; median of %d back-to-back calls after %.0f ms of warm-up\n",
              be.name().c_str(), o.iters, o.warmup_ms);
  std::printf(
      "# FLOPs = 2*M*N*K per op (M = routed tokens incl. padding to 32); time = one grouped_gemm\n"
      "# call incl. the MXFP8/NVFP4 dequantize (a pre-pass, or inside the sm90 kernel: MXFP8 rowwise\n"
      "# copies by default); outputs BF16, wgrad+acc = FP32 main_grad\n"
      "# accumulate. Two implementations per case (GemmPolicy::impl): sm90 = the wgmma kernel,\n"
      "# cublas = one cuBLASLt matmul per group. vs_gmm = torch._grouped_mm BF16 ms of the same op /\n"
      "# our ms; vs_loop = per-expert torch.matmul loop (fprop); vs_fp8 = torch._scaled_grouped_mm\n"
      "# FP8 rowwise fprop ms / our sm90 ms. mxfp8 fprop on sm90 forced through the dequantize\n"
      "# pre-pass (Sm90Dequant::kNone): mx-pre;\n"
      "# bf16:d = the BF16 call with the token counts in device memory (m_device: packed token\n"
      "# buffers, no host sync; on CUDA the sm90 kernel)\n");
  std::printf("%-16s %-9s %-6s %9s %8s %9s %8s %8s %8s %8s %8s\n", "shape", "op", "recipe", "sm90_ms",
              "TFLOP/s", "cublas_ms", "TFLOP/s", "vs_gmm", "cub_gmm", "vs_loop", "vs_fp8");
  std::fflush(stdout);

  Filler act_filler(be, 1.0), weight_filler(be, 0.02);  // the torch peer's randn, randn * 0.02
  std::map<std::string, double> fprop_ms;  // shape/recipe -> sm90 ms, for the target checks
  for (const Shape& s : shapes) {
    ShapeCase sc(be, act_filler, weight_filler, s);
    sc.quantize_mxfp8();
    sc.quantize_nvfp4();
    const double flops = 2.0 * static_cast<double>(s.M()) * s.N * s.K;
    for (OperandFormat f : {OperandFormat::kBF16, OperandFormat::kMxfp8, OperandFormat::kNvfp4}) {
      const char* rname = f == OperandFormat::kBF16 ? "bf16" : f == OperandFormat::kMxfp8 ? "mxfp8" : "nvfp4";
      if (!listed(o.recipes, rname)) continue;
      for (int c = 0; c < 4; ++c) {
        const GemmOp op = c == 0 ? GemmOp::kFprop : c == 1 ? GemmOp::kDgrad : GemmOp::kWgrad;
        const bool acc = c == 3;
        const GroupedGemmArgs a = sc.args(op, f, acc);
        double ms[2] = {0, 0};  // sm90, cublas
        for (int impl = 0; impl < (o.no_cublas ? 1 : 2); ++impl) {
          const ScopedKernelPolicy use(policy(impl == 0 ? GemmImpl::kAuto : GemmImpl::kCublasLt,
                                              Sm90Dequant::kRowwiseMxfp8));
          check(ops::grouped_gemm(be, a));  // argument errors surface before timing
          ms[impl] = timed_ms(be, o, [&] { check(ops::grouped_gemm(be, a)); });
        }
        const double torch_ms = op == GemmOp::kFprop ? s.gmm_fprop
                                : op == GemmOp::kDgrad ? s.gmm_dgrad
                                                       : s.gmm_wgrad;
        const bool fp = op == GemmOp::kFprop;
        char cub_ms[16] = "-", cub_tf[16] = "-";
        if (ms[1] > 0) {
          std::snprintf(cub_ms, sizeof cub_ms, "%.3f", ms[1]);
          std::snprintf(cub_tf, sizeof cub_tf, "%.1f", flops / (ms[1] * 1e-3) / 1e12);
        }
        std::printf("%-16s %-9s %-6s %9.3f %8.1f %9s %8s %8s %8s %8s %8s\n", s.name.c_str(),
                    acc ? "wgrad+acc" : op_text(op), rname, ms[0], flops / (ms[0] * 1e-3) / 1e12,
                    cub_ms, cub_tf, ratio(torch_ms, ms[0]).c_str(),
                    ratio(torch_ms, ms[1]).c_str(), fp ? ratio(s.loop_fprop, ms[0]).c_str() : "-",
                    fp ? ratio(s.scaled_fprop, ms[0]).c_str() : "-");
        std::fflush(stdout);
        if (fp) fprop_ms[s.name + "/" + rname] = ms[0];
        if (f == OperandFormat::kBF16) {
          const GroupedGemmArgs d = sc.with_device_counts(a);
          check(ops::grouped_gemm(be, d));  // the default policy: the sm90 kernel where it applies
          const double t = timed_ms(be, o, [&] { check(ops::grouped_gemm(be, d)); });
          std::printf("%-16s %-9s %-6s %9.3f %8.1f %9s %8s %8s %8s %8s %8s\n", s.name.c_str(),
                      acc ? "wgrad+acc" : op_text(op), "bf16:d", t, flops / (t * 1e-3) / 1e12, "-",
                      "-", ratio(torch_ms, t).c_str(), "-", "-", "-");
          std::fflush(stdout);
        }
        if (fp && f == OperandFormat::kMxfp8) {  // the sm90 call forced through the pre-pass
          const ScopedKernelPolicy use(policy(GemmImpl::kAuto, Sm90Dequant::kNone));
          check(ops::grouped_gemm(be, a));
          const double t = timed_ms(be, o, [&] { check(ops::grouped_gemm(be, a)); });
          std::printf("%-16s %-9s %-6s %9.3f %8.1f %9s %8s %8s %8s %8s %8s\n", s.name.c_str(),
                      "fprop", "mx-pre", t, flops / (t * 1e-3) / 1e12, "-", "-",
                      ratio(torch_ms, t).c_str(), "-", "-", "-");
          std::fflush(stdout);
          fprop_ms[s.name + "/mx-pre"] = t;
        }
      }
    }
    if (s.gmm_fprop > 0)
      std::printf("# torch %s: grouped_mm fprop %.3f dgrad %.3f wgrad %.3f, loop fprop %.3f, "
                  "scaled_grouped_mm fp8 fprop %.3f ms\n",
                  s.name.c_str(), s.gmm_fprop, s.gmm_dgrad, s.gmm_wgrad, s.loop_fprop,
                  s.scaled_fprop);
  }
  // The targets: quantized-operand fprop speed over our BF16 fprop (sm90 kernel).
  for (const Shape& s : shapes) {
    const double bf = fprop_ms[s.name + "/bf16"], mx = fprop_ms[s.name + "/mxfp8"],
                 pre = fprop_ms[s.name + "/mx-pre"], nv = fprop_ms[s.name + "/nvfp4"];
    std::printf("# %s sm90: bf16 fprop vs torch._grouped_mm %s, mxfp8 / bf16 fprop speed %s "
                "(pre-pass %s), nvfp4 / bf16 %s\n",
                s.name.c_str(), ratio(s.gmm_fprop, bf).c_str(), ratio(bf, mx).c_str(),
                ratio(bf, pre).c_str(), ratio(bf, nv).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace packmoe

int main(int argc, char** argv) {
  packmoe::Options o;
  CLI::App app{"packmoe grouped GEMM benchmark"};
  app.add_option("--device", o.device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--peer-json", o.peer_json,
                 "torch_gemm_peers.json from bench/torch_grouped_gemm.py (shapes, splits, figures)");
  app.add_option("--iters", o.iters, "timed iterations (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup-ms", o.warmup_ms,
                 "untimed warm-up before each measurement, in ms of wall time (at least one call; "
                 "default 1500 on cuda, 200 on cpu)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--only", o.only, "comma-separated shape names");
  app.add_option("--recipes", o.recipes, "comma-separated subset of bf16,mxfp8,nvfp4")
      ->check([](const std::string& v) {
        for (size_t at = 0; at <= v.size();) {
          const size_t end = std::min(v.find(',', at), v.size());
          const std::string r = v.substr(at, end - at);
          if (r != "bf16" && r != "mxfp8" && r != "nvfp4") return "unknown recipe '" + r + "'";
          at = end + 1;
        }
        return std::string();
      });
  app.add_flag("--no-cublas", o.no_cublas, "time the sm90 kernel only (no cuBLASLt columns)");
  app.add_flag("--small", o.small, "small shapes (seconds on a CPU)");
  CLI11_PARSE(app, argc, argv);
  if (o.warmup_ms < 0) o.warmup_ms = o.device == "cuda" ? 1500 : 200;
  return packmoe::run(o);
}
