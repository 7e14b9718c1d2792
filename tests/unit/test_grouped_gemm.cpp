// Grouped GEMM CPU reference (backend/cpu/grouped_gemm_cpu.cpp) against an FP64 product of the
// operands decoded element by element in THIS file from the stored bytes, for fprop / dgrad / wgrad
// x BF16 / MXFP8 (E4M3, E5M2, 2D weights) / NVFP4 (2D weights, RHT + SR wgrad copies) x F32 / BF16
// output. Operands come from the CPU quantizers, so the stored layouts are the real ones. Also:
// packed vs per-expert pointers bitwise, main_grad accumulate / overwrite, empty groups, group
// routing, token counts on the "device" with packed token buffers, batch invariance of fprop /
// dgrad rows (bitwise, whatever the token count and the row's place), validation errors. Random inputs use a fresh seed, printed on failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }
#define RANDOM_SEED(name)             \
  const uint32_t name = fresh_seed(); \
  SCOPED_TRACE("random seed " + std::to_string(name))

constexpr double kF32Tol = 1e-5;         // relative Frobenius error of an F32 output
constexpr double kBf16Tol = 1.0 / 256;   // 2^-8: BF16 output, relative per element and Frobenius

// Test-side format: the GEMM format plus the MXFP8 element and weight scaling.
enum class Fmt { kBf16, kMxfp8E4m3, kMxfp8E4m3TwoD, kMxfp8E5m2, kNvfp4 };
constexpr Fmt kAllFmts[] = {Fmt::kBf16, Fmt::kMxfp8E4m3, Fmt::kMxfp8E4m3TwoD, Fmt::kMxfp8E5m2,
                            Fmt::kNvfp4};

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::kBf16: return "bf16";
    case Fmt::kMxfp8E4m3: return "mxfp8_e4m3";
    case Fmt::kMxfp8E4m3TwoD: return "mxfp8_e4m3_2d";
    case Fmt::kMxfp8E5m2: return "mxfp8_e5m2";
    case Fmt::kNvfp4: return "nvfp4";
  }
  return "?";
}
const char* op_name_of(GemmOp op) {
  return op == GemmOp::kFprop ? "fprop" : op == GemmOp::kDgrad ? "dgrad" : "wgrad";
}
OperandFormat operand_format(Fmt f) {
  return f == Fmt::kBf16 ? OperandFormat::kBF16
                         : f == Fmt::kNvfp4 ? OperandFormat::kNvfp4 : OperandFormat::kMxfp8;
}
DType mx_element(Fmt f) { return f == Fmt::kMxfp8E5m2 ? DType::kE5M2 : DType::kE4M3; }
int64_t token_align(Fmt f) { return f == Fmt::kBf16 ? 1 : f == Fmt::kNvfp4 ? 16 : 32; }

// ---- grouped bytes ------------------------------------------------------------------------------

constexpr uint8_t kSentinel = 0xFF;  // F32 and BF16 NaN: a stray write, or a read of it, shows
constexpr size_t kPad = 4;           // discrete copies start 4 bytes in: another alignment
constexpr size_t kGuard = 64;        // sentinel bytes behind every buffer

// One grouped tensor in both layouts: one packed buffer (group g at a running offset, as carved
// from an (E, N, K) pack or a (T, C) token matrix) and, after split(), a private copy of every
// group (the discrete layout), each between sentinel pad and guard bytes.
class GroupedBytes {
 public:
  GroupedBytes() = default;
  explicit GroupedBytes(const std::vector<size_t>& sizes) : sizes_(sizes) {
    size_t off = 0;
    for (size_t s : sizes) {
      offsets_.push_back(off);
      off += s;
    }
    packed_.assign(off + kGuard, kSentinel);
  }
  size_t groups() const { return sizes_.size(); }
  size_t size(size_t g) const { return sizes_[g]; }
  uint8_t* group(size_t g) { return packed_.data() + offsets_[g]; }
  const uint8_t* group(size_t g) const { return packed_.data() + offsets_[g]; }

  void split() {
    separate_.clear();
    for (size_t g = 0; g < groups(); ++g) {
      std::vector<uint8_t> b(kPad + sizes_[g] + kGuard, kSentinel);
      if (sizes_[g]) std::memcpy(b.data() + kPad, group(g), sizes_[g]);
      separate_.push_back(std::move(b));
    }
  }
  const uint8_t* bytes(size_t g, bool sep) const {
    return sep ? separate_[g].data() + kPad : group(g);
  }
  std::vector<void*> ptrs(bool sep) {
    std::vector<void*> p;
    for (size_t g = 0; g < groups(); ++g)
      p.push_back(sep ? separate_[g].data() + kPad : group(g));
    return p;
  }
  std::vector<const void*> cptrs(bool sep) {
    std::vector<const void*> p;
    for (void* q : ptrs(sep)) p.push_back(q);
    return p;
  }
  // Nothing was written outside the groups.
  bool guards_intact(bool sep) const {
    auto clean = [](const uint8_t* p, size_t n) {
      for (size_t i = 0; i < n; ++i)
        if (p[i] != kSentinel) return false;
      return true;
    };
    if (!sep) return clean(packed_.data() + packed_.size() - kGuard, kGuard);
    for (size_t g = 0; g < groups(); ++g)
      if (!clean(separate_[g].data(), kPad) ||
          !clean(separate_[g].data() + kPad + sizes_[g], kGuard))
        return false;
    return true;
  }
  const std::vector<uint8_t>& packed() const { return packed_; }

 private:
  std::vector<size_t> sizes_, offsets_;
  std::vector<uint8_t> packed_;
  std::vector<std::vector<uint8_t>> separate_;
};

// ---- operands -----------------------------------------------------------------------------------

enum class Role { kWeight, kActivation, kGradient };

struct Operand {
  OperandFormat format = OperandFormat::kBF16;
  DType element = DType::kE4M3;
  GroupedBytes data, scale;
  std::vector<float> decode;                 // (G,) NVFP4 S_dec
  std::vector<std::vector<double>> logical;  // per group, the logical (rows_g, cols) in FP64

