// The grouped GEMM's operand preparation on CUDA (grouped_gemm_operands.h): the fast dequantize
// to BF16 and the fallback to the backend's dequantize kernels, both giving the same values.
//
// The fast dequantize is this file's bandwidth-oriented BF16 kernel (hardware FP8 -> F16 converts,
// a persistent grid, 8 x 8 elements a thread per tile) when the copies are 16-byte aligned, else
// the backend's dequantize_mxfp8 / dequantize_nvfp4 (any alignment). Both write the same values:
// f32_to_bf16 of mxfp8_decode, or of nvfp4_decode with S_dec = 1 (NaN payloads aside); a test
// checks the GEMM results of both paths are the same bytes.
#include "backend/cuda/grouped_gemm_operands.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/grouped_gemm_dequant.cuh"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace packmoe::gemm_cuda {

using namespace gemm_convert;

namespace {

struct Config {
  static constexpr int kDequantThreads = 256;       // fast dequantize: CTA size,
  static constexpr int kDequantUnroll = 8;          // independent loads in flight per thread,
  static constexpr int kDequantVec = 8;             // elements a lane converts per step (16 B out),
  static constexpr int kDequantCtasPerSm = 8;       // most resident CTAs per SM (persistent grid)
  static constexpr int64_t kTileElems = int64_t{kDequantThreads} * kDequantUnroll * kDequantVec;
  static_assert(kMxfp8Block % kDequantVec == 0 && kNvfp4Block % kDequantVec == 0,
                "a lane's elements share one block scale");
};

__global__ void fill_kernel(float* p, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}


// ---- fast dequantize to BF16 ------------------------------------------------------------------
// One persistent launch per operand (a few CTAs per SM). The operand is cut into tiles of
// Config::kTileElems elements, each within one group; tile t belongs to the group with the last
// tile_begin <= t (empty groups share tile_begin with the next one, so they are never chosen) and
// CTA b converts tiles b, b + grid, ... A lane converts kVec = 8 consecutive elements per step, so
// every warp-level store writes one contiguous 512 B span of BF16 (16 B a lane, streaming) and
// every load reads one contiguous span (8 B a lane MXFP8, 4 B NVFP4); kUnroll independent loads
// per thread are in flight before the first conversion, and the next tile's group lookup overlaps
// them. Values: the FP32 product of the exactly converted element and scale, rounded once to BF16
// (cvt.rn.bf16x2.f32, no FTZ), i.e. f32_to_bf16(mxfp8_decode(...)) /
// f32_to_bf16(nvfp4_decode(..., S_dec = 1)).

// Tile t of an operand's table belongs to the last job with begin <= t.
__device__ __forceinline__ int find_job(const DequantJob* t, int count, uint32_t tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(&t[mid].begin) <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Step u of a thread converts elements tile_start + (u * T + threadIdx.x) * 8 + [0, 8) of its
// job (grouped_gemm_dequant.cuh: one row, one block scale or 8 column codes).
template <DequantKind kKind>
__global__ void __launch_bounds__(Config::kDequantThreads)
    dequantize_to_bf16_kernel(const DequantJob* __restrict__ table, int count, uint32_t tiles) {
  constexpr int T = Config::kDequantThreads, U = Config::kDequantUnroll, V = Config::kDequantVec;
  uint32_t tile = blockIdx.x;
  if (tile >= tiles) return;
  int g = find_job(table, count, tile);
  for (;;) {
    const DequantJob job = table[g];
    const int64_t base = static_cast<int64_t>(tile - job.begin) * Config::kTileElems +
                         threadIdx.x * V;
    Raw8 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = base + u * (T * V);
      if (e < job.elems) raw[u] = load8<kKind>(job, e);
    }
    const uint32_t next = tile + gridDim.x;
    const int ng = next < tiles ? find_job(table, count, next) : g;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t e = base + u * (T * V);
      if (e >= job.elems) break;
      store8<true>(job.out, e, convert8<kKind>(raw[u]));
    }
    if (next >= tiles) break;
    tile = next;
    g = ng;
  }
}

// CTAs of a persistent dequantize launch: as many as fit on the device at once.
template <typename Kernel>
unsigned dequant_grid(Kernel kernel, uint64_t tiles) {
  int dev = 0, sms = 0, per_sm = 0;
  PACKMOE_CUDA_CHECK(cudaGetDevice(&dev));
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  PACKMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, Config::kDequantThreads, 0));
  per_sm = std::max(1, std::min(per_sm, Config::kDequantCtasPerSm));
  return static_cast<unsigned>(std::min<uint64_t>(tiles, static_cast<uint64_t>(sms) * per_sm));
}

// The layout of a stored copy, as the dequantize kernels and the sm_90a converter name it.
DequantKind dequant_kind(OperandFormat f, DType element, bool columnwise) {
  if (f == OperandFormat::kNvfp4) return DequantKind::kNvfp4;
  if (element == DType::kE5M2)
    return columnwise ? DequantKind::kE5m2Columnwise : DequantKind::kE5m2Rowwise;
  return columnwise ? DequantKind::kE4m3Columnwise : DequantKind::kE4m3Rowwise;
}

