// CUDA grouped GEMM (backend/ops/gemm.h) against an FP64 reference computed here from the very
// bytes the GPU reads (operands quantized by the CPU quantizers, decoded in double with
// core/codecs.h): relative Frobenius error <= 1e-5 for FP32 output. Every case runs on each
// implementation (cuBLASLt, and the sm_90a wgmma kernel with its own tile choice and forced tile
// widths 256 / 128, clusters of 2 / 1 and small grids, so CTAs walk many tiles), each three ways:
// packed operands / host m, per-expert buffers / host m, and packed token buffers / device m
// (m_capacity past the last group, garbage in the unused rows); the three outputs must be the
// same bytes, and the sm_90a variants must agree with each other byte for byte. Sentinel gaps
// catch writes outside a group's slice. The sm_90a kernel's streaming dequantize of every
// quantized recipe must give the pre-pass's bytes. Variants are chosen through the KernelPolicy
// (backend/cuda/kernel_policy.h). Device counts: a call captured in a CUDA
// graph (which fails on any host synchronisation) and replayed with new counts and values gives
// the bytes of an eager host-m call. Skips when no GPU is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"  // the backend's stream, for CUDA-graph capture
#include "backend/cuda/kernel_policy.h"
#include "backend/device_buffer.h"
#include "backend/ops/gemm.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

constexpr uint8_t kGap = 0xA5;   // bytes between regions: must survive every call
constexpr uint8_t kUnset = 0xFF;  // output regions before an overwrite: NaN in F32 and BF16
constexpr double kTolF32 = 1e-5;
constexpr double kTolBF16 = 4e-3;  // one BF16 rounding of the output (unit roundoff 2^-8)

Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}

#define SKIP_WITHOUT_GPU()        \
  Backend* gpu = gpu_or_null();   \
  if (gpu == nullptr) GTEST_SKIP() << "no usable GPU: " << get_backend(Device::kCUDA).status().message()

// ---- G regions of one device buffer, mirrored on the host --------------------------------------

enum class Placement {
  kPacked,      // back to back (a packed (E, N, K) weight, carve_rows activations)
  kDiscrete,    // 256-byte aligned regions with gaps, like per-expert allocations
  kMisaligned,  // discrete, shifted 2 bytes off 16-byte alignment
};

class Regions {
 public:
  // `tail`: bytes kept after the last region (a packed token buffer's rows past the last group).
  Regions(Backend& gpu, const std::vector<size_t>& bytes, Placement pl, size_t tail = 0) {
    size_t at = 0;
    for (size_t b : bytes) {
      if (pl != Placement::kPacked) at = (at + 64 + 255) / 256 * 256 + (pl == Placement::kMisaligned ? 2 : 0);
      off_.push_back(at);
      size_.push_back(b);
      at += b;
    }
    total_ = at + tail + 256;
    host_.assign(total_, kGap);
    dev_ = std::make_unique<DeviceBuffer>(gpu, total_);
  }
  uint8_t* host(size_t g) { return host_.data() + off_[g]; }
  // Random bytes in the `bytes` after the last region (an input's unused tail: a read of it shows).
  void garbage_after_last(size_t bytes, std::mt19937_64& rng) {
    const size_t end = off_.back() + size_.back();
    PACKMOE_CHECK(end + bytes <= total_, "garbage past the buffer");
    for (size_t i = 0; i < bytes; ++i) host_[end + i] = static_cast<uint8_t>(rng());
  }
  size_t size(size_t g) const { return size_[g]; }
  size_t groups() const { return off_.size(); }
  void upload() { dev_->upload(host_); }
  std::vector<uint8_t> download() const { return dev_->download(); }
  std::vector<void*> ptrs() const {
    std::vector<void*> p;
    for (size_t o : off_) p.push_back(static_cast<uint8_t*>(dev_->get()) + o);
    return p;
  }
  std::vector<const void*> cptrs() const {
    std::vector<const void*> p;
    for (void* q : ptrs()) p.push_back(q);
    return p;
  }
  // Bytes of `d` (a download) outside every region that differ from what was uploaded.
  size_t gap_changes(const std::vector<uint8_t>& d) const {
    std::vector<bool> in(total_, false);
    for (size_t g = 0; g < off_.size(); ++g)
      for (size_t i = 0; i < size_[g]; ++i) in[off_[g] + i] = true;
    size_t bad = 0;
    for (size_t i = 0; i < total_; ++i)
      if (!in[i] && d[i] != host_[i]) ++bad;
    return bad;
  }
  const uint8_t* region(const std::vector<uint8_t>& d, size_t g) const { return d.data() + off_[g]; }

 private:
  std::vector<size_t> off_, size_;
  size_t total_ = 0;
  std::vector<uint8_t> host_;
  std::unique_ptr<DeviceBuffer> dev_;
};

// ---- operands on the host ------------------------------------------------------------------------

// One stored copy of one operand (the table in backend/ops/gemm.h), per group.
struct HostOperand {
  OperandFormat format = OperandFormat::kBF16;
  DType element = DType::kE4M3;
  bool columnwise = false;  // MXFP8 columnwise scales
  bool transposed = false;  // NVFP4 columnwise copy: stored (lc, lr)
  std::vector<int64_t> lrows;  // logical shape per group
  int64_t lcols = 0;
  std::vector<std::vector<uint8_t>> data, scale;
  std::vector<float> s_dec;  // NVFP4 per-group decode scale
  std::vector<std::vector<uint8_t>> bf16;  // given BF16 values (GemmOperand::bf16), or none
  bool values_only = false;  // with bf16: the GEMM gets no data or scale (GemmOperand::values_only)

  // Logical (lrows, lcols) row-major values in double; NVFP4 without S_dec (it is alpha).
  std::vector<double> decode(size_t g) const {
    const int64_t lr = lrows[g], lc = lcols;
    std::vector<double> v(lr * lc);
    const int64_t sr = transposed ? lc : lr, sc = transposed ? lr : lc;  // stored shape
    for (int64_t r = 0; r < sr; ++r)
      for (int64_t c = 0; c < sc; ++c) {
        double x = 0;
        const int64_t i = r * sc + c;
        switch (format) {
          case OperandFormat::kBF16: {
            uint16_t h;
            std::memcpy(&h, data[g].data() + 2 * i, 2);
            x = bf16_to_f32(h);
            break;
          }
          case OperandFormat::kMxfp8: {
            const uint8_t s = columnwise ? scale[g][(r / 32) * sc + c] : scale[g][r * (sc / 32) + c / 32];
            const uint8_t e = data[g][i];
            const double ev = element == DType::kE5M2 ? e5m2_to_f32(e) : e4m3_to_f32(e);
            x = s == 0xFF ? NAN : std::ldexp(ev, static_cast<int>(s) - 127);
            break;
          }
          case OperandFormat::kNvfp4: {
            const uint8_t byte = data[g][i / 2];
            const uint8_t code = (i % 2) ? (byte >> 4) : (byte & 0xF);
            const uint8_t s = scale[g][r * (sc / 16) + c / 16];
            x = static_cast<double>(e2m1_to_f32(code)) * static_cast<double>(e4m3_to_f32(s));
            break;
          }
        }
        if (transposed)
          v[c * lc + r] = x;
        else
          v[r * lc + c] = x;
      }
    return v;
  }
};

struct Logical {  // G row-major BF16 matrices (rows_g, cols)
  std::vector<int64_t> rows;
  int64_t cols = 0;
  std::vector<std::vector<uint16_t>> bf16;
};

// Random BF16 values: normal, each row scaled by 2^e, e in [e_lo, e_hi]; groups outside `keep` are
// zero (the group-slice test). `keep` < 0 keeps all.
Logical make_logical(const std::vector<int64_t>& rows, int64_t cols, int keep, std::mt19937_64& rng,
                     int e_lo = -3, int e_hi = 3) {
  Logical l{rows, cols, {}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t g = 0; g < rows.size(); ++g) {
    std::vector<uint16_t> v(rows[g] * cols);
    for (int64_t r = 0; r < rows[g]; ++r) {
      const int e = static_cast<int>(rng() % static_cast<uint64_t>(e_hi - e_lo + 1)) + e_lo;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = (keep < 0 || keep == static_cast<int>(g)) ? std::ldexp(normal(rng), e) : 0.0f;
        v[r * cols + c] = f32_to_bf16(x);
      }
    }
    l.bf16.push_back(std::move(v));
  }
  return l;
}