  GemmOperand view(bool sep) {
    GemmOperand o;
    o.format = format;
    o.element = element;
    o.data = data.cptrs(sep);
    if (format != OperandFormat::kBF16) o.scale = scale.cptrs(sep);
    if (format == OperandFormat::kNvfp4) o.decode_scale = decode.data();
    return o;
  }
};

double fp8_value(uint8_t v, DType el) {
  return el == DType::kE5M2 ? e5m2_to_f32(v) : e4m3_to_f32(v);
}
uint8_t nibble(const uint8_t* d, int64_t i) { return (i & 1) ? (d[i / 2] >> 4) : (d[i / 2] & 0xF); }

// Group g's stored copy decoded to its LOGICAL (rows, cols) matrix in FP64, straight from the
// format definitions: MXFP8 fp8 * 2^(e8m0 - 127) with rowwise (rows, cols/32) or columnwise
// (rows/32, cols) scales; NVFP4 e2m1 * e4m3 * S_dec, the columnwise copy stored as (cols, rows).
std::vector<double> decode_logical(const Operand& o, size_t g, int64_t rows, int64_t cols,
                                   bool columnwise) {
  std::vector<double> x(rows * cols);
  const uint8_t* d = o.data.group(g);
  const uint8_t* s = o.format == OperandFormat::kBF16 ? nullptr : o.scale.group(g);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double v = 0;
      if (o.format == OperandFormat::kBF16) {
        uint16_t h;
        std::memcpy(&h, d + 2 * (r * cols + c), 2);
        v = bf16_to_f32(h);
      } else if (o.format == OperandFormat::kMxfp8) {
        const uint8_t code = columnwise ? s[(r / 32) * cols + c] : s[r * (cols / 32) + c / 32];
        v = fp8_value(d[r * cols + c], o.element) * std::ldexp(1.0, static_cast<int>(code) - 127);
      } else {
        const int64_t i = columnwise ? c * rows + r : r * cols + c;
        const uint8_t s_b = columnwise ? s[c * (rows / 16) + r / 16] : s[r * (cols / 16) + c / 16];
        v = static_cast<double>(e2m1_to_f32(nibble(d, i))) * e4m3_to_f32(s_b) *
            static_cast<double>(o.decode[g]);
      }
      x[r * cols + c] = v;
    }
  return x;
}

// Quantizes G groups of `hp` (group g is (rows[g], cols), groups one after another) into the copy
// a GEMM reads: `columnwise` = blocks along the rows (the GEMM reduces over them). Activations and
// gradients enter as BF16 (as in training), weights as F32 (from the FP32 master). Weights use 2D
// tiles (NVFP4 always, MXFP8 for kMxfp8E4m3TwoD); NVFP4 columnwise activations/gradients get the
// RHT; NVFP4 gradients get stochastic rounding.
Operand make_operand(Fmt fmt, Role role, bool columnwise, const std::vector<float>& hp,
                     const std::vector<int64_t>& rows, int64_t cols, uint64_t seed) {
  const size_t groups = rows.size();
  Operand o;
  o.format = operand_format(fmt);
  o.element = mx_element(fmt);
  std::vector<uint16_t> hp_bf16(hp.size());
  for (size_t i = 0; i < hp.size(); ++i) hp_bf16[i] = f32_to_bf16(hp[i]);

  GroupedMatrices in;
  in.dtype = role == Role::kWeight ? DType::kF32 : DType::kBF16;
  in.cols = cols;
  in.rows = rows;
  int64_t row0 = 0;
  for (size_t g = 0; g < groups; ++g) {
    in.data.push_back(in.dtype == DType::kF32 ? static_cast<const void*>(hp.data() + row0 * cols)
                                              : hp_bf16.data() + row0 * cols);
    row0 += rows[g];
  }
  auto sizes = [&](int64_t num, int64_t den) {  // bytes per group: rows * cols * num / den
    std::vector<size_t> s;
    for (int64_t r : rows) s.push_back(static_cast<size_t>(r * cols * num / den));
    return s;
  };

  if (o.format == OperandFormat::kBF16) {
    o.data = GroupedBytes(sizes(2, 1));
    row0 = 0;
    for (size_t g = 0; g < groups; ++g) {
      std::memcpy(o.data.group(g), hp_bf16.data() + row0 * cols, rows[g] * cols * 2);
      row0 += rows[g];
    }
  } else if (o.format == OperandFormat::kMxfp8) {
    o.data = GroupedBytes(sizes(1, 1));
    o.scale = GroupedBytes(sizes(1, 32));  // (rows, cols/32) and (rows/32, cols) alike
    Mxfp8Config cfg;
    cfg.element = o.element;
    cfg.rowwise = !columnwise;
    cfg.columnwise = columnwise;
    cfg.two_d = role == Role::kWeight && fmt == Fmt::kMxfp8E4m3TwoD;
    Mxfp8Outputs out;
    (columnwise ? out.col_data : out.row_data) = o.data.ptrs(false);
    (columnwise ? out.col_scale : out.row_scale) = o.scale.ptrs(false);
    const Status st = quantize_mxfp8_cpu(in, cfg, out);
    EXPECT_TRUE(st.is_ok()) << st.message();
  } else {
    o.data = GroupedBytes(sizes(1, 2));
    o.scale = GroupedBytes(sizes(1, 16));  // (rows, cols/16) and (cols, rows/16) alike
    Nvfp4Config cfg;
    cfg.rowwise = !columnwise;
    cfg.columnwise = columnwise;
    cfg.two_d = role == Role::kWeight;
    cfg.rht = columnwise && role != Role::kWeight;
    cfg.stochastic_rounding = role == Role::kGradient;
    cfg.seed = seed;
    std::vector<float> amax(groups, -1.0f);
    Nvfp4Outputs out;
    (columnwise ? out.col_data : out.row_data) = o.data.ptrs(false);
    (columnwise ? out.col_scale : out.row_scale) = o.scale.ptrs(false);
    (columnwise ? out.col_amax : out.row_amax) = amax.data();
    const Status st = quantize_nvfp4_cpu(in, cfg, out);
    EXPECT_TRUE(st.is_ok()) << st.message();
    for (float a : amax) o.decode.push_back(nvfp4_decode_scale(a));
  }
  for (size_t g = 0; g < groups; ++g)
    o.logical.push_back(decode_logical(o, g, rows[g], cols, columnwise));
  o.data.split();
  if (o.format != OperandFormat::kBF16) o.scale.split();
  return o;
}