// The fast dequantize kernel of a stored copy (all share one signature).
using DequantKernel = void (*)(const DequantJob*, int, uint32_t);
DequantKernel dequant_kernel(DequantKind kind) {
  switch (kind) {
    case DequantKind::kE4m3Rowwise: return dequantize_to_bf16_kernel<DequantKind::kE4m3Rowwise>;
    case DequantKind::kE4m3Columnwise: return dequantize_to_bf16_kernel<DequantKind::kE4m3Columnwise>;
    case DequantKind::kE5m2Rowwise: return dequantize_to_bf16_kernel<DequantKind::kE5m2Rowwise>;
    case DequantKind::kE5m2Columnwise: return dequantize_to_bf16_kernel<DequantKind::kE5m2Columnwise>;
    case DequantKind::kNvfp4: break;
  }
  return dequantize_to_bf16_kernel<DequantKind::kNvfp4>;
}

}  // namespace

Stored stored_of(GemmOp op, OperandFormat f, bool is_lhs, int64_t m, int64_t n, int64_t k) {
  int64_t lr = 0, lc = 0;  // logical shape
  bool reduce_rows = false;
  switch (op) {
    case GemmOp::kFprop:
      lr = is_lhs ? m : n;  // X (m, K) | W (N, K)
      lc = k;
      break;
    case GemmOp::kDgrad:
      lr = is_lhs ? m : n;  // dY (m, N) | W (N, K)
      lc = is_lhs ? n : k;
      reduce_rows = !is_lhs;
      break;
    case GemmOp::kWgrad:
      lr = m;  // dY (m, N) | X (m, K)
      lc = is_lhs ? n : k;
      reduce_rows = true;
      break;
  }
  Stored s{lr, lc, false, false};
  if (reduce_rows && f == OperandFormat::kMxfp8) s.columnwise = true;
  if (reduce_rows && f == OperandFormat::kNvfp4) s = Stored{lc, lr, false, true};
  return s;
}

namespace {

// Whether the fast dequantize kernels (and the sm_90a kernel's converter) read quantized operand
// `o`: 16-byte aligned copies and, for MXFP8 columnwise scales, rows of 16 bytes.
bool fast_dequant_ok(const GemmOperand& o, const std::vector<Stored>& shape,
                     const std::vector<bool>& active) {
  for (size_t g = 0; g < shape.size(); ++g)
    if (active[g] && (!aligned(o.data[g]) ||
                      (shape[g].columnwise && (!aligned(o.scale[g]) || shape[g].cols % 16))))
      return false;
  return true;
}

}  // namespace

// Tiles of Config::kTileElems elements.
uint64_t dequant_jobs(const GemmOperand& o, const std::vector<Stored>& shape,
                      const std::vector<bool>& active, const std::vector<uint8_t*>& out,
                      std::vector<DequantJob>& jobs) {
  const DequantKind kind = dequant_kind(o.format, o.element, shape[0].columnwise);
  jobs.assign(shape.size(), DequantJob{});
  uint64_t tiles = 0;
  for (size_t g = 0; g < shape.size(); ++g) {
    DequantJob& d = jobs[g];
    d.data = static_cast<const uint8_t*>(o.data[g]);
    d.scale = static_cast<const uint8_t*>(o.scale[g]);
    d.out = out[g];
    d.begin = static_cast<uint32_t>(tiles);
    d.elems = active[g] ? shape[g].rows * shape[g].cols : 0;
    d.cols = o.format == OperandFormat::kMxfp8 ? shape[g].cols : 0;
    d.kind = kind;
    tiles += (d.elems + Config::kTileElems - 1) / Config::kTileElems;
  }
  PACKMOE_CHECK(tiles < (1ull << 31), "dequantize over " << tiles << " tiles");
  return tiles;
}