enum class Role { kWeight, kActivation, kGradient };

struct Recipe {
  OperandFormat format = OperandFormat::kBF16;
  DType element = DType::kE4M3;       // MXFP8 element of activations and weights
  DType grad_element = DType::kE4M3;  // MXFP8 element of dY
  bool rht = false;                   // NVFP4: RHT on the columnwise (wgrad) copies
  bool sr = false;                    // NVFP4: stochastic rounding of dY
  std::string name() const {
    switch (format) {
      case OperandFormat::kBF16: return "bf16";
      case OperandFormat::kMxfp8:
        return std::string("mxfp8 ") + (element == DType::kE5M2 ? "e5m2" : "e4m3") +
               (grad_element != element ? "/dY e5m2" : "");
      case OperandFormat::kNvfp4: return std::string("nvfp4") + (rht ? " rht" : "") + (sr ? "+sr" : "");
    }
    return "?";
  }
};

// Quantizes `l` with the CPU quantizer and keeps the copy a GEMM reducing over the logical rows
// (`reduce_rows`) or columns reads.
HostOperand make_operand(const Logical& l, const Recipe& rc, Role role, bool reduce_rows, uint64_t seed) {
  HostOperand o;
  o.format = rc.format;
  o.lrows = l.rows;
  o.lcols = l.cols;
  const size_t G = l.rows.size();
  GroupedMatrices in;
  in.dtype = DType::kBF16;
  in.cols = l.cols;
  in.rows = l.rows;
  for (const auto& v : l.bf16) in.data.push_back(v.data());
  auto alloc = [&](std::vector<std::vector<uint8_t>>& dst, auto bytes_of) {
    std::vector<void*> p;
    dst.resize(G);
    for (size_t g = 0; g < G; ++g) {
      dst[g].assign(std::max<size_t>(1, bytes_of(g)), 0);
      p.push_back(dst[g].data());
    }
    return p;
  };
  switch (rc.format) {
    case OperandFormat::kBF16:
      for (const auto& v : l.bf16) {
        o.data.emplace_back(reinterpret_cast<const uint8_t*>(v.data()),
                            reinterpret_cast<const uint8_t*>(v.data()) + v.size() * 2);
      }
      break;
    case OperandFormat::kMxfp8: {
      o.element = role == Role::kGradient ? rc.grad_element : rc.element;
      o.columnwise = reduce_rows;
      std::vector<std::vector<uint8_t>> rd, rs, cd, cs;
      Mxfp8Outputs out;
      out.row_data = alloc(rd, [&](size_t g) { return l.rows[g] * l.cols; });
      out.row_scale = alloc(rs, [&](size_t g) { return l.rows[g] * l.cols / 32; });
      out.col_data = alloc(cd, [&](size_t g) { return l.rows[g] * l.cols; });
      out.col_scale = alloc(cs, [&](size_t g) { return l.rows[g] * l.cols / 32; });
      const Mxfp8Config cfg{o.element, true, true, false};
      const Status s = quantize_mxfp8_cpu(in, cfg, out);
      EXPECT_TRUE(s.is_ok()) << s.message();
      o.data = reduce_rows ? cd : rd;
      o.scale = reduce_rows ? cs : rs;
      break;
    }
    case OperandFormat::kNvfp4: {
      o.transposed = reduce_rows;
      std::vector<std::vector<uint8_t>> rd, rs, cd, cs;
      std::vector<float> ra(G), ca(G);
      Nvfp4Outputs out;
      out.row_data = alloc(rd, [&](size_t g) { return l.rows[g] * l.cols / 2; });
      out.row_scale = alloc(rs, [&](size_t g) { return l.rows[g] * l.cols / 16; });
      out.col_data = alloc(cd, [&](size_t g) { return l.rows[g] * l.cols / 2; });
      out.col_scale = alloc(cs, [&](size_t g) { return l.rows[g] * l.cols / 16; });
      out.row_amax = ra.data();
      out.col_amax = ca.data();
      Nvfp4Config cfg;
      cfg.rowwise = cfg.columnwise = true;
      cfg.two_d = role == Role::kWeight;
      cfg.rht = role != Role::kWeight && rc.rht;
      cfg.stochastic_rounding = role == Role::kGradient && rc.sr;
      cfg.seed = seed;
      const Status s = quantize_nvfp4_cpu(in, cfg, out);
      EXPECT_TRUE(s.is_ok()) << s.message();
      o.data = reduce_rows ? cd : rd;
      o.scale = reduce_rows ? cs : rs;
      for (size_t g = 0; g < G; ++g) o.s_dec.push_back(nvfp4_decode_scale(reduce_rows ? ca[g] : ra[g]));
      break;
    }
  }
  return o;
}

// ---- implementations ------------------------------------------------------------------------------

// Which grouped GEMM the CUDA backend runs, as the GemmPolicy (backend/cuda/kernel_policy.h) that
// selects it. Shapes the sm_90a kernel does not take (odd row lengths) and GPUs other than sm_90
// run cuBLASLt under every variant.
struct Variant {
  const char* name;
  GemmPolicy gemm;  // impl, dequant, tile_n, cluster, max_ctas (0: the heuristic / whole GPU)
  bool sm90() const { return gemm.impl == GemmImpl::kAuto; }
};
constexpr Sm90Dequant kDefaultDequant = Sm90Dequant::kRowwiseMxfp8;
const Variant kVariants[] = {
    {"cublas", {GemmImpl::kCublasLt, kDefaultDequant, 0, 0, 0}},
    {"sm90", {GemmImpl::kAuto, kDefaultDequant, 0, 0, 0}},
    {"sm90/n256/c2/4", {GemmImpl::kAuto, kDefaultDequant, 256, 2, 4}},
    {"sm90/n128/c1/1", {GemmImpl::kAuto, kDefaultDequant, 128, 1, 1}},
    {"sm90/n256/c1", {GemmImpl::kAuto, kDefaultDequant, 256, 1, 0}},
    {"sm90/n128/c2/2", {GemmImpl::kAuto, kDefaultDequant, 128, 2, 2}},
};

// The policy of `gemm` (everything else default) for the life of the object.
KernelPolicy gemm_policy(const GemmPolicy& gemm) {
  KernelPolicy p;
  p.gemm = gemm;
  return p;
}
class UseVariant {
 public:
  explicit UseVariant(const Variant& v) : scoped_(gemm_policy(v.gemm)) {}

 private:
  ScopedKernelPolicy scoped_;
};

// ---- one case ------------------------------------------------------------------------------------

struct Case {
  GemmOp op = GemmOp::kFprop;
  Recipe recipe;
  DType out = DType::kF32;
  std::vector<int64_t> m;
  int64_t n = 0, k = 0;
  bool accumulate = false;
  int only_group = -1;  // group-slice test: fprop/dgrad weights / wgrad tokens zero elsewhere
  bool misaligned = false;  // second run with BF16 pointers off 16-byte alignment (staging path)
  std::string tag;
};

const char* op_name_of(GemmOp op) {
  return op == GemmOp::kFprop ? "fprop" : op == GemmOp::kDgrad ? "dgrad" : "wgrad";
}

// Device copies of one operand in a placement.
struct DevOperand {
  std::unique_ptr<Regions> data, scale, bf16;
  std::unique_ptr<DeviceBuffer> s_dec;
  GemmOperand view;
};

// Bytes one token adds to a token-side copy of `h` (data, scale): BF16 2 per column, MXFP8 1 and
// 1/32, NVFP4 1/2 and 1/16; lcols is the token row length in every stored layout.
std::pair<size_t, size_t> token_bytes(const HostOperand& h) {
  const size_t c = static_cast<size_t>(h.lcols);
  switch (h.format) {
    case OperandFormat::kBF16: return {2 * c, 0};
    case OperandFormat::kMxfp8: return {c, c / 32};
    case OperandFormat::kNvfp4: return {c / 2, c / 16};
  }
  return {0, 0};
}