// ---- problems -----------------------------------------------------------------------------------

struct Case {
  GemmOp op = GemmOp::kFprop;
  Fmt fmt = Fmt::kBf16;
  DType out_dtype = DType::kF32;
  bool accumulate = false;
  int64_t n = 32, k = 32;
  std::vector<int64_t> m;
  std::vector<double> group_scale;  // optional per-group magnitude of every operand
};

std::string describe(const Case& c) {
  std::string s = std::string(op_name_of(c.op)) + " " + fmt_name(c.fmt) + " out=" +
                  (c.out_dtype == DType::kF32 ? "f32" : "bf16") +
                  (c.accumulate ? " accumulate" : "") + " N=" + std::to_string(c.n) +
                  " K=" + std::to_string(c.k) + " m={";
  for (int64_t v : c.m) s += std::to_string(v) + ",";
  return s + "}";
}

struct Problem {
  Case c;
  Operand lhs, rhs;
  GroupedBytes out;                      // initial contents; split() holds the discrete copy
  std::vector<std::vector<double>> ref;  // per group: the FP64 product (without main_grad)
  std::vector<std::vector<float>> old;   // per group: F32 main_grad before a wgrad

  int64_t out_rows(size_t g) const { return c.op == GemmOp::kWgrad ? c.n : c.m[g]; }
  int64_t out_cols() const { return c.op == GemmOp::kFprop ? c.n : c.k; }

  GroupedGemmArgs args(bool sep) {
    GroupedGemmArgs a;
    a.op = c.op;
    a.n = c.n;
    a.k = c.k;
    a.m = c.m;
    a.lhs = lhs.view(sep);
    a.rhs = rhs.view(sep);
    a.out_dtype = c.out_dtype;
    a.out = out.ptrs(sep);
    a.accumulate = c.accumulate;
    return a;
  }
};

std::vector<double> product(GemmOp op, const std::vector<double>& a, const std::vector<double>& b,
                            int64_t m, int64_t n, int64_t k) {
  std::vector<double> y;
  if (op == GemmOp::kFprop) {  // Y (m, N) = X (m, K) . W (N, K)^T
    y.assign(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t r = 0; r < k; ++r) y[i * n + j] += a[i * k + r] * b[j * k + r];
  } else if (op == GemmOp::kDgrad) {  // dX (m, K) = dY (m, N) . W (N, K)
    y.assign(m * k, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < k; ++j) y[i * k + j] += a[i * n + r] * b[r * k + j];
  } else {  // dW (N, K) = dY (m, N)^T . X (m, K)
    y.assign(n * k, 0.0);
    for (int64_t t = 0; t < m; ++t)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) y[i * k + j] += a[t * n + i] * b[t * k + j];
  }
  return y;
}

Problem build_problem(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> log2_scale(-3.0, 3.0);
  const size_t groups = c.m.size();
  int64_t tokens = 0;
  for (int64_t v : c.m) tokens += v;

  Problem p;
  p.c = c;
  // Every group gets its own magnitude (and so its own NVFP4 amax / decode scale): a result that
  // lands in another group's slice, or a wrong group's alpha, is far off.
  std::vector<double> scale = c.group_scale;
  for (size_t g = scale.size(); g < groups; ++g) scale.push_back(std::exp2(log2_scale(rng)));
  auto tokens_of = [&](int64_t cols) {  // (T, cols), group g's rows scaled by scale[g]
    std::vector<float> v;
    for (size_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < c.m[g] * cols; ++i)
        v.push_back(static_cast<float>(normal(rng) * scale[g]));
    return v;
  };
  auto weights = [&]() {  // (E, N, K)
    std::vector<float> v;
    for (size_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < c.n * c.k; ++i)
        v.push_back(static_cast<float>(normal(rng) * scale[groups - 1 - g]));
    return v;
  };
  const std::vector<int64_t> w_rows(groups, c.n);
  const uint64_t sr_seed = rng();
  switch (c.op) {
    case GemmOp::kFprop:
      p.lhs = make_operand(c.fmt, Role::kActivation, false, tokens_of(c.k), c.m, c.k, sr_seed);
      p.rhs = make_operand(c.fmt, Role::kWeight, false, weights(), w_rows, c.k, sr_seed);
      break;
    case GemmOp::kDgrad:
      p.lhs = make_operand(c.fmt, Role::kGradient, false, tokens_of(c.n), c.m, c.n, sr_seed);
      p.rhs = make_operand(c.fmt, Role::kWeight, true, weights(), w_rows, c.k, sr_seed);
      break;
    case GemmOp::kWgrad:
      p.lhs = make_operand(c.fmt, Role::kGradient, true, tokens_of(c.n), c.m, c.n, sr_seed);
      p.rhs = make_operand(c.fmt, Role::kActivation, true, tokens_of(c.k), c.m, c.k, sr_seed);
      break;
  }
  for (size_t g = 0; g < groups; ++g)
    p.ref.push_back(product(c.op, p.lhs.logical[g], p.rhs.logical[g], c.m[g], c.n, c.k));

  const size_t elem = c.out_dtype == DType::kF32 ? 4 : 2;
  std::vector<size_t> sizes;
  for (size_t g = 0; g < groups; ++g) sizes.push_back(p.out_rows(g) * p.out_cols() * elem);
  p.out = GroupedBytes(sizes);  // all sentinel: fprop / dgrad must not read or skip any of it
  if (c.op == GemmOp::kWgrad && c.out_dtype == DType::kF32) {
    // A random main_grad of the product's size: accumulate must add to it, overwrite replace it.
    for (size_t g = 0; g < groups; ++g) {
      double ss = 0;
      for (double v : p.ref[g]) ss += v * v;
      const double rms = ss > 0 ? std::sqrt(ss / p.ref[g].size()) : 1.0;
      std::vector<float> o(c.n * c.k);
      for (float& v : o) v = static_cast<float>(normal(rng) * rms);
      std::memcpy(p.out.group(g), o.data(), o.size() * 4);
      p.old.push_back(std::move(o));
    }
  }
  p.out.split();
  return p;
}

