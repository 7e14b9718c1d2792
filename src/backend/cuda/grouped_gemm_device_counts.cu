// The grouped GEMM with device token counts on the sm_90a kernel (grouped_gemm_device_counts.h).
//
// An m_device call on the sm_90a path queues, on be.stream(): the zeroing of empty wgrad groups
// (overwrite), the dequantize of quantized operands (token-side ones over the whole m_capacity
// buffer: the packed layout is the per-group layouts back to back, so this writes group g's BF16
// values at off_g exactly where a per-group dequantize would), the device schedule and the GEMM.
// Nothing reads the counts on the host. Everything the launches read besides their parameters
// (dequantize tables, map templates, the schedule's output) belongs to the call's DeviceCall,
// made on the first call with that signature (outside graph capture: it encodes, allocates and
// uploads) and kept, unchanged, for the life of the process; the BF16 scratch is shared by all
// signatures (DeviceCalls::scratch), so their work, graph replays included, must run in order on
// the backend's stream. A captured graph can be replayed with new counts and operand values for as
// long as the pointers it names live.
#include "backend/cuda/grouped_gemm_device_counts.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cuda/grouped_gemm_cuda.h"
#include "backend/cuda/grouped_gemm_operands.h"
#include "backend/cuda/grouped_gemm_sm90.h"