// `tail_tokens` > 0: a token-side operand for an m_device call, packed (group after group) with
// that many token rows of random garbage after the last group, given as ONE pointer.
DevOperand upload_operand(Backend& gpu, const HostOperand& h, Placement pl, size_t tail_tokens = 0) {
  DevOperand d;
  const size_t G = h.lrows.size();
  std::vector<size_t> db, sb;
  for (size_t g = 0; g < G; ++g) {
    const size_t elems = static_cast<size_t>(h.lrows[g] * h.lcols);
    db.push_back(h.format == OperandFormat::kBF16 ? 2 * elems
                 : h.format == OperandFormat::kMxfp8 ? elems : elems / 2);
    sb.push_back(h.format == OperandFormat::kMxfp8 ? elems / 32 : elems / 16);
  }
  const bool packed_tokens = tail_tokens > 0;
  if (packed_tokens) pl = Placement::kPacked;
  const auto [tok_data, tok_scale] = token_bytes(h);
  std::mt19937_64 garbage(G * 7919 + tail_tokens);
  d.data = std::make_unique<Regions>(gpu, db, pl, tail_tokens * tok_data);
  for (size_t g = 0; g < G; ++g)
    if (db[g]) std::memcpy(d.data->host(g), h.data[g].data(), db[g]);
  if (packed_tokens) d.data->garbage_after_last(tail_tokens * tok_data, garbage);
  d.data->upload();
  d.view.format = h.format;
  d.view.element = h.element;
  d.view.data = d.data->cptrs();
  if (packed_tokens) d.view.data.resize(1);
  if (h.format != OperandFormat::kBF16) {
    const Placement spl = pl == Placement::kMisaligned ? Placement::kDiscrete : pl;
    d.scale = std::make_unique<Regions>(gpu, sb, spl, tail_tokens * tok_scale);
    for (size_t g = 0; g < G; ++g)
      if (sb[g]) std::memcpy(d.scale->host(g), h.scale[g].data(), sb[g]);
    if (packed_tokens) d.scale->garbage_after_last(tail_tokens * tok_scale, garbage);
    d.scale->upload();
    d.view.scale = d.scale->cptrs();
    if (packed_tokens) d.view.scale.resize(1);
  }
  if (!h.bf16.empty()) {
    std::vector<size_t> bb;
    for (size_t g = 0; g < G; ++g) bb.push_back(static_cast<size_t>(h.lrows[g] * h.lcols) * 2);
    d.bf16 = std::make_unique<Regions>(gpu, bb, pl);
    for (size_t g = 0; g < G; ++g)
      if (bb[g]) std::memcpy(d.bf16->host(g), h.bf16[g].data(), bb[g]);
    d.bf16->upload();
    d.view.bf16 = d.bf16->cptrs();
    if (h.values_only) d.view.data.clear(), d.view.scale.clear();
  }
  if (h.format == OperandFormat::kNvfp4) {
    d.s_dec = std::make_unique<DeviceBuffer>(gpu, G * sizeof(float));
    std::vector<uint8_t> b(G * sizeof(float));
    std::memcpy(b.data(), h.s_dec.data(), b.size());
    d.s_dec->upload(b);
    d.view.decode_scale = d.s_dec->get();
  }
  return d;
}

struct RunOut {
  std::vector<std::vector<uint8_t>> regions;  // per group output bytes
  size_t gap_changes = 0;
  Status status;
};

// Unused token rows past the last group in an m_device run: a few blocks of the format.
int64_t tail_tokens_of(const Case& c) { return 3 * std::max<int64_t>(16, gemm_token_alignment(c.recipe.format)); }

// Runs the case on the GPU with the operands and outputs in `pl` and m on the host or, with
// `m_device`, in device memory with the token-side operands and outputs packed into one buffer
// each of m_capacity = sum(m) + tail_tokens_of(c) rows (garbage in the unused input rows; the
// unused output rows are gap bytes that must survive) and the weight-side ones in `pl`.
RunOut run_gpu(Backend& gpu, const Case& c, const HostOperand& lhs, const HostOperand& rhs,
               const std::vector<std::vector<uint8_t>>& out_init, Placement pl, bool m_device) {
  RunOut r;
  const size_t G = c.m.size();
  const bool wgrad = c.op == GemmOp::kWgrad;
  const size_t tail = m_device ? static_cast<size_t>(tail_tokens_of(c)) : 0;
  DevOperand dl = upload_operand(gpu, lhs, pl, tail);
  DevOperand dr = upload_operand(gpu, rhs, pl, wgrad ? tail : 0);
  std::vector<size_t> ob;
  for (size_t g = 0; g < G; ++g) ob.push_back(out_init[g].size());
  const bool packed_out = m_device && !wgrad;
  const size_t out_row = static_cast<size_t>(c.op == GemmOp::kFprop ? c.n : c.k) *
                         (c.out == DType::kBF16 ? 2 : 4);
  Regions out(gpu, ob, packed_out ? Placement::kPacked : pl, packed_out ? tail * out_row : 0);
  for (size_t g = 0; g < G; ++g)
    if (ob[g]) std::memcpy(out.host(g), out_init[g].data(), ob[g]);
  out.upload();
  GroupedGemmArgs a;
  a.op = c.op;
  a.n = c.n;
  a.k = c.k;
  a.lhs = dl.view;
  a.rhs = dr.view;
  a.out_dtype = c.out;
  a.out = out.ptrs();
  if (packed_out) a.out.resize(1);
  a.accumulate = c.accumulate;
  std::unique_ptr<DeviceBuffer> md;
  if (m_device) {
    md = std::make_unique<DeviceBuffer>(gpu, G * sizeof(int64_t));
    std::vector<uint8_t> b(G * sizeof(int64_t));
    std::memcpy(b.data(), c.m.data(), b.size());
    md->upload(b);
    a.m_device = md->get();
    a.groups = static_cast<int64_t>(G);
    int64_t sum = 0;
    for (int64_t v : c.m) sum += v;
    a.m_capacity = sum + static_cast<int64_t>(tail);
  } else {
    a.m = c.m;
  }
  r.status = ops::grouped_gemm(gpu, a);
  gpu.synchronize();
  const std::vector<uint8_t> d = out.download();
  r.gap_changes = out.gap_changes(d);
  for (size_t g = 0; g < G; ++g) {
    const uint8_t* p = out.region(d, g);
    r.regions.emplace_back(p, p + ob[g]);
  }
  return r;
}

// Runs the case twice, under the policies `first` and then `second` (the previous policy restored
// afterwards), and counts the groups whose output bytes differ between the two runs. Both runs
// must succeed and leave every byte outside the group slices alone.
struct PolicyRunsDiff {
  size_t bytes = 0;
  size_t differing_groups = 0;
};
PolicyRunsDiff run_under_policies(Backend& gpu, const Case& c, const HostOperand& lhs,
                                  const HostOperand& rhs, const std::vector<std::vector<uint8_t>>& init,
                                  Placement pl, bool m_device, const GemmPolicy& first,
                                  const GemmPolicy& second) {
  RunOut a, b;
  {
    const ScopedKernelPolicy use(gemm_policy(first));
    a = run_gpu(gpu, c, lhs, rhs, init, pl, m_device);
  }
  {
    const ScopedKernelPolicy use(gemm_policy(second));
    b = run_gpu(gpu, c, lhs, rhs, init, pl, m_device);
  }
  EXPECT_TRUE(a.status.is_ok()) << "first policy: " << a.status.message();
  EXPECT_TRUE(b.status.is_ok()) << "second policy: " << b.status.message();
  EXPECT_EQ(a.gap_changes, 0u) << "bytes outside the group slices changed (first policy)";
  EXPECT_EQ(b.gap_changes, 0u) << "bytes outside the group slices changed (second policy)";
  PolicyRunsDiff d;
  if (!a.status.is_ok() || !b.status.is_ok()) return d;
  for (size_t g = 0; g < c.m.size(); ++g) {
    d.bytes += b.regions[g].size();
    if (b.regions[g] != a.regions[g]) ++d.differing_groups;
  }
  return d;
}