std::vector<double> read_out(const GroupedBytes& out, size_t g, bool sep, DType dtype) {
  const size_t count = out.size(g) / (dtype == DType::kF32 ? 4 : 2);
  std::vector<double> v(count);
  const uint8_t* b = out.bytes(g, sep);
  for (size_t i = 0; i < count; ++i) {
    if (dtype == DType::kF32) {
      float f;
      std::memcpy(&f, b + 4 * i, 4);
      v[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      v[i] = bf16_to_f32(h);
    }
  }
  return v;
}

// Relative Frobenius error of got vs want (NaN anywhere gives NaN, which fails every bound).
double rel_frobenius(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

// F32: relative Frobenius error <= 1e-5. BF16: every element within 2^-8 of its own magnitude
// (plus 1e-5 of the RMS for FP32 summation error in elements that cancel), and 2^-8 Frobenius.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, DType dtype,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double rel = rel_frobenius(got, want);
  if (dtype == DType::kF32) {
    EXPECT_LE(rel, kF32Tol) << what;
    return;
  }
  EXPECT_LE(rel, kBf16Tol) << what;
  double ss = 0;
  for (double v : want) ss += v * v;
  const double rms = std::sqrt(ss / want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= kBf16Tol * std::fabs(want[i]) + kF32Tol * rms))
      if (bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": first bad element " << first << " got " << got[first]
                     << " want " << want[first];
}

// Runs the case with packed pointers through grouped_gemm_cpu and with per-group buffers through
// the Backend interface; checks the two agree bitwise and the result against the FP64 reference.
void run_and_check(Problem& p) {
  SCOPED_TRACE(describe(p.c));
  const Status packed = grouped_gemm_cpu(p.args(false));
  ASSERT_TRUE(packed.is_ok()) << packed.message();
  const Status discrete = ops::grouped_gemm(cpu_backend(), p.args(true));
  ASSERT_TRUE(discrete.is_ok()) << discrete.message();
  EXPECT_TRUE(p.out.guards_intact(false)) << "packed output written past its end";
  EXPECT_TRUE(p.out.guards_intact(true)) << "a per-group output written outside its slice";

  const Case& c = p.c;
  if (c.out_dtype == DType::kBF16) {
    // BF16 output is the F32 result rounded once (RNE): the same call with an F32 output.
    std::vector<size_t> sizes;
    for (size_t g = 0; g < c.m.size(); ++g) sizes.push_back(p.out.size(g) * 2);
    GroupedBytes f32(sizes);
    GroupedGemmArgs a = p.args(false);
    a.out_dtype = DType::kF32;
    a.out = f32.ptrs(false);
    ASSERT_TRUE(grouped_gemm_cpu(a).is_ok());
    for (size_t g = 0; g < c.m.size(); ++g)
      for (size_t i = 0; i < p.out.size(g) / 2; ++i) {
        float v;
        uint16_t h;
        std::memcpy(&v, f32.group(g) + 4 * i, 4);
        std::memcpy(&h, p.out.bytes(g, false) + 2 * i, 2);
        ASSERT_EQ(h, f32_to_bf16(v)) << "group " << g << " element " << i
                                     << ": BF16 output is not RNE of the F32 result";
      }
  }
  for (size_t g = 0; g < c.m.size(); ++g) {
    const std::string what = "group " + std::to_string(g) + " (m_g = " + std::to_string(c.m[g]) + ")";
    EXPECT_EQ(0, std::memcmp(p.out.bytes(g, false), p.out.bytes(g, true), p.out.size(g)))
        << what << ": packed and per-expert pointers give different bytes";
    const std::vector<double> got = read_out(p.out, g, false, c.out_dtype);
    if (c.op != GemmOp::kWgrad) {
      if (c.m[g] > 0) expect_close(got, p.ref[g], c.out_dtype, what);
      continue;  // an empty group's (zero-size) slice: the guards above show it is not written
    }
    if (c.m[g] == 0) {
      if (c.accumulate) {
        EXPECT_EQ(0, std::memcmp(p.out.bytes(g, false), p.old[g].data(), p.out.size(g)))
            << what << ": an empty group must leave main_grad untouched";
      } else {
        for (double v : got) ASSERT_EQ(v, 0.0) << what << ": an empty group overwrites zeros";
        for (size_t i = 0; i < p.out.size(g); ++i)
          ASSERT_EQ(p.out.bytes(g, false)[i], 0) << what << ": zeros are +0";
      }
      continue;
    }
    if (c.accumulate) {
      std::vector<double> want(p.ref[g]);
      for (size_t i = 0; i < want.size(); ++i) want[i] += p.old[g][i];
      expect_close(got, want, c.out_dtype, what + " (main_grad + product)");
      // The product itself, seen through the accumulation: old and product have the same size,
      // so dropping either one is far outside this bound.
      std::vector<double> delta(got);
      for (size_t i = 0; i < delta.size(); ++i) delta[i] -= p.old[g][i];
      EXPECT_LE(rel_frobenius(delta, p.ref[g]), 4 * kF32Tol) << what << " (added product)";
    } else {
      expect_close(got, p.ref[g], c.out_dtype, what);
    }
  }
}

// ---- the sweep: every op x format x output -----------------------------------------------------

struct OpFmt {
  GemmOp op;
  Fmt fmt;
};

void PrintTo(const OpFmt& p, std::ostream* os) { *os << op_name_of(p.op) << " " << fmt_name(p.fmt); }

class GroupedGemmSweep : public ::testing::TestWithParam<OpFmt> {};

std::vector<OpFmt> all_op_fmts() {
  std::vector<OpFmt> v;
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad})
    for (Fmt f : kAllFmts)
      if (!(op == GemmOp::kWgrad && f == Fmt::kMxfp8E4m3TwoD))  // 2D is a weight option
        v.push_back({op, f});
  return v;
}

