// Grouped GEMM on CUDA, the entry point (cuda_backend.h: grouped_gemm_cuda): every operand becomes
// BF16 (grouped_gemm_operands.h: MXFP8 and NVFP4 dequantized EXACTLY, one launch per operand over
// all groups), then either the sm_90a wgmma kernel runs all groups in one launch
// (grouped_gemm_sm90.cu) or each group is one cuBLASLt matmul with true FP32 accumulation
// (grouped_gemm_cublas.cu), all on be.stream(); choose_path picks from the KernelPolicy, the
// device and the shapes. On the sm_90a kernel the MXFP8 rowwise copies skip the pre-pass: the
// kernel's converter warps write the same BF16 values while it runs (streams). Token counts in
// device memory go to grouped_gemm_device_counts.cu. Invariant: the implementation and a group's
// algorithm are functions of (policy, op, m_g, N, K, out dtype) only, never of where its pointers
// live, so a packed (E, N, K) weight and E separate buffers give the same bytes. Host
// synchronisation: when a cached device buffer has to grow, and for `m_device` calls off the
// sm_90a path (other GPUs, GemmImpl::kCublasLt, shapes or pointers the kernel does not take, more
// than kSm90MaxDeviceGroups groups: the G counts are copied to the host).
//
// Exactness of the BF16 operands (docs/gemm.md): an MXFP8 value e * 2^(s-127) has at most 4
// significant bits (E4M3; 3 for E5M2) and fits BF16 exactly unless its lowest bit falls below
// BF16's smallest subnormal 2^-133, i.e. for scale codes s < 3 (E4M3) or s < 10 (E5M2), which
// the quantizer gives only blocks with amax below ~2^-116 (E4M3) / ~2^-102 (E5M2); there the
// dequantize rounds to BF16 (RNE). An NVFP4 block value e2m1 * e4m3 has at most 6 significant
// bits in [2^-10, 2688]: always exact. NVFP4's per-tensor decode scales become the GEMM's alpha.
#include "backend/cuda/grouped_gemm_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "backend/cuda/grouped_gemm_cublas.h"
#include "backend/cuda/grouped_gemm_device_counts.h"
#include "backend/cuda/grouped_gemm_operands.h"
#include "backend/cuda/kernel_policy.h"