namespace packmoe::gemm_cuda {
namespace {

using gemm_convert::DequantJob;
using gemm_convert::DequantKind;

// The state of one m_device call signature: its dequantize tables and map plan live in device
// memory kept for the life of the process and never reused by another signature (the BF16
// scratch they point to is DeviceCalls', shared).
struct DeviceDequant {
  const DequantJob* table = nullptr;  // device, owned by the DeviceCall
  int count = 0;
  uint32_t tiles = 0;  // 0: nothing to dequantize
  unsigned grid = 0;
  DequantKind kind = DequantKind::kNvfp4;
};

struct DeviceCall {
  const Sm90DevicePlan* plan = nullptr;
  DeviceDequant lhs, rhs;
  void* const* zero_outs = nullptr;  // wgrad overwrite: (G,) outputs on the device
  int64_t zero_vecs = 0;             // 16-byte words per output
};

// The m_device calls of one backend, by signature (device_call_key): never freed or reused.
struct DeviceCalls {
  std::map<std::vector<uintptr_t>, DeviceCall> calls;
  // BF16 copies of their quantized operands: one buffer shared by every signature (their work
  // runs in stream order), replaced by a larger one when a new signature needs more; the old
  // ones stay allocated for the signatures (and captured graphs) that use them.
  uint8_t* scratch = nullptr;
  size_t scratch_bytes = 0;
};

DeviceCalls& device_calls(CudaBackend& be) {
  static std::mutex mu;
  static auto* calls = new std::map<CudaBackend*, std::unique_ptr<DeviceCalls>>();  // leaked
  std::lock_guard<std::mutex> lock(mu);
  auto& c = (*calls)[&be];
  if (!c) c = std::make_unique<DeviceCalls>();
  return *c;
}

constexpr size_t kMaxDeviceCalls = 16384;  // signatures kept (each a few KB plus its scratch)

// The sm_90a problem of an m_device call with the caller's pointers (the BF16 copies of quantized
// operands are filled in by make_device_call); shapes decide everything else.
Sm90DeviceGemm device_problem(const GroupedGemmArgs& a) {
  const TokenStrides ts = token_strides(a);
  Sm90DeviceGemm p = sm90_op_shape(a);
  p.groups = a.groups;
  p.capacity = a.m_capacity;
  p.align = gemm_token_alignment(a.lhs.format);
  if (a.lhs.format == OperandFormat::kNvfp4) {
    p.alpha_lhs = static_cast<const float*>(a.lhs.decode_scale);
    p.alpha_rhs = static_cast<const float*>(a.rhs.decode_scale);
  }
  // Token-side operands: BF16 bytes per token are 2 * (their token-row length).
  const int64_t lhs_cols = a.op == GemmOp::kFprop ? a.k : a.n;
  p.a.base = a.lhs.data[0];
  p.a.token_bytes = 2 * lhs_cols;
  if (a.op == GemmOp::kWgrad) {
    p.b.base = a.rhs.data[0];
    p.b.token_bytes = 2 * a.k;
    p.out.ptr.assign(a.out.begin(), a.out.end());
  } else {
    p.b.ptr = a.rhs.data;
    p.out.base = a.out[0];
    p.out.token_bytes = ts.out;
  }
  return p;
}

// Whether the call can take the no-sync path: an sm_90a device and kernel, at most
// kSm90MaxDeviceGroups groups, the kernel's shape rules for any counts, 16-byte aligned data and
// outputs (no staging) and the fast dequantize's alignment of MXFP8 columnwise scales.
bool device_path_ok(const GroupedGemmArgs& a, GemmPath path) {
  if (path != GemmPath::kSm90 || a.groups > kSm90MaxDeviceGroups || a.m_capacity >= (int64_t{1} << 31))
    return false;
  const Sm90DeviceGemm p = device_problem(a);
  const int64_t align = gemm_token_alignment(a.lhs.format);
  if (!sm90_gemm_shape_ok(sm90_device_geometry(p, sm90_uniform_split(p.capacity, p.groups, align))))
    return false;
  auto all_aligned = [](const auto& v) {
    return std::all_of(v.begin(), v.end(), [](const void* q) { return aligned(q); });
  };
  if (!all_aligned(a.lhs.data) || !all_aligned(a.rhs.data) || !all_aligned(a.out)) return false;
  for (const GemmOperand* o : {&a.lhs, &a.rhs}) {
    const bool is_lhs = o == &a.lhs;
    const Stored sh = stored_of(a.op, o->format, is_lhs, a.m_capacity, a.n, a.k);
    if (sh.columnwise && (!all_aligned(o->scale) || sh.cols % 16 != 0)) return false;
  }
  return true;
}

// The signature of a call: everything its DeviceCall depends on.
std::vector<uintptr_t> device_call_key(const GroupedGemmArgs& a, Sm90Tiles tiles) {
  const std::vector<uintptr_t> head = {
      static_cast<uintptr_t>(a.op), static_cast<uintptr_t>(a.lhs.format),
      static_cast<uintptr_t>(a.lhs.element), static_cast<uintptr_t>(a.rhs.element),
      static_cast<uintptr_t>(a.n), static_cast<uintptr_t>(a.k), static_cast<uintptr_t>(a.groups),
      static_cast<uintptr_t>(a.m_capacity), static_cast<uintptr_t>(a.out_dtype),
      a.accumulate, reinterpret_cast<uintptr_t>(a.m_device),
      reinterpret_cast<uintptr_t>(a.lhs.decode_scale), reinterpret_cast<uintptr_t>(a.rhs.decode_scale),
      static_cast<uintptr_t>(tiles.bn), static_cast<uintptr_t>(tiles.cluster)};
  std::vector<uintptr_t> k = head;
  for (const auto* v : {&a.lhs.data, &a.lhs.scale, &a.rhs.data, &a.rhs.scale}) {
    k.push_back(v->size());
    for (const void* q : *v) k.push_back(reinterpret_cast<uintptr_t>(q));
  }
  for (void* q : a.out) k.push_back(reinterpret_cast<uintptr_t>(q));
  return k;
}

// Device memory that lives as long as the process (a captured graph may read it), filled in the
// order of be's stream: a cudaMemcpy would run on the legacy stream, which the backend's
// non-blocking stream does not wait for (its DMA may land after the kernels that read it).
void* keep_on_device(CudaBackend& be, const void* host, size_t bytes) {
  void* d = nullptr;
  PACKMOE_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
  be.copy(d, host, bytes, Backend::CopyKind::kHostToDevice);
  return d;
}

// The dequantize of quantized operand `o` into `out` (BF16, 256-byte aligned per group): one group
// over the whole capacity for a token-side operand, G weight groups otherwise.
DeviceDequant make_device_dequant(CudaBackend& be, const GemmOperand& o,
                                  const std::vector<Stored>& shape,
                                  const std::vector<uint8_t*>& out) {
  DeviceDequant d;
  std::vector<DequantJob> table;
  const uint64_t tiles =
      dequant_jobs(o, shape, std::vector<bool>(shape.size(), true), out, table);
  d.table = static_cast<const DequantJob*>(
      keep_on_device(be, table.data(), table.size() * sizeof(DequantJob)));
  d.count = static_cast<int>(table.size());
  d.tiles = static_cast<uint32_t>(tiles);
  d.kind = table[0].kind;
  d.grid = tiles ? dequantize_grid(d.kind, tiles) : 0;
  return d;
}

DeviceCall make_device_call(CudaBackend& be, DeviceCalls& st, const GroupedGemmArgs& a,
                            Sm90Tiles tiles) {
  const size_t G = static_cast<size_t>(a.groups);
  const OperandFormat f = a.lhs.format;
  const bool wgrad = a.op == GemmOp::kWgrad;
  Sm90DeviceGemm p = device_problem(a);
  p.tiles = tiles;
  DeviceCall call;
  if (f != OperandFormat::kBF16) {
    // BF16 copies: token-side operands over the whole capacity, weights per group.
    const Stored lhs_cap = stored_of(a.op, f, true, a.m_capacity, a.n, a.k);
    const Stored rhs_sh = stored_of(a.op, f, false, a.m_capacity, a.n, a.k);
    const size_t lhs_bytes = round_up(static_cast<size_t>(lhs_cap.rows * lhs_cap.cols) * 2,
                                      kScratchAlign);
    const size_t rhs_group = round_up(static_cast<size_t>(rhs_sh.rows * rhs_sh.cols) * 2,
                                      kScratchAlign);
    const size_t rhs_groups = wgrad ? 1 : G;
    const size_t need = lhs_bytes + rhs_groups * rhs_group;
    if (st.scratch_bytes < need) {  // never freed: earlier signatures may still use it
      PACKMOE_CUDA_CHECK(cudaMalloc(&st.scratch, need));
      st.scratch_bytes = need;
    }
    uint8_t* scratch = st.scratch;
    call.lhs = make_device_dequant(be, a.lhs, {lhs_cap}, {scratch});
    std::vector<uint8_t*> rhs_out;
    for (size_t g = 0; g < rhs_groups; ++g) rhs_out.push_back(scratch + lhs_bytes + g * rhs_group);
    call.rhs = make_device_dequant(be, a.rhs, std::vector<Stored>(rhs_groups, rhs_sh), rhs_out);
    p.a.base = scratch;
    if (wgrad)
      p.b.base = rhs_out[0];
    else
      p.b.ptr.assign(rhs_out.begin(), rhs_out.end());
  }
  if (wgrad && !a.accumulate) {
    call.zero_outs = static_cast<void* const*>(keep_on_device(be, a.out.data(), G * sizeof(void*)));
    call.zero_vecs = a.n * a.k * (a.out_dtype == DType::kBF16 ? 2 : 4) / 16;
  }
  call.plan = make_sm90_device_plan(be, p);
  return call;
}

}  // namespace

bool stream_capturing(CudaBackend& be) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  PACKMOE_CUDA_CHECK(cudaStreamIsCapturing(be.stream(), &st));
  return st != cudaStreamCaptureStatusNone;
}