std::vector<std::vector<uint8_t>> check_variant(
    Backend& gpu, const Case& c, const Variant& variant, const HostOperand& lhs,
    const HostOperand& rhs, const std::vector<std::vector<uint8_t>>& init,
    const std::vector<std::vector<double>>& ref, const std::vector<bool>& product_zero);

void run_case(Backend& gpu, const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const size_t G = c.m.size();
  const int64_t N = c.n, K = c.k;
  const bool wgrad = c.op == GemmOp::kWgrad;
  const int keep_w = wgrad ? -1 : c.only_group;
  const int keep_t = wgrad ? c.only_group : -1;
  // Logical operands: lhs X | dY | dY, rhs W | W | X.
  const Logical lhs_l = make_logical(c.m, c.op == GemmOp::kFprop ? K : N, keep_t, rng);
  const Logical rhs_l = wgrad ? make_logical(c.m, K, keep_t, rng)
                              : make_logical(std::vector<int64_t>(G, N), K, keep_w, rng);
  const Role lhs_role = c.op == GemmOp::kFprop ? Role::kActivation : Role::kGradient;
  const Role rhs_role = wgrad ? Role::kActivation : Role::kWeight;
  const HostOperand lhs = make_operand(lhs_l, c.recipe, lhs_role, wgrad, seed * 3 + 1);
  const HostOperand rhs = make_operand(rhs_l, c.recipe, rhs_role, c.op != GemmOp::kFprop, seed * 3 + 2);

  // Output shapes and initial contents.
  const size_t el = c.out == DType::kBF16 ? 2 : 4;
  auto out_rows = [&](size_t g) { return wgrad ? N : c.m[g]; };
  const int64_t out_cols = c.op == GemmOp::kFprop ? N : K;
  std::vector<std::vector<uint8_t>> init(G);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t g = 0; g < G; ++g) {
    const size_t n = static_cast<size_t>(out_rows(g) * out_cols);
    init[g].assign(n * el, kUnset);
    if (c.accumulate)
      for (size_t i = 0; i < n; ++i) {
        const float v = normal(rng);
        std::memcpy(init[g].data() + 4 * i, &v, 4);
      }
  }

  // FP64 reference on the decoded operands (NVFP4: alpha = S_dec(lhs) * S_dec(rhs) in double).
  std::vector<std::vector<double>> ref(G);
  std::vector<bool> product_zero(G, true);
  for (size_t g = 0; g < G; ++g) {
    const int64_t m = c.m[g];
    const int64_t rows = out_rows(g);
    ref[g].assign(rows * out_cols, 0.0);
    if (m > 0) {
      const std::vector<double> L = lhs.decode(g), R = rhs.decode(g);
      const double alpha = c.recipe.format == OperandFormat::kNvfp4
                               ? static_cast<double>(lhs.s_dec[g]) * static_cast<double>(rhs.s_dec[g])
                               : 1.0;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < out_cols; ++j) {
          double s = 0;
          if (c.op == GemmOp::kFprop)
            for (int64_t t = 0; t < K; ++t) s += L[i * K + t] * R[j * K + t];
          else if (c.op == GemmOp::kDgrad)
            for (int64_t t = 0; t < N; ++t) s += L[i * N + t] * R[t * K + j];
          else
            for (int64_t t = 0; t < m; ++t) s += L[t * N + i] * R[t * K + j];
          ref[g][i * out_cols + j] = alpha * s;
          if (s != 0) product_zero[g] = false;
        }
    }
    if (c.accumulate)
      for (size_t i = 0; i < ref[g].size(); ++i) {
        float v;
        std::memcpy(&v, init[g].data() + 4 * i, 4);
        ref[g][i] += v;
      }
  }

  // The sm_90a kernel's result does not depend on its tile shape (128 or 256 wide, clusters of 1
  // or 2, grid size): each output's summation order is fixed by the reduction alone.
  const std::vector<std::vector<uint8_t>>* sm90_bytes = nullptr;
  std::vector<std::vector<std::vector<uint8_t>>> results;
  results.reserve(std::size(kVariants));
  for (const Variant& variant : kVariants) {
    results.push_back(check_variant(gpu, c, variant, lhs, rhs, init, ref, product_zero));
    if (::testing::Test::HasFailure()) return;
    if (!variant.sm90()) continue;
    if (sm90_bytes == nullptr) sm90_bytes = &results.back();
    EXPECT_TRUE(*sm90_bytes == results.back())
        << "the sm_90a kernel gave other bytes under variant " << variant.name;
  }
}