// Misaligned BF16 values are rare (only odd shapes). Validity of the quantized pointers was checked
// by validate_grouped_gemm (non-null for active groups).
Status prepare(CudaBackend& be, OperandScratch& st, const GemmOperand& o,
               const std::vector<Stored>& shape, const std::vector<bool>& active, uint8_t* dst,
               const std::vector<size_t>& offset, Prepared& out,
               std::vector<DequantJob>* in_gemm) {
  const size_t G = shape.size();
  out.ptr.assign(G, nullptr);
  out.shape = shape;
  if (o.format == OperandFormat::kBF16 || !o.bf16.empty()) {  // BF16 values at hand
    const std::vector<const void*>& src = o.format == OperandFormat::kBF16 ? o.data : o.bf16;
    bool ok = true;
    for (size_t g = 0; g < G; ++g)
      if (active[g] && !aligned(src[g])) ok = false;
    for (size_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      if (ok) {
        out.ptr[g] = src[g];
      } else {
        const size_t bytes = static_cast<size_t>(shape[g].rows * shape[g].cols) * 2;
        PACKMOE_CUDA_CHECK(cudaMemcpyAsync(dst + offset[g], src[g], bytes,
                                           cudaMemcpyDeviceToDevice, be.stream()));
        out.ptr[g] = dst + offset[g];
      }
    }
    return Status::ok();
  }
  std::vector<void*> outs(G, nullptr);
  for (size_t g = 0; g < G; ++g) {
    if (!active[g]) continue;
    if (o.scale[g] == nullptr)
      return Status::error("grouped_gemm: group " + std::to_string(g) + " has no block scales");
    outs[g] = dst + offset[g];
  }
  for (size_t g = 0; g < G; ++g) out.ptr[g] = outs[g];

  if (fast_dequant_ok(o, shape, active)) {
    std::vector<uint8_t*> dst_of(G, nullptr);
    for (size_t g = 0; g < G; ++g) dst_of[g] = static_cast<uint8_t*>(outs[g]);
    std::vector<DequantJob> table;
    const uint64_t tiles = dequant_jobs(o, shape, active, dst_of, table);
    if (in_gemm != nullptr) {  // the sm_90a kernel converts them (stream_dequant)
      *in_gemm = std::move(table);
      return Status::ok();
    }
    if (tiles == 0) return Status::ok();
    const auto* dt = static_cast<const DequantJob*>(be.upload(table.data(), G * sizeof(DequantJob)));
    const DequantKernel kernel = dequant_kernel(table[0].kind);
    kernel<<<dequant_grid(kernel, tiles), Config::kDequantThreads, 0, be.stream()>>>(
        dt, static_cast<int>(G), static_cast<uint32_t>(tiles));
    PACKMOE_CUDA_CHECK_LAUNCH();
    return Status::ok();
  }

  // Fallback: the backend's grouped dequantize kernels (any alignment).
  if (o.format == OperandFormat::kMxfp8) {
    Mxfp8Copy q;
    q.element = o.element;
    q.columnwise = shape[0].columnwise;
    q.cols = shape[0].cols;
    for (size_t g = 0; g < G; ++g) {
      PACKMOE_CHECK(shape[g].cols == q.cols, "MXFP8 copies share their column count");
      q.rows.push_back(active[g] ? shape[g].rows : 0);
      q.data.push_back(active[g] ? o.data[g] : nullptr);
      q.scale.push_back(active[g] ? o.scale[g] : nullptr);
    }
    PACKMOE_RETURN_IF_ERROR(ops::dequantize_mxfp8(be, q, DType::kBF16, outs));
  } else {
    // Every NVFP4 copy is a row-major sequence of 16-element blocks with one scale byte each, so
    // group g is viewed as (rows * cols / 16, 16): one launch even when the stored row length
    // differs per group (the wgrad copies are (N, m_g) and (K, m_g)). Decode scale 1: the
    // operand holds e2m1 * e4m3 exactly; S_dec goes into alpha.
    Nvfp4Copy q;
    q.cols = kNvfp4Block;
    for (size_t g = 0; g < G; ++g) {
      q.rows.push_back(active[g] ? shape[g].rows * shape[g].cols / kNvfp4Block : 0);
      q.data.push_back(active[g] ? o.data[g] : nullptr);
      q.scale.push_back(active[g] ? o.scale[g] : nullptr);
    }
    float* ones = static_cast<float*>(st.ones.get(be, G * sizeof(float)));
    if (st.ones.take_grown()) {
      // Filled up to its (rounded-up) capacity, so later calls with more groups see ones too.
      const int n = static_cast<int>(round_up(G * sizeof(float), kGrowQuantum) / 4);
      fill_kernel<<<(n + 255) / 256, 256, 0, be.stream()>>>(ones, 1.0f, n);
      PACKMOE_CUDA_CHECK_LAUNCH();
    }
    q.decode_scale = ones;
    PACKMOE_RETURN_IF_ERROR(ops::dequantize_nvfp4(be, q, DType::kBF16, outs));
  }
  return Status::ok();
}


unsigned dequantize_grid(DequantKind kind, uint64_t tiles) {
  return dequant_grid(dequant_kernel(kind), tiles);
}

namespace {
// Grid (x, groups): group blockIdx.y's words, unless its device count says it has tokens.
__global__ void zero_groups_kernel(const int64_t* m, void* const* outs, int64_t vecs) {
  if (m != nullptr && m[blockIdx.y] != 0) return;
  uint4* o = static_cast<uint4*>(outs[blockIdx.y]);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    o[i] = make_uint4(0, 0, 0, 0);
}
}  // namespace

void launch_zero_groups(cudaStream_t s, const int64_t* m, void* const* outs, int groups,
                        int64_t vecs) {
  const unsigned x = static_cast<unsigned>(std::clamp<int64_t>((vecs + 255) / 256, 1, 64));
  zero_groups_kernel<<<dim3(x, static_cast<unsigned>(groups)), 256, 0, s>>>(m, outs, vecs);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

void launch_dequantize(CudaBackend& be, DequantKind kind, const DequantJob* table, int count,
                       uint32_t tiles, unsigned grid) {
  dequant_kernel(kind)<<<grid, Config::kDequantThreads, 0, be.stream()>>>(table, count, tiles);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace packmoe::gemm_cuda