namespace packmoe {
namespace gemm_cuda {

Sm90DeviceGemm sm90_op_shape(const GroupedGemmArgs& a) {
  const bool nvfp4 = a.lhs.format == OperandFormat::kNvfp4;  // columnwise copies stored transposed
  Sm90DeviceGemm p;
  p.tokens_reduce = a.op == GemmOp::kWgrad;
  p.fixed = a.op == GemmOp::kFprop ? a.k : a.n;
  p.nk = a.op == GemmOp::kFprop ? a.n : a.k;
  p.a_k_major = a.op != GemmOp::kWgrad || nvfp4;  // wgrad reads dY (m, N): MN-major
  p.b_k_major = a.op == GemmOp::kFprop || nvfp4;  // dgrad W (N, K), wgrad X (m, K): MN-major
  p.out_bf16 = a.out_dtype == DType::kBF16;
  p.accumulate = a.accumulate;
  return p;
}

namespace {

using gemm_convert::DequantJob;

// The `bytes` at each of `outs` become +0: one launch for all of them (a wgrad of 128 experts
// with most of them empty would otherwise queue a memset per expert), a memset per output when
// they are not 16-byte words.
void zero_outputs(CudaBackend& be, const std::vector<void*>& outs, size_t bytes) {
  if (outs.empty() || bytes == 0) return;
  const bool words = bytes % 16 == 0 &&
                     std::all_of(outs.begin(), outs.end(), [](const void* q) { return aligned(q); });
  if (!words || outs.size() > 65535) {
    for (void* o : outs) PACKMOE_CUDA_CHECK(cudaMemsetAsync(o, 0, bytes, be.stream()));
    return;
  }
  const auto* table = static_cast<void* const*>(be.upload(outs.data(), outs.size() * sizeof(void*)));
  launch_zero_groups(be.stream(), nullptr, table, static_cast<int>(outs.size()),
                     static_cast<int64_t>(bytes / 16));
}

// The sm_90a problem with the host's token counts `m` (pointers left empty).
Sm90Gemm sm90_geometry(const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  return sm90_device_geometry(sm90_op_shape(a), m);
}

}  // namespace

GemmPath choose_path(CudaBackend& be, const GroupedGemmArgs& a, const std::vector<int64_t>& m) {
  if (kernel_policy().gemm.impl == GemmImpl::kCublasLt) return GemmPath::kCublasLt;
  if (!sm90_gemm_device_ok(be)) return GemmPath::kCublasLt;
  return sm90_gemm_shape_ok(sm90_geometry(a, m)) ? GemmPath::kSm90 : GemmPath::kCublasLt;
}

namespace {

// Whether the sm_90a kernel dequantizes quantized copy `o` itself while it runs (its converter
// warps, Sm90Gemm::a_dequant) instead of a pre-pass launch before it: GemmPolicy::dequant. By
// default the MXFP8 rowwise copies only, where streaming was measured faster than the pre-pass
// (qwen3, deepseek, small_64e fprop); columnwise MXFP8 and NVFP4 copies stream as fast as the
// pre-pass converts them, not faster (docs/gemm-sm90.md, "Streaming dequantize"). Either way the
// same BF16 values reach the same wgmmas: the same bytes.
bool streams(Sm90Dequant mode, const GemmOperand& o, const std::vector<Stored>& shape) {
  if (o.format == OperandFormat::kBF16) return false;
  if (mode == Sm90Dequant::kAll) return true;
  return mode == Sm90Dequant::kRowwiseMxfp8 && o.format == OperandFormat::kMxfp8 &&
         !shape[0].columnwise;
}

// The per-backend state of the dispatcher: its lock (one call at a time per backend: the parts'
// caches and scratch are shared) and the operand scratch. Lives as long as the backend.
struct DispatchState {
  std::mutex mu;
  OperandScratch operands;
};

DispatchState& dispatch_state(CudaBackend& be) {
  static std::mutex mu;
  static auto* states = new std::map<CudaBackend*, std::unique_ptr<DispatchState>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*states)[&be];
  if (!s) s = std::make_unique<DispatchState>();
  return *s;
}

// The call with host counts `m` on implementation `path`.
Status run_grouped(CudaBackend& be, OperandScratch& st, const GroupedGemmArgs& a,
                   const std::vector<int64_t>& m, GemmPath path) {
  const size_t G = m.size();
  const int64_t N = a.n, K = a.k;
  const OperandFormat f = a.lhs.format;
  const bool out_bf16 = a.out_dtype == DType::kBF16;
  const size_t out_elem = out_bf16 ? 2 : 4;
  cudaStream_t s = be.stream();

  std::vector<bool> active(G);
  bool any = false;
  for (size_t g = 0; g < G; ++g) any |= (active[g] = m[g] > 0);

  // wgrad groups without tokens: zeros when overwriting, untouched when accumulating.
  if (a.op == GemmOp::kWgrad && !a.accumulate) {
    std::vector<void*> empty;
    for (size_t g = 0; g < G; ++g)
      if (!active[g]) empty.push_back(a.out[g]);
    zero_outputs(be, empty, static_cast<size_t>(N * K) * out_elem);
  }
  if (!any) return Status::ok();

  // Scratch layout: [lhs groups][rhs groups][staged outputs], each matrix 256-byte aligned.
  std::vector<Stored> lhs_shape(G), rhs_shape(G);
  std::vector<size_t> lhs_off(G, 0), rhs_off(G, 0), out_off(G, 0);
  auto out_rows = [&](size_t g) { return a.op == GemmOp::kWgrad ? N : m[g]; };
  auto out_cols = [&]() { return a.op == GemmOp::kFprop ? N : K; };
  bool stage_out = false;
  for (size_t g = 0; g < G; ++g) {
    lhs_shape[g] = stored_of(a.op, f, true, m[g], N, K);
    rhs_shape[g] = stored_of(a.op, f, false, m[g], N, K);
    if (active[g] && !aligned(a.out[g])) stage_out = true;
  }
  auto need = [&](const GemmOperand& o) {  // scratch: to dequantize into, or to align BF16
    if (o.format != OperandFormat::kBF16 && o.bf16.empty()) return true;
    const std::vector<const void*>& bf16 = o.format == OperandFormat::kBF16 ? o.data : o.bf16;
    for (size_t g = 0; g < G; ++g)
      if (active[g] && !aligned(bf16[g])) return true;
    return false;
  };
  const bool lhs_scratch = need(a.lhs), rhs_scratch = need(a.rhs);
  size_t total = 0;
  auto layout = [&](bool use, const std::vector<Stored>& sh, std::vector<size_t>& off, size_t el) {
    if (!use) return;
    for (size_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      off[g] = total;
      total += round_up(static_cast<size_t>(sh[g].rows * sh[g].cols) * el, kScratchAlign);
    }
  };
  layout(lhs_scratch, lhs_shape, lhs_off, 2);
  layout(rhs_scratch, rhs_shape, rhs_off, 2);
  std::vector<Stored> out_shape(G);
  for (size_t g = 0; g < G; ++g) out_shape[g] = Stored{out_rows(g), out_cols(), false, false};
  layout(stage_out, out_shape, out_off, out_elem);
  uint8_t* scratch = total ? static_cast<uint8_t*>(st.scratch.get(be, total)) : nullptr;

  Prepared lhs, rhs;
  const Sm90Dequant mode = kernel_policy().gemm.dequant;
  const bool sm90 = path == GemmPath::kSm90;
  std::vector<DequantJob> lhs_jobs, rhs_jobs;  // converted by the sm_90a kernel itself
  PACKMOE_RETURN_IF_ERROR(prepare(be, st, a.lhs, lhs_shape, active, scratch, lhs_off, lhs,
                                  sm90 && streams(mode, a.lhs, lhs_shape) ? &lhs_jobs : nullptr));
  PACKMOE_RETURN_IF_ERROR(prepare(be, st, a.rhs, rhs_shape, active, scratch, rhs_off, rhs,
                                  sm90 && streams(mode, a.rhs, rhs_shape) ? &rhs_jobs : nullptr));

  // Outputs: the caller's pointers, or aligned scratch copied back after the GEMMs.
  std::vector<void*> out(G, nullptr);
  for (size_t g = 0; g < G; ++g) {
    if (!active[g]) continue;
    const size_t bytes = static_cast<size_t>(out_rows(g) * out_cols()) * out_elem;
    out[g] = stage_out ? scratch + out_off[g] : a.out[g];
    if (stage_out && a.accumulate)
      PACKMOE_CUDA_CHECK(cudaMemcpyAsync(out[g], a.out[g], bytes, cudaMemcpyDeviceToDevice, s));
  }

  if (sm90) {
    Sm90Gemm p = sm90_geometry(a, m);
    p.a = lhs.ptr;
    p.b = rhs.ptr;
    p.a_dequant = std::move(lhs_jobs);
    p.b_dequant = std::move(rhs_jobs);
    p.out = out;
    if (f == OperandFormat::kNvfp4) {
      p.alpha_lhs = static_cast<const float*>(a.lhs.decode_scale);
      p.alpha_rhs = static_cast<const float*>(a.rhs.decode_scale);
    }
    PACKMOE_RETURN_IF_ERROR(grouped_gemm_sm90(be, p));
  } else {
    PACKMOE_RETURN_IF_ERROR(grouped_gemm_cublaslt(be, a, m, lhs, rhs, out));
  }

  if (stage_out)
    for (size_t g = 0; g < G; ++g)
      if (active[g])
        PACKMOE_CUDA_CHECK(cudaMemcpyAsync(
            a.out[g], out[g], static_cast<size_t>(out_rows(g) * out_cols()) * out_elem,
            cudaMemcpyDeviceToDevice, s));
  return Status::ok();
}

}  // namespace
}  // namespace gemm_cuda