// Runs `c` on one implementation three ways (packed / host m, per-expert / host m, packed tokens /
// device m), checks the three give the same bytes and the first against the FP64 reference, and
// returns its bytes.
std::vector<std::vector<uint8_t>> check_variant(
    Backend& gpu, const Case& c, const Variant& variant, const HostOperand& lhs,
    const HostOperand& rhs, const std::vector<std::vector<uint8_t>>& init,
    const std::vector<std::vector<double>>& ref, const std::vector<bool>& product_zero) {
  const size_t G = c.m.size();
  const int64_t N = c.n, K = c.k;
  const size_t el = c.out == DType::kBF16 ? 2 : 4;
  const UseVariant use(variant);
  const Placement second = c.misaligned ? Placement::kMisaligned : Placement::kDiscrete;
  const RunOut a = run_gpu(gpu, c, lhs, rhs, init, Placement::kPacked, false);
  const RunOut b = run_gpu(gpu, c, lhs, rhs, init, second, false);
  const RunOut dev = run_gpu(gpu, c, lhs, rhs, init, Placement::kDiscrete, true);
  EXPECT_TRUE(a.status.is_ok()) << a.status.message();
  EXPECT_TRUE(b.status.is_ok()) << b.status.message();
  EXPECT_TRUE(dev.status.is_ok()) << dev.status.message();
  if (!a.status.is_ok() || !b.status.is_ok() || !dev.status.is_ok()) return {};
  EXPECT_EQ(a.gap_changes, 0u) << "bytes outside the group slices changed (packed)";
  EXPECT_EQ(b.gap_changes, 0u) << "bytes outside the group slices changed (discrete)";
  EXPECT_EQ(dev.gap_changes, 0u) << "bytes outside the group slices changed (device m)";

  // Packed / host m vs per-expert / host m vs packed tokens / device m: the same bytes.
  size_t differing = 0, differing_dev = 0;
  for (size_t g = 0; g < G; ++g) {
    if (a.regions[g] != b.regions[g]) ++differing;
    if (a.regions[g] != dev.regions[g]) ++differing_dev;
  }
  EXPECT_EQ(differing, 0u) << "groups whose bytes differ between packed and per-expert runs";
  EXPECT_EQ(differing_dev, 0u) << "groups whose bytes differ between host and device token counts";

  double err2 = 0, ref2 = 0, worst_group = 0;
  size_t exact_bad = 0;
  for (size_t g = 0; g < G; ++g) {
    const size_t n = ref[g].size();
    double ge = 0, gr = 0;
    for (size_t i = 0; i < n; ++i) {
      float v;
      if (el == 4) {
        std::memcpy(&v, a.regions[g].data() + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, a.regions[g].data() + 2 * i, 2);
        v = bf16_to_f32(h);
      }
      if (product_zero[g] || c.m[g] == 0) {
        // Nothing to multiply: exactly zero (overwrite) or exactly the old value (accumulate).
        const double expect = c.accumulate ? ref[g][i] : 0.0;
        if (!(static_cast<double>(v) == expect)) ++exact_bad;
        continue;
      }
      const double d = static_cast<double>(v) - ref[g][i];
      ge += d * d;
      gr += ref[g][i] * ref[g][i];
    }
    err2 += ge;
    ref2 += gr;
    if (gr > 0) worst_group = std::max(worst_group, std::sqrt(ge / gr));
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  const double tol = c.out == DType::kBF16 ? kTolBF16 : kTolF32;
  std::string ms;
  for (size_t g = 0; g < std::min<size_t>(G, 12); ++g) ms += (g ? "," : "") + std::to_string(c.m[g]);
  if (G > 12) ms += ",...";
  char line[512];
  std::snprintf(line, sizeof line,
                "[gemm cuda] %-14s %-5s %-16s out=%-4s N=%-4lld K=%-4lld m={%s}%s%s groups=%zu "
                "rel_err=%.3e worst_group=%.3e packed==discrete=%s host_m==device_m=%s",
                variant.name, op_name_of(c.op), c.recipe.name().c_str(),
                c.out == DType::kBF16 ? "bf16" : "f32",
                static_cast<long long>(N), static_cast<long long>(K), ms.c_str(),
                c.accumulate ? " acc" : "", c.tag.c_str(), G, rel, worst_group,
                differing == 0 ? "yes" : "NO", differing_dev == 0 ? "yes" : "NO");
  std::printf("%s\n", line);
  std::fflush(stdout);
  EXPECT_LE(rel, tol) << line;
  EXPECT_LE(worst_group, c.out == DType::kBF16 ? kTolBF16 : 4 * kTolF32) << line;
  EXPECT_EQ(exact_bad, 0u) << "slices without tokens (or whose product is zero) were written: " << line;
  return a.regions;
}

// ---- shapes --------------------------------------------------------------------------------------

struct Shape {
  std::vector<int64_t> m;
  int64_t n, k;
};

// Token counts are multiples of `align` (32 MXFP8, 16 NVFP4, 1 BF16): E = 1, uneven splits with
// empty groups first, in the middle and last, a realistic reduction length, and tiles of the
// sm_90a kernel (128 x 128 or 128 x 256 outputs, 64-deep reduction steps) left partial in M, N
// and K.
std::vector<Shape> shapes(int64_t align) {
  const int64_t a = align == 1 ? 32 : align;
  std::vector<Shape> s = {
      {{2 * a}, 64, 96},
      {{a, 0, 3 * a, 2 * a, 0, 5 * a}, 96, 128},
      {{0, a, 7 * a, 2 * a, a, 0, 4 * a, 3 * a}, 160, 64},
      {{8 * a, 0, 4 * a}, 256, 512},
      {{5 * a, 0, 9 * a}, 288, 352},  // partial M, N and K tiles in every op
  };
  if (align == 1) s.push_back({{1, 0, 7, 33, 5}, 24, 40});  // ragged tokens, odd leading dims
  if (align == 1) s.push_back({{130, 0, 257, 1}, 264, 200});  // ragged tokens, partial tiles
  if (align == 16) s.push_back({{16, 48, 0, 80}, 48, 80});  // NVFP4: 16-token groups
  return s;
}

void run_recipe(Backend& gpu, const Recipe& rc, const std::vector<GemmOp>& ops, uint64_t seed) {
  const int64_t align = gemm_token_alignment(rc.format);
  for (GemmOp op : ops)
    for (DType out : {DType::kF32, DType::kBF16})
      for (const Shape& sh : shapes(align)) {
        Case c;
        c.op = op;
        c.recipe = rc;
        c.out = out;
        c.m = sh.m;
        c.n = sh.n;
        c.k = sh.k;
        run_case(gpu, c, seed++);
        if (::testing::Test::HasFailure()) return;
      }
}

const std::vector<GemmOp> kAllOps = {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad};

// ---- tests ---------------------------------------------------------------------------------------

TEST(CudaGroupedGemm, Bf16) {
  SKIP_WITHOUT_GPU();
  run_recipe(*gpu, Recipe{}, kAllOps, 100);
}

TEST(CudaGroupedGemm, Mxfp8E4m3) {
  SKIP_WITHOUT_GPU();
  run_recipe(*gpu, Recipe{OperandFormat::kMxfp8, DType::kE4M3, DType::kE4M3}, kAllOps, 200);
}

TEST(CudaGroupedGemm, Mxfp8E5m2) {
  SKIP_WITHOUT_GPU();
  run_recipe(*gpu, Recipe{OperandFormat::kMxfp8, DType::kE5M2, DType::kE5M2}, kAllOps, 300);
}

TEST(CudaGroupedGemm, Mxfp8HybridGradE5m2) {
  SKIP_WITHOUT_GPU();
  run_recipe(*gpu, Recipe{OperandFormat::kMxfp8, DType::kE4M3, DType::kE5M2},
             {GemmOp::kDgrad, GemmOp::kWgrad}, 400);
}

TEST(CudaGroupedGemm, Nvfp4) {
  SKIP_WITHOUT_GPU();
  run_recipe(*gpu, Recipe{OperandFormat::kNvfp4}, kAllOps, 500);
}

TEST(CudaGroupedGemm, Nvfp4RhtSrWgrad) {
  SKIP_WITHOUT_GPU();
  Recipe rc{OperandFormat::kNvfp4};
  rc.rht = rc.sr = true;
  run_recipe(*gpu, rc, kAllOps, 600);
}

// A quantized token-side operand given with its BF16 values (GemmOperand::bf16, what the
// quantizer writes beside a copy) is read instead of dequantized: the same output bytes as
// without, on both implementations, with aligned and misaligned (staged) BF16 pointers. Cases: the
// NVFP4 and MXFP8 lhs of fprop and dgrad (rowwise copies), the MXFP8 lhs and rhs of wgrad
// (columnwise copies, stored like the logical matrix); each also kept as its values only (no data
// or scale given). The BF16 values here come from the operand's own decode (exact in BF16), not
// from the quantizer.
TEST(CudaGroupedGemm, GivenBf16ValuesGiveTheSameBytes) {
  SKIP_WITHOUT_GPU();
  struct Given {
    OperandFormat format;
    GemmOp op;
  };
  const Given kGiven[] = {{OperandFormat::kNvfp4, GemmOp::kFprop},
                          {OperandFormat::kNvfp4, GemmOp::kDgrad},
                          {OperandFormat::kMxfp8, GemmOp::kFprop},
                          {OperandFormat::kMxfp8, GemmOp::kDgrad},
                          {OperandFormat::kMxfp8, GemmOp::kWgrad}};
  auto with_bf16 = [](const HostOperand& o) {
    HostOperand w = o;
    for (size_t g = 0; g < o.lrows.size(); ++g) {
      const std::vector<double> v = o.decode(g);
      std::vector<uint8_t>& b = w.bf16.emplace_back(v.size() * 2);
      for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t h = f32_to_bf16(static_cast<float>(v[i]));
        EXPECT_EQ(static_cast<double>(bf16_to_f32(h)), v[i]) << "a decoded value is not exact in BF16";
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
    }
    return w;
  };
  uint64_t seed = 1900;
  size_t cases = 0, bytes = 0;
  for (const Given& gv : kGiven)
    for (const Shape& sh : shapes(gemm_token_alignment(gv.format))) {
      std::mt19937_64 rng(seed++);
      const size_t G = sh.m.size();
      const GemmOp op = gv.op;
      const bool wgrad = op == GemmOp::kWgrad;
      const Recipe rc{gv.format};
      // Logical operands as run_case makes them: lhs X | dY | dY, rhs W | W | X.
      const Logical lhs_l = make_logical(sh.m, op == GemmOp::kFprop ? sh.k : sh.n, -1, rng);
      const Logical rhs_l = wgrad ? make_logical(sh.m, sh.k, -1, rng)
                                  : make_logical(std::vector<int64_t>(G, sh.n), sh.k, -1, rng);
      const Role lhs_role = op == GemmOp::kFprop ? Role::kActivation : Role::kGradient;
      const Role rhs_role = wgrad ? Role::kActivation : Role::kWeight;
      const HostOperand lhs = make_operand(lhs_l, rc, lhs_role, wgrad, seed);
      const HostOperand rhs = make_operand(rhs_l, rc, rhs_role, op != GemmOp::kFprop, seed + 1);
      HostOperand lhs_bf16 = with_bf16(lhs);
      HostOperand rhs_bf16 = wgrad ? with_bf16(rhs) : rhs;
      Case c;
      c.op = op;
      c.recipe = rc;
      c.out = wgrad ? DType::kF32 : DType::kBF16;
      c.m = sh.m;
      c.n = sh.n;
      c.k = sh.k;
      const size_t el = wgrad ? 4 : 2;
      std::vector<std::vector<uint8_t>> init(G);
      for (size_t g = 0; g < G; ++g)
        init[g].assign(static_cast<size_t>(wgrad ? sh.n * sh.k
                                                 : sh.m[g] * (op == GemmOp::kFprop ? sh.n : sh.k)) *
                           el,
                       kUnset);
      for (const Variant& v : {kVariants[1], kVariants[0]})  // sm90, cublas
        for (Placement pl : {Placement::kPacked, Placement::kMisaligned})
          for (bool only : {false, true}) {
            const char* impl = v.name;
            lhs_bf16.values_only = only;
            rhs_bf16.values_only = only && wgrad;
            SCOPED_TRACE(std::string(op_name_of(op)) + " " + impl + " m[0]=" + std::to_string(sh.m[0]) +
                         " N=" + std::to_string(sh.n) + " K=" + std::to_string(sh.k) +
                         (gv.format == OperandFormat::kMxfp8 ? " mxfp8" : " nvfp4") +
                         (only ? " values only" : ""));
            const UseVariant use(v);
            const RunOut a = run_gpu(*gpu, c, lhs, rhs, init, pl, false);
            const RunOut b = run_gpu(*gpu, c, lhs_bf16, rhs_bf16, init, pl, false);
            ASSERT_TRUE(a.status.is_ok()) << a.status.message();
            ASSERT_TRUE(b.status.is_ok()) << b.status.message();
            EXPECT_EQ(b.gap_changes, 0u);
            for (size_t g = 0; g < G; ++g) {
              EXPECT_TRUE(a.regions[g] == b.regions[g]) << "group " << g << " differs";
              bytes += b.regions[g].size();
            }
            ++cases;
          }
    }
  std::printf("[gemm cuda] given bf16 == dequantized: cases=%zu bytes=%zu\n", cases, bytes);
}

// wgrad into an FP32 main_grad: accumulate adds, groups without tokens keep their old values.
TEST(CudaGroupedGemm, WgradAccumulate) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 700;
  for (const Recipe& rc : {Recipe{}, Recipe{OperandFormat::kMxfp8}, Recipe{OperandFormat::kNvfp4}})
    for (const Shape& sh : shapes(gemm_token_alignment(rc.format))) {
      Case c;
      c.op = GemmOp::kWgrad;
      c.recipe = rc;
      c.m = sh.m;
      c.n = sh.n;
      c.k = sh.k;
      c.accumulate = true;
      run_case(*gpu, c, seed++);
      if (HasFailure()) return;
    }
}