// Shapes: E = 1; empty groups first, in the middle and last; a random uneven split; groups of
// several 256-token panels (the CPU reference's wgrad sums panels). m_g are multiples of the
// format's token block (BF16: any count, odd ones included).
std::vector<Case> shapes_for(GemmOp op, Fmt fmt, std::mt19937_64& rng) {
  const int64_t a = token_align(fmt);
  const int64_t dims[] = {32, 64, 96};
  auto dim = [&]() { return dims[rng() % 3]; };
  auto tokens = [&](int64_t lo) { return a * (lo + static_cast<int64_t>(rng() % (128 / a + 1 - lo))); };
  std::vector<Case> v;
  Case c;
  c.op = op;
  c.fmt = fmt;
  c.n = dim(), c.k = dim(), c.m = {tokens(1)};
  v.push_back(c);
  c.n = dim(), c.k = dim(), c.m = {0, tokens(1), 0, tokens(1), 0};
  v.push_back(c);
  const int64_t groups = 2 + static_cast<int64_t>(rng() % 5);
  c.n = dim(), c.k = dim(), c.m.clear();
  for (int64_t g = 0; g < groups; ++g) c.m.push_back(tokens(0));
  c.m[rng() % groups] = tokens(1);  // at least one non-empty group
  v.push_back(c);
  c.n = 32, c.k = 64;
  c.m = a == 1 ? std::vector<int64_t>{517, 0, 301} : std::vector<int64_t>{544, 0, 288};
  v.push_back(c);
  return v;
}

TEST_P(GroupedGemmSweep, MatchesFp64ReferenceAndIsLayoutIndependent) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  const OpFmt pf = GetParam();
  struct Out {
    DType dtype;
    bool accumulate;
  };
  std::vector<Out> outs = {{DType::kF32, false}, {DType::kBF16, false}};
  if (pf.op == GemmOp::kWgrad) outs.push_back({DType::kF32, true});
  for (const Out& o : outs)
    for (Case c : shapes_for(pf.op, pf.fmt, rng)) {
      c.out_dtype = o.dtype;
      c.accumulate = o.accumulate;
      Problem p = build_problem(c, rng());
      run_and_check(p);
      if (HasFatalFailure()) return;
    }
}

INSTANTIATE_TEST_SUITE_P(AllOpsFormats, GroupedGemmSweep, ::testing::ValuesIn(all_op_fmts()),
                         [](const ::testing::TestParamInfo<OpFmt>& info) {
                           return std::string(op_name_of(info.param.op)) + "_" +
                                  fmt_name(info.param.fmt);
                         });

// ---- group routing ------------------------------------------------------------------------------

// Equal-size groups (so a swapped slice would fit) with magnitudes 2^0, 2^6, 2^12 apart and empty
// groups between them: every slice must match its own group's product and be far from every other
// group's; empty main_grad slices stay untouched (accumulate) or become zero (overwrite).
TEST(GroupedGemmRouting, EachGroupLandsInItsOwnSlice) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad})
    for (Fmt fmt : kAllFmts)
      for (bool accumulate : {false, true}) {
        if (accumulate && op != GemmOp::kWgrad) continue;
        Case c;
        c.op = op;
        c.fmt = fmt;
        c.accumulate = accumulate;
        c.n = 64;
        c.k = 32;
        c.m = {0, 64, 64, 0, 64, 0};
        c.group_scale = {1.0, 1.0, 64.0, 1.0, 4096.0, 1.0};
        Problem p = build_problem(c, rng());
        run_and_check(p);
        if (HasFatalFailure()) return;
        SCOPED_TRACE(describe(c));
        for (size_t g = 0; g < c.m.size(); ++g)
          for (size_t h = 0; h < c.m.size(); ++h) {
            if (g == h || c.m[g] == 0 || c.m[h] == 0) continue;
            std::vector<double> got = read_out(p.out, g, false, c.out_dtype);
            if (accumulate)
              for (size_t i = 0; i < got.size(); ++i) got[i] -= p.old[g][i];
            EXPECT_GT(rel_frobenius(got, p.ref[h]), 0.5)
                << "group " << g << "'s result looks like group " << h << "'s";
          }
      }
}

// A quantized token-side copy kept as its values only (GemmOperand::values_only: BF16 values
// given, no data or scale) gives the bytes of the quantized copy itself: the CPU reads the values
// where it would decode the bytes. The values come from this file's FP64 decode (exact in BF16;
// NVFP4 without S_dec, which stays the GEMM's alpha). Copies stored like their logical matrix:
// MXFP8 lhs of every op and wgrad rhs, NVFP4 lhs of fprop and dgrad.
TEST(GroupedGemmValuesOnly, SameBytesAsTheQuantizedCopy) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad})
    for (Fmt fmt : {Fmt::kMxfp8E4m3, Fmt::kMxfp8E5m2, Fmt::kNvfp4}) {
      if (fmt == Fmt::kNvfp4 && op == GemmOp::kWgrad) continue;  // transposed copies
      Case c;
      c.op = op;
      c.fmt = fmt;
      c.n = 64;
      c.k = 96;
      c.m = {64, 0, 32, 96};
      SCOPED_TRACE(describe(c));
      Problem p = build_problem(c, rng());
      GroupedGemmArgs a = p.args(false);
      ASSERT_TRUE(grouped_gemm_cpu(a).is_ok());
      // The same call with the token-side copies as values, into a second output.
      const size_t G = c.m.size();
      std::vector<size_t> out_sizes;
      for (size_t g = 0; g < G; ++g) out_sizes.push_back(p.out.size(g));
      GroupedBytes out2(out_sizes);
      std::vector<std::vector<uint16_t>> lhs_values(G), rhs_values(G);
      auto values_only = [&](GemmOperand& o, const Operand& src,
                             std::vector<std::vector<uint16_t>>& values) {
        o.data.clear();
        o.scale.clear();
        for (size_t g = 0; g < G; ++g) {
          for (double v : src.logical[g]) {
            const double x = src.format == OperandFormat::kNvfp4 ? v / src.decode[g] : v;
            const uint16_t h = f32_to_bf16(static_cast<float>(x));
            ASSERT_EQ(static_cast<double>(bf16_to_f32(h)), x) << "a value is not exact in BF16";
            values[g].push_back(h);
          }
          o.bf16.push_back(values[g].data());
        }
      };
      GroupedGemmArgs b = a;
      values_only(b.lhs, p.lhs, lhs_values);
      if (op == GemmOp::kWgrad) values_only(b.rhs, p.rhs, rhs_values);
      ASSERT_TRUE(b.lhs.values_only());
      b.out = out2.ptrs(false);
      const Status st = grouped_gemm_cpu(b);
      ASSERT_TRUE(st.is_ok()) << st.message();
      for (size_t g = 0; g < G; ++g)
        EXPECT_EQ(0, std::memcmp(p.out.bytes(g, false), out2.bytes(g, false), p.out.size(g)))
            << "group " << g << ": values-only copy gives other bytes";
    }
}

