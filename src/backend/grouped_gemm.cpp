// Grouped GEMM argument checks shared by every backend.
#include "backend/grouped_gemm.h"

#include <string>

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
  if (o.data.size() != groups)
    return Status::error(ctx + name + " has " + std::to_string(o.data.size()) + " data pointers for " +
                         std::to_string(groups) + " groups");
  if (o.format != OperandFormat::kBF16 && o.scale.size() != groups)
    return Status::error(ctx + name + " has " + std::to_string(o.scale.size()) +
                         " scale pointers for " + std::to_string(groups) + " groups");
  if (o.format == OperandFormat::kMxfp8 && o.element != DType::kE4M3 && o.element != DType::kE5M2)
    return Status::error(ctx + name + ": MXFP8 elements must be e4m3 or e5m2");
  if (o.format == OperandFormat::kNvfp4 && o.decode_scale == nullptr)
    return Status::error(ctx + name + ": NVFP4 operands need per-group decode scales");
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

Status validate_token_source(const GroupedGemmArgs& a) {
  const bool have_m = !a.m.empty();
  const bool have_device = a.m_device != nullptr;
  if (have_m == have_device)
    return Status::error(have_m ? "grouped_gemm: give the token counts in m or in m_device, not both"
                                : "grouped_gemm: no token counts (set m, or m_device and groups)");
  if (have_m && a.groups != 0 && a.groups != static_cast<int64_t>(a.m.size()))
    return Status::error("grouped_gemm: groups = " + std::to_string(a.groups) + " but m has " +
                         std::to_string(a.m.size()) + " entries");
  if (have_device && a.groups <= 0)
    return Status::error("grouped_gemm: m_device needs groups > 0 (got " +
                         std::to_string(a.groups) + ")");
  return Status::ok();
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
    if (m[g] > 0 && (a.lhs.data[g] == nullptr || a.rhs.data[g] == nullptr))
      return Status::error(ctx + "group " + std::to_string(g) + " has a null operand");
    if (m[g] > 0 && f != OperandFormat::kBF16 &&
        (a.lhs.scale[g] == nullptr || a.rhs.scale[g] == nullptr))
      return Status::error(ctx + "group " + std::to_string(g) + " has a null scale pointer");
  }
  return Status::ok();
}

}  // namespace packmoe