// Each group in turn is the only one with non-zero weights (fprop, dgrad) or tokens (wgrad): every
// other slice must come out exactly zero (or unchanged when accumulating), so a result written
// with the wrong expert's weights or into the wrong expert's gradient slice fails.
TEST(CudaGroupedGemm, GroupSlices) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 800;
  const std::vector<int64_t> m = {64, 32, 0, 96, 32};
  for (const Recipe& rc : {Recipe{}, Recipe{OperandFormat::kMxfp8}, Recipe{OperandFormat::kNvfp4}})
    for (GemmOp op : kAllOps)
      for (int acc = 0; acc < (op == GemmOp::kWgrad ? 2 : 1); ++acc)
        for (int j = 0; j < static_cast<int>(m.size()); ++j) {
          Case c;
          c.op = op;
          c.recipe = rc;
          c.m = m;
          c.n = 64;
          c.k = 96;
          c.accumulate = acc == 1;
          c.only_group = j;
          c.tag = " only_group=" + std::to_string(j);
          run_case(*gpu, c, seed++);
          if (HasFailure()) return;
        }
}

// BF16 operands and outputs off 16-byte alignment are staged through aligned scratch, so they run
// the same algorithm as aligned pointers: the bytes equal the packed run's.
TEST(CudaGroupedGemm, MisalignedPointersSameBytes) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 900;
  for (GemmOp op : kAllOps)
    for (DType out : {DType::kF32, DType::kBF16})
      for (const Shape& sh : {Shape{{32, 0, 64, 96}, 64, 128}, Shape{{3, 5, 0, 9}, 5, 7}}) {
        Case c;
        c.op = op;
        c.out = out;
        c.m = sh.m;
        c.n = sh.n;
        c.k = sh.k;
        c.misaligned = true;
        c.tag = " misaligned";
        run_case(*gpu, c, seed++);
        if (HasFailure()) return;
      }
}

// Quantized copies off 16-byte alignment take the backend's dequantize kernels instead of the GEMM's
// fast BF16 dequantize; the values, hence the bytes of the result, must be the same.
TEST(CudaGroupedGemm, MisalignedQuantizedSameBytes) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 950;
  for (const Recipe& rc : {Recipe{OperandFormat::kMxfp8}, Recipe{OperandFormat::kMxfp8, DType::kE5M2, DType::kE5M2},
                           Recipe{OperandFormat::kNvfp4}})
    for (GemmOp op : kAllOps) {
      Case c;
      c.op = op;
      c.recipe = rc;
      c.m = {64, 0, 32, 96};
      c.n = 96;
      c.k = 160;
      c.misaligned = true;
      c.tag = " misaligned";
      run_case(*gpu, c, seed++);
      if (HasFailure()) return;
    }
}

// Quantized operands on the sm_90a kernel are dequantized by the kernel's own converter warps
// while it runs (Sm90Dequant::kAll: every copy; by default only the MXFP8 rowwise ones, which the
// other tests therefore cover too) or by a pre-pass launch before it (Sm90Dequant::kNone):
// the same BF16 values in the same scratch for the same wgmmas, so the same bytes, in
// every op and recipe, on every tile variant (one CTA: its converters do every chunk while its own
// producer waits; 4 CTAs: each converts many chunks), for per-expert and packed operands. The
// weights span several converter chunks (24576 elements), the last one partial.
TEST(CudaGroupedGemm, StreamDequantSameBytesAsPrepass) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 1300;
  const Recipe recipes[] = {Recipe{OperandFormat::kMxfp8, DType::kE4M3, DType::kE4M3},
                            Recipe{OperandFormat::kMxfp8, DType::kE4M3, DType::kE5M2},
                            Recipe{OperandFormat::kMxfp8, DType::kE5M2, DType::kE5M2},
                            Recipe{OperandFormat::kNvfp4, DType::kE4M3, DType::kE4M3, true, true}};
  for (const Recipe& rc : recipes)
    for (GemmOp op : kAllOps) {
      const int64_t a = gemm_token_alignment(rc.format);
      Case c;
      c.op = op;
      c.recipe = rc;
      c.out = op == GemmOp::kDgrad ? DType::kBF16 : DType::kF32;
      c.m = {5 * a, 0, 13 * a, a};
      c.n = 288;
      c.k = 416;
      std::mt19937_64 rng(seed++);
      const size_t G = c.m.size();
      const bool wgrad = op == GemmOp::kWgrad;
      const Logical lhs_l = make_logical(c.m, op == GemmOp::kFprop ? c.k : c.n, -1, rng);
      const Logical rhs_l = wgrad ? make_logical(c.m, c.k, -1, rng)
                                  : make_logical(std::vector<int64_t>(G, c.n), c.k, -1, rng);
      const HostOperand lhs = make_operand(
          lhs_l, rc, op == GemmOp::kFprop ? Role::kActivation : Role::kGradient, wgrad, seed * 3);
      const HostOperand rhs = make_operand(rhs_l, rc, wgrad ? Role::kActivation : Role::kWeight,
                                           op != GemmOp::kFprop, seed * 3 + 1);
      const size_t el = c.out == DType::kBF16 ? 2 : 4;
      std::vector<std::vector<uint8_t>> init(G);
      for (size_t g = 0; g < G; ++g)
        init[g].assign(static_cast<size_t>((wgrad ? c.n : c.m[g]) * (op == GemmOp::kFprop ? c.n : c.k)) * el,
                       kUnset);
      for (const Variant& v : kVariants) {
        if (!v.sm90()) continue;
        GemmPolicy prepass = v.gemm, stream = v.gemm;
        prepass.dequant = Sm90Dequant::kNone;
        stream.dequant = Sm90Dequant::kAll;
        for (Placement pl : {Placement::kPacked, Placement::kDiscrete}) {
          const PolicyRunsDiff d = run_under_policies(*gpu, c, lhs, rhs, init, pl, false, prepass,
                                                      stream);
          std::printf("[gemm cuda] stream==prepass %-14s %-5s %-16s %-8s bytes=%zu "
                      "differing_groups=%zu\n",
                      v.name, op_name_of(op), rc.name().c_str(),
                      pl == Placement::kPacked ? "packed" : "discrete", d.bytes, d.differing_groups);
          EXPECT_EQ(d.differing_groups, 0u) << "streaming and pre-pass dequantize differ (" << v.name << ")";
          if (HasFailure()) return;
        }
      }
    }
}