Result<bool> grouped_gemm_device_counts(CudaBackend& be, const GroupedGemmArgs& a) {
  DeviceCalls& st = device_calls(be);
  // Shape and pointer checks, with every group taken as non-empty (every pointer must be valid).
  const std::vector<int64_t> probe(static_cast<size_t>(a.groups), gemm_token_alignment(a.lhs.format));
  PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(expand_packed_tokens(a, probe), probe));
  if (!device_path_ok(a, choose_path(be, expand_packed_tokens(a, probe), probe))) return false;
  const Sm90Tiles tiles = sm90_device_tiles(be, device_problem(a));
  const std::vector<uintptr_t> key = device_call_key(a, tiles);
  auto it = st.calls.find(key);
  if (it == st.calls.end()) {
    if (stream_capturing(be))
      return Status::error("grouped_gemm: this m_device call has not run before; run it once "
                           "outside CUDA-graph capture, then capture it");
    if (st.calls.size() >= kMaxDeviceCalls)
      return Status::error("grouped_gemm: more than " + std::to_string(kMaxDeviceCalls) +
                           " distinct m_device call signatures (their device state is kept for "
                           "CUDA graphs and never freed)");
    it = st.calls.emplace(key, make_device_call(be, st, a, tiles)).first;
  }
  const DeviceCall& call = it->second;
  const auto* m = static_cast<const int64_t*>(a.m_device);
  cudaStream_t s = be.stream();
  // wgrad overwrite: a group with m_g = 0 gets zeros (the host path's, decided on the device).
  if (call.zero_outs != nullptr)
    launch_zero_groups(s, m, call.zero_outs, static_cast<int>(a.groups), call.zero_vecs);
  for (const DeviceDequant* d : {&call.lhs, &call.rhs}) {
    if (d->tiles == 0) continue;
    launch_dequantize(be, d->kind, d->table, d->count, d->tiles, d->grid);
  }
  PACKMOE_RETURN_IF_ERROR(grouped_gemm_sm90_device(be, *call.plan, m));
  return true;
}

}  // namespace packmoe::gemm_cuda