// ---- token counts in backend memory: packed token buffers ------------------------------------

// `b`'s groups back to back (the packed layout), then `tail` bytes: random garbage for an input
// (a read past the last group shows), sentinels for an output (a write past it shows).
std::vector<uint8_t> packed_with_tail(const GroupedBytes& b, size_t tail, std::mt19937_64* garbage) {
  std::vector<uint8_t> v(b.packed().begin(), b.packed().end() - kGuard);
  for (size_t i = 0; i < tail; ++i)
    v.push_back(garbage != nullptr ? static_cast<uint8_t>((*garbage)()) : kSentinel);
  return v;
}

// Uneven counts (multiples of the format's block), some groups empty, at least one not.
std::vector<int64_t> random_counts(Fmt fmt, std::mt19937_64& rng) {
  const int64_t a = token_align(fmt);
  std::vector<int64_t> m(3 + rng() % 4);
  for (int64_t& v : m) v = rng() % 3 == 0 ? 0 : a * static_cast<int64_t>(rng() % (96 / a + 1));
  m[rng() % m.size()] = a * (1 + static_cast<int64_t>(rng() % 3));
  return m;
}

// The m_device form (token-side operands one packed buffer each, of m_capacity rows > the sum,
// garbage in the unused tail) gives the bytes of the host-m form with per-group pointers.
TEST(GroupedGemmTokenCounts, PackedDeviceCountsMatchPerGroupPointers) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad})
    for (Fmt fmt : {Fmt::kBf16, Fmt::kMxfp8E4m3, Fmt::kMxfp8E5m2, Fmt::kNvfp4})
      for (int variant = 0; variant < (op == GemmOp::kWgrad ? 3 : 2); ++variant) {
        Case c;
        c.op = op;
        c.fmt = fmt;
        c.out_dtype = variant == 1 ? DType::kBF16 : DType::kF32;
        c.accumulate = variant == 2;
        c.n = 32 * (1 + static_cast<int64_t>(rng() % 3));
        c.k = 32 * (1 + static_cast<int64_t>(rng() % 3));
        c.m = random_counts(fmt, rng);
        Problem p = build_problem(c, rng());
        SCOPED_TRACE(describe(c));
        const Status ref = grouped_gemm_cpu(p.args(true));  // per-group (discrete) pointers
        ASSERT_TRUE(ref.is_ok()) << ref.message();

        int64_t sum = 0;
        for (int64_t v : c.m) sum += v;
        const int64_t capacity = sum + token_align(fmt) * (1 + static_cast<int64_t>(rng() % 3));
        GroupedGemmArgs a = p.args(false);
        const TokenStrides ts = token_strides(a);
        const size_t tail = static_cast<size_t>(capacity - sum);
        std::vector<uint8_t> lhs_d = packed_with_tail(p.lhs.data, tail * ts.lhs_data, &rng);
        std::vector<uint8_t> lhs_s, rhs_d, rhs_s, out;
        a.lhs.data = {lhs_d.data()};
        if (a.lhs.format != OperandFormat::kBF16) {
          lhs_s = packed_with_tail(p.lhs.scale, tail * ts.lhs_scale, &rng);
          a.lhs.scale = {lhs_s.data()};
        }
        if (op == GemmOp::kWgrad) {
          rhs_d = packed_with_tail(p.rhs.data, tail * ts.rhs_data, &rng);
          a.rhs.data = {rhs_d.data()};
          if (a.rhs.format != OperandFormat::kBF16) {
            rhs_s = packed_with_tail(p.rhs.scale, tail * ts.rhs_scale, &rng);
            a.rhs.scale = {rhs_s.data()};
          }
        } else {
          out = packed_with_tail(p.out, tail * ts.out, nullptr);
          a.out = {out.data()};
        }
        const std::vector<int64_t> m_dev = c.m;  // device memory is host memory on the CPU
        a.m.clear();
        a.m_device = m_dev.data();
        a.groups = static_cast<int64_t>(m_dev.size());
        a.m_capacity = capacity;
        const Status st = ops::grouped_gemm(cpu_backend(), a);
        ASSERT_TRUE(st.is_ok()) << st.message();

        size_t at = 0;
        for (size_t g = 0; g < c.m.size(); ++g) {
          const uint8_t* got = op == GemmOp::kWgrad ? p.out.bytes(g, false) : out.data() + at;
          EXPECT_EQ(0, std::memcmp(got, p.out.bytes(g, true), p.out.size(g)))
              << "group " << g << ": device counts and per-group pointers give different bytes";
          at += p.out.size(g);
        }
        for (size_t i = at; i < out.size(); ++i)
          ASSERT_EQ(out[i], kSentinel) << "an output row past the last group was written";
      }
}