// Every group empty: fprop writes nothing, wgrad overwrite writes zeros.
TEST(CudaGroupedGemm, AllGroupsEmpty) {
  SKIP_WITHOUT_GPU();
  for (GemmOp op : kAllOps) {
    Case c;
    c.op = op;
    c.m = {0, 0, 0};
    c.n = 32;
    c.k = 64;
    c.tag = " all-empty";
    run_case(*gpu, c, 1000 + static_cast<int>(op));
  }
}

// Many groups (more than the schedule kernel's threads), most of them small or empty: the device
// counts path against the host counts and the FP64 reference.
TEST(CudaGroupedGemm, DeviceCountsManyGroups) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1200);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kWgrad}) {
    Case c;
    c.op = op;
    c.n = 64;
    c.k = 96;
    c.m.resize(300);
    for (int64_t& v : c.m) v = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 40);
    c.tag = " 300 groups";
    run_case(*gpu, c, 1200 + static_cast<int>(op));
    if (HasFailure()) return;
  }
}

// ---- token counts on the device: CUDA graphs ----------------------------------------------------

// An operand at fixed device addresses, refilled with new values between graph replays. Token-side:
// one packed buffer of `capacity` token rows (random garbage past the last group); weight-side: G
// groups back to back (G pointers).
class FixedOperand {
 public:
  FixedOperand(Backend& gpu, OperandFormat f, int64_t lcols, bool token_side, int64_t rows,
               size_t groups)
      : token_side_(token_side), groups_(groups) {
    HostOperand shape;
    shape.format = f;
    shape.lcols = lcols;
    const auto [td, ts] = token_bytes(shape);
    const size_t units = token_side ? static_cast<size_t>(rows) : static_cast<size_t>(rows) * groups;
    data_ = std::make_unique<DeviceBuffer>(gpu, units * td);
    if (ts) scale_ = std::make_unique<DeviceBuffer>(gpu, units * ts);
    if (f == OperandFormat::kNvfp4) s_dec_ = std::make_unique<DeviceBuffer>(gpu, groups * sizeof(float));
  }

  // Uploads `h`'s groups (and garbage after them); the view's pointers stay the same.
  void fill(const HostOperand& h, std::mt19937_64& rng) {
    const auto [td, ts] = token_bytes(h);
    std::vector<size_t> data_size, scale_size;
    for (size_t g = 0; g < groups_; ++g) {
      data_size.push_back(static_cast<size_t>(h.lrows[g]) * td);
      scale_size.push_back(static_cast<size_t>(h.lrows[g]) * ts);
    }
    upload(*data_, h.data, data_size, data_off_, rng);
    if (scale_) upload(*scale_, h.scale, scale_size, scale_off_, rng);
    if (s_dec_) {
      std::vector<uint8_t> b(groups_ * sizeof(float));
      std::memcpy(b.data(), h.s_dec.data(), b.size());
      s_dec_->upload(b);
    }
    view_.format = h.format;
    view_.element = h.element;
    view_.data = pointers(*data_, data_off_);
    view_.scale = scale_ ? pointers(*scale_, scale_off_) : std::vector<const void*>{};
    view_.decode_scale = s_dec_ ? s_dec_->get() : nullptr;
  }
  const GemmOperand& view() const { return view_; }

 private:
  void upload(DeviceBuffer& dst, const std::vector<std::vector<uint8_t>>& src,
              const std::vector<size_t>& size, std::vector<size_t>& off, std::mt19937_64& rng) {
    std::vector<uint8_t> b(dst.size());
    for (uint8_t& v : b) v = static_cast<uint8_t>(rng());
    off.clear();
    size_t at = 0;
    for (size_t g = 0; g < groups_; ++g) {
      off.push_back(at);
      if (size[g]) std::memcpy(b.data() + at, src[g].data(), size[g]);
      at += size[g];
    }
    dst.upload(b);
  }
  std::vector<const void*> pointers(const DeviceBuffer& b, const std::vector<size_t>& off) const {
    if (token_side_) return {b.get()};
    std::vector<const void*> p;
    for (size_t o : off) p.push_back(static_cast<const uint8_t*>(b.get()) + o);
    return p;
  }

  bool token_side_;
  size_t groups_;
  std::unique_ptr<DeviceBuffer> data_, scale_, s_dec_;
  std::vector<size_t> data_off_, scale_off_;
  GemmOperand view_;
};

bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

