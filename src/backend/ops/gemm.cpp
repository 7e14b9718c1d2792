// The grouped GEMM family (backend/ops/gemm.h): argument checks shared by every backend, and the
// ops::grouped_gemm entry.
#include "backend/ops/gemm.h"

#include <string>
#include <type_traits>

#include "backend/backend.h"

namespace packmoe {
namespace {

const char* op_text(GemmOp op) {
  switch (op) {
    case GemmOp::kFprop: return "fprop";
    case GemmOp::kDgrad: return "dgrad";
    case GemmOp::kWgrad: return "wgrad";
  }
  return "?";
}

const char* format_text(OperandFormat f) {
  switch (f) {
    case OperandFormat::kBF16: return "bf16";
    case OperandFormat::kMxfp8: return "mxfp8";
    case OperandFormat::kNvfp4: return "nvfp4";
  }
  return "?";
}

Status check_operand(const GemmOperand& o, const char* name, size_t groups, const std::string& ctx) {
  // A quantized copy kept as its values only has no data or scale pointers (bf16 counted below).
  const bool bytes = !(o.values_only() && o.format != OperandFormat::kBF16);
  if (bytes && o.data.size() != groups)
    return Status::error(ctx + name + " has " + std::to_string(o.data.size()) + " data pointers for " +
                         std::to_string(groups) + " groups");
  if (bytes && o.format != OperandFormat::kBF16 && o.scale.size() != groups)
    return Status::error(ctx + name + " has " + std::to_string(o.scale.size()) +
                         " scale pointers for " + std::to_string(groups) + " groups");
  if (o.format == OperandFormat::kMxfp8 && o.element != DType::kE4M3 && o.element != DType::kE5M2)
    return Status::error(ctx + name + ": MXFP8 elements must be e4m3 or e5m2");
  if (o.format == OperandFormat::kNvfp4 && o.decode_scale == nullptr)
    return Status::error(ctx + name + ": NVFP4 operands need per-group decode scales");
  if (!o.bf16.empty() && o.bf16.size() != groups)
    return Status::error(ctx + name + " has " + std::to_string(o.bf16.size()) +
                         " bf16 pointers for " + std::to_string(groups) + " groups");
  return Status::ok();
}

}  // namespace

int64_t gemm_token_alignment(OperandFormat f) {
  switch (f) {
    case OperandFormat::kBF16: return 1;
    case OperandFormat::kMxfp8: return 32;
    case OperandFormat::kNvfp4: return 16;
  }
  return 1;
}

TokenStrides token_strides(const GroupedGemmArgs& a) {
  // Columns of the token-side matrices (one token = one row): lhs X (K) or dY (N), wgrad rhs X
  // (K), out Y (N) or dX (K).
  const int64_t lhs_cols = a.op == GemmOp::kFprop ? a.k : a.n;
  auto data_bytes = [](const GemmOperand& o, int64_t cols) {
    return o.format == OperandFormat::kBF16 ? 2 * cols
           : o.format == OperandFormat::kMxfp8 ? cols : cols / 2;
  };
  auto scale_bytes = [](const GemmOperand& o, int64_t cols) -> int64_t {
    return o.format == OperandFormat::kMxfp8 ? cols / 32
           : o.format == OperandFormat::kNvfp4 ? cols / 16 : 0;
  };
  TokenStrides t;
  t.lhs_data = data_bytes(a.lhs, lhs_cols);
  t.lhs_scale = scale_bytes(a.lhs, lhs_cols);
  if (a.op == GemmOp::kWgrad) {
    t.rhs_data = data_bytes(a.rhs, a.k);
    t.rhs_scale = scale_bytes(a.rhs, a.k);
  } else {
    t.out = (a.op == GemmOp::kFprop ? a.n : a.k) * (a.out_dtype == DType::kBF16 ? 2 : 4);
  }
  return t;
}

Status validate_token_source(const GroupedGemmArgs& a) {
  const bool have_m = !a.m.empty();
  const bool have_device = a.m_device != nullptr;
  if (have_m == have_device)
    return Status::error(have_m ? "grouped_gemm: give the token counts in m or in m_device, not both"
                                : "grouped_gemm: no token counts (set m, or m_device and groups)");
  if (have_m && a.groups != 0 && a.groups != static_cast<int64_t>(a.m.size()))
    return Status::error("grouped_gemm: groups = " + std::to_string(a.groups) + " but m has " +
                         std::to_string(a.m.size()) + " entries");
  if (have_m && a.m_capacity != 0)
    return Status::error("grouped_gemm: m_capacity is for m_device calls only");
  if (have_device && a.groups <= 0)
    return Status::error("grouped_gemm: m_device needs groups > 0 (got " +
                         std::to_string(a.groups) + ")");
  const int64_t align = gemm_token_alignment(a.lhs.format);
  if (have_device && (a.m_capacity <= 0 || a.m_capacity % align != 0))
    return Status::error("grouped_gemm: m_device needs m_capacity, the token rows of the packed "
                         "buffers, positive and a multiple of " + std::to_string(align) +
                         " (got " + std::to_string(a.m_capacity) + ")");
  return Status::ok();
}

Status validate_packed_tokens(const GroupedGemmArgs& a) {
  const std::string ctx = std::string("grouped_gemm ") + op_text(a.op) + " (" +
                          format_text(a.lhs.format) + ", m_device): ";
  const size_t G = static_cast<size_t>(a.groups);
  auto count = [&](size_t got, bool tokens, const char* what) -> Status {
    const size_t want = tokens ? 1 : G;
    if (got == want) return Status::ok();
    return Status::error(ctx + what + (tokens ? " holds tokens: give one packed buffer, not "
                                              : " is per group: give " + std::to_string(G) +
                                                    " pointers, not ") +
                         std::to_string(got));
  };
  const bool wgrad = a.op == GemmOp::kWgrad;
  if (!a.lhs.bf16.empty() || !a.rhs.bf16.empty())
    return Status::error(ctx + "BF16 values of a copy are taken with host token counts only");
  PACKMOE_RETURN_IF_ERROR(count(a.lhs.data.size(), true, "lhs"));
  PACKMOE_RETURN_IF_ERROR(count(a.rhs.data.size(), wgrad, "rhs"));
  if (a.lhs.format != OperandFormat::kBF16)
    PACKMOE_RETURN_IF_ERROR(count(a.lhs.scale.size(), true, "lhs scale"));
  if (a.rhs.format != OperandFormat::kBF16)
    PACKMOE_RETURN_IF_ERROR(count(a.rhs.scale.size(), wgrad, "rhs scale"));
  PACKMOE_RETURN_IF_ERROR(count(a.out.size(), !wgrad, "out"));
  return Status::ok();
}

Status check_device_counts(const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  const int64_t align = gemm_token_alignment(a.lhs.format);
  int64_t sum = 0;
  for (size_t g = 0; g < m.size(); ++g) {
    if (m[g] < 0 || m[g] % align != 0)
      return Status::error("grouped_gemm: device token count m[" + std::to_string(g) + "] = " +
                           std::to_string(m[g]) + " is not a non-negative multiple of " +
                           std::to_string(align));
    sum += m[g];
    if (sum > a.m_capacity)
      return Status::error("grouped_gemm: device token counts sum to more than m_capacity = " +
                           std::to_string(a.m_capacity) + " (at group " + std::to_string(g) + ")");
  }
  return Status::ok();
}

GroupedGemmArgs expand_packed_tokens(const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  const TokenStrides ts = token_strides(a);
  GroupedGemmArgs e = a;
  e.m = m;
  e.m_device = nullptr;
  e.groups = 0;
  e.m_capacity = 0;
  auto spread = [&](const auto& one, int64_t stride, auto& dst) {
    using Ptr = std::remove_cvref_t<decltype(dst[0])>;
    const auto* base = static_cast<const uint8_t*>(one);
    dst.clear();
    int64_t off = 0;
    for (int64_t mg : m) {
      dst.push_back(const_cast<Ptr>(static_cast<const void*>(base + off * stride)));
      off += mg;
    }
  };
  spread(a.lhs.data[0], ts.lhs_data, e.lhs.data);
  if (a.lhs.format != OperandFormat::kBF16) spread(a.lhs.scale[0], ts.lhs_scale, e.lhs.scale);
  if (a.op == GemmOp::kWgrad) {
    spread(a.rhs.data[0], ts.rhs_data, e.rhs.data);
    if (a.rhs.format != OperandFormat::kBF16) spread(a.rhs.scale[0], ts.rhs_scale, e.rhs.scale);
  } else {
    spread(a.out[0], ts.out, e.out);
  }
  return e;
}

Status validate_grouped_gemm(const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  const std::string ctx = std::string("grouped_gemm ") + op_text(a.op) + " (" +
                          format_text(a.lhs.format) + "): ";
  if (m.empty()) return Status::error(ctx + "no groups");
  if (a.n <= 0 || a.k <= 0) return Status::error(ctx + "N and K must be positive");
  if (a.lhs.format != a.rhs.format) return Status::error(ctx + "both operands must share one format");
  if (a.out_dtype != DType::kF32 && a.out_dtype != DType::kBF16)
    return Status::error(ctx + "output must be f32 or bf16");
  if (a.accumulate && (a.op != GemmOp::kWgrad || a.out_dtype != DType::kF32))
    return Status::error(ctx + "accumulate is for wgrad into an f32 main_grad only");
  if (a.out.size() != m.size())
    return Status::error(ctx + std::to_string(a.out.size()) + " output pointers for " +
                         std::to_string(m.size()) + " groups");
  PACKMOE_RETURN_IF_ERROR(check_operand(a.lhs, "lhs", m.size(), ctx));
  PACKMOE_RETURN_IF_ERROR(check_operand(a.rhs, "rhs", m.size(), ctx));
  if ((!a.lhs.bf16.empty() && a.lhs.format == OperandFormat::kBF16) ||
      (!a.rhs.bf16.empty() && (a.rhs.format == OperandFormat::kBF16 || a.op != GemmOp::kWgrad)))
    return Status::error(ctx + "BF16 values are taken for a quantized token-side copy only (the "
                               "lhs, or the wgrad rhs), never for a weight");

  const OperandFormat f = a.lhs.format;
  const int64_t block = f == OperandFormat::kMxfp8 ? 32 : f == OperandFormat::kNvfp4 ? 16 : 1;
  // Weights carry both copies (blocks along K and along N), so both must take whole blocks.
  if (a.n % block || a.k % block)
    return Status::error(ctx + "N = " + std::to_string(a.n) + " and K = " + std::to_string(a.k) +
                         " must be multiples of " + std::to_string(block));
  const int64_t align = gemm_token_alignment(f);
  for (size_t g = 0; g < m.size(); ++g) {
    if (m[g] < 0) return Status::error(ctx + "negative token count in group " + std::to_string(g));
    if (m[g] % align)
      return Status::error(ctx + "group " + std::to_string(g) + " has " + std::to_string(m[g]) +
                           " tokens, not a multiple of " + std::to_string(align) +
                           " (pad each expert's tokens to the format's block)");
    const bool needs_out = m[g] > 0 || a.op == GemmOp::kWgrad;
    if (needs_out && a.out[g] == nullptr)
      return Status::error(ctx + "group " + std::to_string(g) + " has no output pointer");
    // A copy kept as its values only has no data or scale pointers (the bf16 check below).
    auto null_data = [&](const GemmOperand& o) { return !o.values_only() && o.data[g] == nullptr; };
    auto null_scale = [&](const GemmOperand& o) { return !o.values_only() && o.scale[g] == nullptr; };
    if (m[g] > 0 && (null_data(a.lhs) || null_data(a.rhs)))
      return Status::error(ctx + "group " + std::to_string(g) + " has a null operand");
    if (m[g] > 0 && f != OperandFormat::kBF16 && (null_scale(a.lhs) || null_scale(a.rhs)))
      return Status::error(ctx + "group " + std::to_string(g) + " has a null scale pointer");
    if (m[g] > 0 && ((!a.lhs.bf16.empty() && a.lhs.bf16[g] == nullptr) ||
                     (!a.rhs.bf16.empty() && a.rhs.bf16[g] == nullptr)))
      return Status::error(ctx + "group " + std::to_string(g) + " has a null bf16 pointer");
  }
  return Status::ok();
}

// ---- entries -------------------------------------------------------------------------------
namespace ops {

Status grouped_gemm(Backend& b, const GroupedGemmArgs& a) {
  return b.kernels().gemm->grouped_gemm(b, a);
}

}  // namespace ops

}  // namespace packmoe