// m_device calls with bad counts or pointer lists fail with one clear line and write nothing.
TEST(GroupedGemmTokenCounts, BadPackedCallsFailCleanly) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  struct Bad {
    const char* name;
    GemmOp op;
    std::vector<int64_t> m;  // device counts
    int64_t capacity;
    const char* expect;
    void (*mutate)(GroupedGemmArgs&, const std::vector<void*>& per_group);
  };
  const auto none = [](GroupedGemmArgs&, const std::vector<void*>&) {};
  const Bad cases[] = {
      {"counts over m_capacity", GemmOp::kFprop, {64, 32}, 64, "more than m_capacity", none},
      {"misaligned count", GemmOp::kWgrad, {48, 16}, 128, "multiple of 32", none},
      {"negative count", GemmOp::kDgrad, {-32, 32}, 128, "non-negative", none},
      {"no m_capacity", GemmOp::kFprop, {32, 32}, 0, "m_capacity", none},
      {"m_capacity not a multiple of 32", GemmOp::kFprop, {32, 32}, 80, "m_capacity", none},
      {"G lhs pointers for a packed buffer", GemmOp::kFprop, {32, 32}, 64, "one packed buffer",
       [](GroupedGemmArgs& a, const std::vector<void*>& pg) { a.lhs.data = {pg[0], pg[1]}; }},
      {"G out pointers for a packed buffer", GemmOp::kDgrad, {32, 32}, 64, "one packed buffer",
       [](GroupedGemmArgs& a, const std::vector<void*>& pg) { a.out = pg; }},
      {"G lhs scale pointers", GemmOp::kWgrad, {32, 32}, 64, "one packed buffer",
       [](GroupedGemmArgs& a, const std::vector<void*>& pg) { a.lhs.scale = {pg[0], pg[1]}; }},
      {"one weight pointer for G groups", GemmOp::kFprop, {32, 32}, 64, "is per group",
       [](GroupedGemmArgs& a, const std::vector<void*>&) { a.rhs.data.pop_back(); }},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.name);
    Case c;
    c.op = b.op;
    c.fmt = Fmt::kMxfp8E4m3;
    c.n = 64;
    c.k = 64;
    c.m = {32, 32};
    Problem p = build_problem(c, rng());
    GroupedGemmArgs a = p.args(false);
    const std::vector<void*> per_group = p.out.ptrs(false);
    a.lhs.data.resize(1);
    a.lhs.scale.resize(1);
    if (b.op == GemmOp::kWgrad) {
      a.rhs.data.resize(1);
      a.rhs.scale.resize(1);
    } else {
      a.out.resize(1);
    }
    a.m.clear();
    a.m_device = b.m.data();
    a.groups = static_cast<int64_t>(b.m.size());
    a.m_capacity = b.capacity;
    b.mutate(a, per_group);
    const std::vector<uint8_t> before = p.out.packed();
    const Status st = ops::grouped_gemm(cpu_backend(), a);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(b.expect), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << "one line: " << st.message();
    EXPECT_EQ(before, p.out.packed()) << "a failed call wrote output";
  }
}

// ---- validation ---------------------------------------------------------------------------------

// Every malformed call returns a non-ok Status naming the problem and writes no output byte.
// Batch invariance: a token row's fprop / dgrad output depends on that row and the weight only.
// The same rows computed alone (m = 1), among a few others and deep inside a large call (past the
// 64-row tiles and a 256-row panel) give the same bits, F32 and BF16 outputs.
TEST(GroupedGemmBatchInvariance, ARowsBitsDoNotDependOnTheOtherRows) {
  RANDOM_SEED(seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Shape {
    int64_t n, k;
  };
  for (const Shape sh : {Shape{48, 32}, Shape{130, 40}, Shape{96, 520}}) {
    for (const GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad}) {
      for (const DType out : {DType::kF32, DType::kBF16}) {
        const int64_t red = op == GemmOp::kFprop ? sh.k : sh.n;   // lhs row length
        const int64_t cols = op == GemmOp::kFprop ? sh.n : sh.k;  // output row length
        std::vector<uint16_t> w(sh.n * sh.k);
        for (uint16_t& v : w) v = f32_to_bf16(nd(rng));
        // A call of m rows whose lhs rows are `rows`; returns the output's bytes per row.
        auto run = [&](const std::vector<uint16_t>& lhs, int64_t m) {
          std::vector<uint8_t> y(dtype_bytes_for(out, static_cast<size_t>(m * cols)));
          GroupedGemmArgs a;
          a.op = op;
          a.n = sh.n;
          a.k = sh.k;
          a.m = {m};
          a.lhs.data = {lhs.data()};
          a.rhs.data = {w.data()};
          a.out_dtype = out;
          a.out = {y.data()};
          EXPECT_TRUE(grouped_gemm_cpu(a).is_ok());
          return y;
        };
        const int64_t big = 300;
        std::vector<uint16_t> lhs(big * red);
        for (uint16_t& v : lhs) v = f32_to_bf16(nd(rng));
        const std::vector<uint8_t> all = run(lhs, big);
        const size_t row_bytes = all.size() / big;
        for (const int64_t r : {int64_t{0}, int64_t{9}, int64_t{63}, int64_t{200}, big - 1}) {
          const std::vector<uint16_t> one(lhs.begin() + r * red, lhs.begin() + (r + 1) * red);
          const std::vector<uint8_t> alone = run(one, 1);
          const int64_t few = std::min<int64_t>(r + 1, 5);  // rows r - few + 1 .. r
          const std::vector<uint16_t> some(lhs.begin() + (r - few + 1) * red,
                                           lhs.begin() + (r + 1) * red);
          const std::vector<uint8_t> among = run(some, few);
          const std::vector<uint8_t> want(all.begin() + r * row_bytes,
                                          all.begin() + (r + 1) * row_bytes);
          EXPECT_EQ(alone, want) << "row " << r << " alone, N " << sh.n << " K " << sh.k;
          EXPECT_EQ(std::vector<uint8_t>(among.end() - row_bytes, among.end()), want)
              << "row " << r << " among " << few << ", N " << sh.n << " K " << sh.k;
        }
      }
    }
  }
}