Status grouped_gemm_cuda(CudaBackend& be, const GroupedGemmArgs& args) {
  using namespace gemm_cuda;
  PACKMOE_RETURN_IF_ERROR(validate_token_source(args));
  DispatchState& st = dispatch_state(be);
  std::lock_guard<std::mutex> lock(st.mu);
  if (args.m_device != nullptr) {
    PACKMOE_RETURN_IF_ERROR(validate_packed_tokens(args));
    Result<bool> done = grouped_gemm_device_counts(be, args);
    if (!done.is_ok()) return done.status();
    if (done.value()) return Status::ok();
    // cuBLASLt (or shapes / pointers the sm_90a path does not take): the counts come to the
    // host, a synchronisation, so this cannot be captured in a CUDA graph.
    if (stream_capturing(be))
      return Status::error("grouped_gemm: this m_device call copies the counts to the host (no "
                           "sm_90a path for it), so it cannot be captured in a CUDA graph");
    std::vector<int64_t> m(static_cast<size_t>(args.groups));
    be.copy(m.data(), args.m_device, m.size() * sizeof(int64_t), Backend::CopyKind::kDeviceToHost);
    PACKMOE_RETURN_IF_ERROR(check_device_counts(args, m));
    const GroupedGemmArgs host = expand_packed_tokens(args, m);
    PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(host, m));
    return run_grouped(be, st.operands, host, m, choose_path(be, host, m));
  }
  PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(args, args.m));
  return run_grouped(be, st.operands, args, args.m, choose_path(be, args, args.m));
}

}  // namespace packmoe