// One graph case: an eager call with counts m1 (it makes the call's device state), the same call
// captured on the backend's stream in global capture mode (which fails on any synchronising or
// otherwise unsafe API call) from host vectors that are gone before it is replayed, then replays
// with new counts and new operand values, each compared byte for byte with an eager host-m call
// on per-group pointers into the same buffers.
void run_graph_case(Backend& gpu, CudaBackend& cuda, const Recipe& rc, GemmOp op, bool accumulate,
                    uint64_t seed) {
  constexpr size_t G = 6;
  constexpr int64_t N = 160, K = 192, kCapacity = 640;
  const bool wgrad = op == GemmOp::kWgrad;
  const DType out_dtype = op == GemmOp::kDgrad ? DType::kBF16 : DType::kF32;
  const size_t el = out_dtype == DType::kBF16 ? 2 : 4;
  const int64_t align = gemm_token_alignment(rc.format);
  std::mt19937_64 rng(seed);
  auto counts = [&]() {
    std::vector<int64_t> m(G);
    for (int64_t& v : m)
      v = rng() % 4 == 0 ? 0 : align * static_cast<int64_t>(rng() % (kCapacity / align / G + 1));
    m[rng() % G] = align * (1 + static_cast<int64_t>(rng() % 3));  // the quantizers need a token
    return m;
  };
  const int64_t lhs_cols = op == GemmOp::kFprop ? K : N;
  FixedOperand lhs(gpu, rc.format, lhs_cols, true, kCapacity, G);
  FixedOperand rhs(gpu, rc.format, K, wgrad, wgrad ? kCapacity : N, G);
  auto fill = [&](const std::vector<int64_t>& m) {
    const Logical l = make_logical(m, lhs_cols, -1, rng);
    const Logical r = wgrad ? make_logical(m, K, -1, rng) : make_logical(std::vector<int64_t>(G, N), K, -1, rng);
    lhs.fill(make_operand(l, rc, op == GemmOp::kFprop ? Role::kActivation : Role::kGradient, wgrad, rng()), rng);
    rhs.fill(make_operand(r, rc, wgrad ? Role::kActivation : Role::kWeight, op != GemmOp::kFprop, rng()), rng);
  };
  const size_t out_bytes = wgrad ? G * N * K * el : kCapacity * (op == GemmOp::kFprop ? N : K) * el;
  DeviceBuffer out(gpu, out_bytes), ref_out(gpu, out_bytes), m_dev(gpu, G * sizeof(int64_t));
  auto reset_out = [&]() {
    std::vector<uint8_t> b(out_bytes, kUnset);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (accumulate)
      for (size_t i = 0; i < b.size(); i += 4) {
        const float v = normal(rng);
        std::memcpy(b.data() + i, &v, 4);
      }
    out.upload(b);
    ref_out.upload(b);
  };
  auto set_counts = [&](const std::vector<int64_t>& m) {
    std::vector<uint8_t> b(G * sizeof(int64_t));
    std::memcpy(b.data(), m.data(), b.size());
    m_dev.upload(b);
  };
  auto device_args = [&](void* dst) {
    GroupedGemmArgs a;
    a.op = op;
    a.n = N;
    a.k = K;
    a.lhs = lhs.view();
    a.rhs = rhs.view();
    a.out_dtype = out_dtype;
    a.accumulate = accumulate;
    if (wgrad)
      for (size_t g = 0; g < G; ++g) a.out.push_back(static_cast<uint8_t*>(dst) + g * N * K * el);
    else
      a.out = {dst};
    a.m_device = m_dev.get();
    a.groups = static_cast<int64_t>(G);
    a.m_capacity = kCapacity;
    return a;
  };
  std::string what = std::string(op_name_of(op)) + " " + rc.name() + (accumulate ? " acc" : "");

  const std::vector<int64_t> m1 = counts();
  fill(m1);
  set_counts(m1);
  reset_out();
  const Status eager = ops::grouped_gemm(gpu, device_args(out.get()));
  ASSERT_TRUE(eager.is_ok()) << what << ": " << eager.message();
  gpu.synchronize();

  cudaStream_t stream = cuda.stream();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  Status captured;
  {
    const GroupedGemmArgs a = device_args(out.get());  // its vectors end with this scope
    captured = ops::grouped_gemm(gpu, a);
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_TRUE(captured.is_ok()) << what << ": " << captured.message();
  ASSERT_EQ(end, cudaSuccess) << what << ": capture failed (a synchronisation in the call?): "
                              << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int replay = 0; replay < 2; ++replay) {
    const std::vector<int64_t> m = counts();
    fill(m);
    set_counts(m);
    reset_out();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<uint8_t> got = out.download();
    GroupedGemmArgs host = expand_packed_tokens(device_args(ref_out.get()), m);
    const Status r = ops::grouped_gemm(gpu, host);
    ASSERT_TRUE(r.is_ok()) << r.message();
    const std::vector<uint8_t> want = ref_out.download();
    std::string ms;
    for (int64_t v : m) ms += (ms.empty() ? "" : ",") + std::to_string(v);
    size_t diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
    std::printf("[gemm cuda] graph replay %d %-22s m={%s} bytes=%zu differing=%zu\n", replay,
                what.c_str(), ms.c_str(), got.size(), diff);
    EXPECT_EQ(diff, 0u) << what << ": the replayed graph and an eager host-m call differ";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Token counts in device memory on the sm_90a path: no host synchronisation, so the call can be
// captured in a CUDA graph and replayed with new counts (and new values) written into the same
// buffers; every op, BF16 / MXFP8 E4M3 / NVFP4, wgrad overwriting and accumulating.
TEST(CudaGroupedGemm, DeviceCountsCaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  auto* cuda = dynamic_cast<CudaBackend*>(gpu);
  ASSERT_NE(cuda, nullptr);
  if (!device_is_sm90()) GTEST_SKIP() << "the no-sync path is the sm_90a kernel's";
  uint64_t seed = 1300;
  for (const Recipe& rc : {Recipe{}, Recipe{OperandFormat::kMxfp8}, Recipe{OperandFormat::kNvfp4}})
    for (GemmOp op : kAllOps)
      for (bool acc : {false, true}) {
        if (acc && op != GemmOp::kWgrad) continue;
        run_graph_case(*gpu, *cuda, rc, op, acc, seed++);
        if (HasFailure()) return;
      }
}

// Capturing an m_device call fails with one clear line (and the capture ends cleanly) when the
// call has not run before or would copy the counts to the host (cuBLASLt forced).
TEST(CudaGroupedGemm, DeviceCountsCaptureErrors) {
  SKIP_WITHOUT_GPU();
  auto* cuda = dynamic_cast<CudaBackend*>(gpu);
  ASSERT_NE(cuda, nullptr);
  if (!device_is_sm90()) GTEST_SKIP() << "the no-sync path is the sm_90a kernel's";
  DeviceBuffer x(*gpu, 256 * 64 * 2), w(*gpu, 64 * 64 * 2), y(*gpu, 256 * 64 * 4);
  DeviceBuffer m(*gpu, 2 * sizeof(int64_t));
  m.upload(std::vector<uint8_t>(2 * sizeof(int64_t), 0));
  const std::vector<int64_t> none = {0, 0};
  GroupedGemmArgs a;
  a.n = 64;
  a.k = 64;
  a.lhs.data = {x.get()};
  a.rhs.data = {w.get(), static_cast<uint8_t*>(w.get()) + 32 * 64 * 2};
  a.out = {y.get()};
  a.m_device = m.get();
  a.groups = 2;
  a.m_capacity = 256;
  // An eager host-m call first: the backend's GEMM state exists before any capture.
  ASSERT_TRUE(ops::grouped_gemm(*gpu, expand_packed_tokens(a, none)).is_ok());
  for (const Variant& v : {kVariants[1], kVariants[0]}) {  // sm90, cublas
    const char* impl = v.name;
    Status s;
    {
      const UseVariant use(v);
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(cuda->stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
      s = ops::grouped_gemm(*gpu, a);
      cudaStreamEndCapture(cuda->stream(), &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    EXPECT_FALSE(s.is_ok()) << impl;
    EXPECT_NE(s.message().find(std::string(impl) == "sm90" ? "run it once" : "cannot be captured"),
              std::string::npos)
        << s.message();
    std::printf("[gemm cuda] capture rejects (%s): %s\n", impl, s.message().c_str());
  }
  EXPECT_TRUE(ops::grouped_gemm(*gpu, a).is_ok()) << "the same call outside capture";
  gpu->synchronize();
}

TEST(CudaGroupedGemm, RejectsBadArguments) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer buf(*gpu, 1 << 16);
  GroupedGemmArgs a;
  a.n = 32;
  a.k = 32;
  a.lhs.data = {buf.get()};
  a.rhs.data = {buf.get()};
  a.out = {buf.get()};
  EXPECT_FALSE(ops::grouped_gemm(*gpu, a).is_ok()) << "neither m nor m_device";
  a.m = {32};
  a.m_device = buf.get();
  a.groups = 1;
  EXPECT_FALSE(ops::grouped_gemm(*gpu, a).is_ok()) << "both m and m_device";
  a.m_device = nullptr;
  a.groups = 0;
  a.lhs.format = a.rhs.format = OperandFormat::kMxfp8;
  a.lhs.scale = a.rhs.scale = {buf.get()};
  a.m = {16};
  const Status s = ops::grouped_gemm(*gpu, a);
  EXPECT_FALSE(s.is_ok()) << "16 tokens in an MXFP8 group";
  std::printf("[gemm cuda] rejects: %s\n", s.message().c_str());
  a.lhs.format = a.rhs.format = OperandFormat::kBF16;
  a.lhs.scale = a.rhs.scale = {};
}

// The policy's ranges: a bad tile width, cluster or CTA limit is an error and changes nothing.
TEST(CudaGroupedGemm, KernelPolicyRejectsBadValues) {
  const KernelPolicy before = kernel_policy();
  KernelPolicy p;
  p.gemm.tile_n = 64;
  EXPECT_FALSE(set_kernel_policy(p).is_ok()) << "tile_n 64";
  p.gemm.tile_n = 0;
  p.gemm.cluster = 3;
  EXPECT_FALSE(set_kernel_policy(p).is_ok()) << "cluster 3";
  p.gemm.cluster = 0;
  p.quantize.nvfp4_max_ctas = -1;
  const Status e = set_kernel_policy(p);
  EXPECT_FALSE(e.is_ok()) << "nvfp4_max_ctas -1";
  std::printf("[gemm cuda] rejects: %s\n", e.message().c_str());
  EXPECT_EQ(kernel_policy().gemm.tile_n, before.gemm.tile_n);
  EXPECT_EQ(kernel_policy().gemm.cluster, before.gemm.cluster);
  EXPECT_EQ(kernel_policy().quantize.nvfp4_max_ctas, before.quantize.nvfp4_max_ctas);
}

}  // namespace
}  // namespace packmoe