TEST(GroupedGemmValidation, BadCallsFailCleanlyAndTouchNothing) {
  RANDOM_SEED(seed);
  std::mt19937_64 rng(seed);
  struct Bad {
    const char* name;
    Fmt fmt;
    GemmOp op;
    const char* expect;  // a piece of the message
    void (*mutate)(GroupedGemmArgs&);
  };
  static std::vector<int64_t> device_m;  // a valid m for the m_device cases
  const Bad cases[] = {
      {"mxfp8 m_g not a multiple of 32", Fmt::kMxfp8E4m3, GemmOp::kWgrad, "multiple of 32",
       [](GroupedGemmArgs& a) { a.m = {64, 16}; }},
      {"nvfp4 m_g not a multiple of 16", Fmt::kNvfp4, GemmOp::kFprop, "multiple of 16",
       [](GroupedGemmArgs& a) { a.m = {40, 32}; }},
      {"negative m_g", Fmt::kBf16, GemmOp::kFprop, "negative",
       [](GroupedGemmArgs& a) { a.m = {-1, 32}; }},
      {"mismatched formats", Fmt::kMxfp8E4m3, GemmOp::kFprop, "one format",
       [](GroupedGemmArgs& a) { a.rhs.format = OperandFormat::kBF16; }},
      {"accumulate with fprop", Fmt::kBf16, GemmOp::kFprop, "accumulate",
       [](GroupedGemmArgs& a) { a.accumulate = true; }},
      {"accumulate into bf16", Fmt::kBf16, GemmOp::kWgrad, "accumulate",
       [](GroupedGemmArgs& a) {
         a.accumulate = true;
         a.out_dtype = DType::kBF16;
       }},
      {"output dtype e4m3", Fmt::kBf16, GemmOp::kFprop, "f32 or bf16",
       [](GroupedGemmArgs& a) { a.out_dtype = DType::kE4M3; }},
      {"too few lhs pointers", Fmt::kMxfp8E4m3, GemmOp::kDgrad, "data pointers",
       [](GroupedGemmArgs& a) { a.lhs.data.pop_back(); }},
      {"bf16 values of a weight", Fmt::kMxfp8E4m3, GemmOp::kFprop, "never for a weight",
       [](GroupedGemmArgs& a) { a.rhs.bf16 = a.rhs.data; }},
      {"bf16 values of a bf16 operand", Fmt::kBf16, GemmOp::kDgrad, "quantized token-side",
       [](GroupedGemmArgs& a) { a.lhs.bf16 = a.lhs.data; }},
      {"values-only copy with too few bf16 pointers", Fmt::kMxfp8E4m3, GemmOp::kWgrad,
       "bf16 pointers", [](GroupedGemmArgs& a) {
         a.rhs.bf16 = a.rhs.data;
         a.rhs.bf16.pop_back();
         a.rhs.data.clear();
         a.rhs.scale.clear();
       }},
      {"too many output pointers", Fmt::kBf16, GemmOp::kWgrad, "output pointers",
       [](GroupedGemmArgs& a) { a.out.push_back(a.out[0]); }},
      {"too few rhs scale pointers", Fmt::kNvfp4, GemmOp::kWgrad, "scale pointers",
       [](GroupedGemmArgs& a) { a.rhs.scale.pop_back(); }},
      {"null scale of a non-empty group", Fmt::kMxfp8E4m3, GemmOp::kFprop, "scale",
       [](GroupedGemmArgs& a) { a.rhs.scale[1] = nullptr; }},
      {"mxfp8 element e2m1", Fmt::kMxfp8E4m3, GemmOp::kFprop, "e4m3 or e5m2",
       [](GroupedGemmArgs& a) { a.lhs.element = a.rhs.element = DType::kE2M1; }},
      {"N not a multiple of 32", Fmt::kMxfp8E4m3, GemmOp::kFprop, "multiples of 32",
       [](GroupedGemmArgs& a) { a.n = 48; }},
      {"K not a multiple of 16", Fmt::kNvfp4, GemmOp::kDgrad, "multiples of 16",
       [](GroupedGemmArgs& a) { a.k = 40; }},
      {"missing lhs decode scales", Fmt::kNvfp4, GemmOp::kFprop, "decode scales",
       [](GroupedGemmArgs& a) { a.lhs.decode_scale = nullptr; }},
      {"missing rhs decode scales", Fmt::kNvfp4, GemmOp::kWgrad, "decode scales",
       [](GroupedGemmArgs& a) { a.rhs.decode_scale = nullptr; }},
      {"null output of a non-empty group", Fmt::kBf16, GemmOp::kDgrad, "output pointer",
       [](GroupedGemmArgs& a) { a.out[0] = nullptr; }},
      {"m and m_device both given", Fmt::kBf16, GemmOp::kFprop, "not both",
       [](GroupedGemmArgs& a) {
         device_m = a.m;
         a.m_device = device_m.data();
         a.groups = 2;
       }},
      {"no token counts", Fmt::kBf16, GemmOp::kFprop, "token counts",
       [](GroupedGemmArgs& a) { a.m.clear(); }},
      {"m_device without groups", Fmt::kBf16, GemmOp::kFprop, "groups",
       [](GroupedGemmArgs& a) {
         device_m = a.m;
         a.m.clear();
         a.m_device = device_m.data();
       }},
      {"groups disagrees with m", Fmt::kBf16, GemmOp::kFprop, "groups",
       [](GroupedGemmArgs& a) { a.groups = 3; }},
      {"m_capacity with host m", Fmt::kBf16, GemmOp::kFprop, "m_device calls only",
       [](GroupedGemmArgs& a) { a.m_capacity = 128; }},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.name);
    Case c;
    c.op = b.op;
    c.fmt = b.fmt;
    c.n = 64;
    c.k = 64;
    c.m = {64, 32};
    Problem p = build_problem(c, rng());
    for (bool sep : {false, true}) {
      GroupedGemmArgs a = p.args(sep);
      b.mutate(a);
      const std::vector<uint8_t> before = p.out.packed();
      const Status st = sep ? ops::grouped_gemm(cpu_backend(), a) : grouped_gemm_cpu(a);
      ASSERT_FALSE(st.is_ok());
      EXPECT_NE(st.message().find(b.expect), std::string::npos) << st.message();
      EXPECT_EQ(before, p.out.packed()) << "a failed call wrote output";
      EXPECT_TRUE(p.out.guards_intact(true));
      for (size_t g = 0; g < 2; ++g)
        if (sep) {
          std::vector<uint8_t> init(p.out.size(g));
          std::memcpy(init.data(), p.out.group(g), init.size());  // split() copied these bytes
          EXPECT_EQ(0, std::memcmp(p.out.bytes(g, true), init.data(), init.size()))
              << "a failed call wrote output";
        }
    }
  }
}

}  // namespace
}  // namespace packmoe
