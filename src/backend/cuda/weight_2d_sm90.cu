// CUDA columnwise copy of 2D-scaled weights from their rowwise copy (formats/weight_2d.h): one
// launch over every group, one thread per output byte of the columnwise data and scales (MXFP8
// data: 16 bytes per thread). Invariant: pure byte moves, so the bytes equal
// weight_2d_columnwise_cpu's and hence the quantizer's columnwise copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace packmoe {
namespace {

constexpr int kThreads = 256;

// (4, G) device addresses: row_data, row_scale, col_data, col_scale.
struct Tables {
  const uintptr_t* addr;
  int64_t groups;
  __device__ __forceinline__ const uint8_t* row_data(int64_t g) const {
    return reinterpret_cast<const uint8_t*>(addr[g]);
  }
  __device__ __forceinline__ const uint8_t* row_scale(int64_t g) const {
    return reinterpret_cast<const uint8_t*>(addr[groups + g]);
  }
  __device__ __forceinline__ uint8_t* col_data(int64_t g) const {
    return reinterpret_cast<uint8_t*>(addr[2 * groups + g]);
  }
  __device__ __forceinline__ uint8_t* col_scale(int64_t g) const {
    return reinterpret_cast<uint8_t*>(addr[3 * groups + g]);
  }
};

// Per group: N*K/16 data items of 16 bytes (identical bytes in both copies), then N/32*K scales.
__global__ void __launch_bounds__(kThreads)
    mxfp8_columnwise_kernel(Tables t, int64_t n, int64_t k, bool vec) {
  const int64_t data_items = n * k / 16;
  const int64_t per_group = data_items + n / kMxfp8Block * k;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= t.groups * per_group) return;
  const int64_t g = i / per_group;
  const int64_t j = i - g * per_group;
  if (j < data_items) {
    const uint8_t* src = t.row_data(g) + j * 16;
    uint8_t* dst = t.col_data(g) + j * 16;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int b = 0; b < 16; ++b) dst[b] = src[b];
    }
    return;
  }
  const int64_t s = j - data_items;  // col_scale (N/32, K): [rb][c] = scale of tile (rb, c/32)
  const int64_t rb = s / k, c = s - rb * k;
  t.col_scale(g)[s] = t.row_scale(g)[rb * kMxfp8Block * (k / kMxfp8Block) + c / kMxfp8Block];
}

// Per group: K*N/2 transposed code bytes, then K*N/16 transposed tile scales.
__global__ void __launch_bounds__(kThreads)
    nvfp4_columnwise_kernel(Tables t, int64_t n, int64_t k) {
  const int64_t data_items = k * (n / 2);
  const int64_t per_group = data_items + k * (n / kNvfp4Block);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= t.groups * per_group) return;
  const int64_t g = i / per_group;
  const int64_t j = i - g * per_group;
  if (j < data_items) {  // byte (c, r/2) holds rows r (low nibble) and r + 1 of column c
    const int64_t c = j / (n / 2), r = 2 * (j - c * (n / 2));
    const int shift = static_cast<int>(c & 1) * 4;
    const uint8_t* rd = t.row_data(g);
    const uint8_t lo = (rd[r * (k / 2) + c / 2] >> shift) & 0xF;
    const uint8_t hi = (rd[(r + 1) * (k / 2) + c / 2] >> shift) & 0xF;
    t.col_data(g)[j] = static_cast<uint8_t>(lo | (hi << 4));
    return;
  }
  const int64_t s = j - data_items;  // col_scale (K, N/16): [c][rb] = scale of tile (rb, c/16)
  const int64_t c = s / (n / kNvfp4Block), rb = s - c * (n / kNvfp4Block);
  t.col_scale(g)[s] = t.row_scale(g)[rb * kNvfp4Block * (k / kNvfp4Block) + c / kNvfp4Block];
}

}  // namespace

Status weight_2d_columnwise_sm90(CudaBackend& be, const Weight2dCopies& w) {
  const int64_t groups = static_cast<int64_t>(w.row_data.size());
  std::vector<uintptr_t> addr;  // (4, G)
  addr.reserve(4 * groups);
  for (const void* p : w.row_data) addr.push_back(reinterpret_cast<uintptr_t>(p));
  for (const void* p : w.row_scale) addr.push_back(reinterpret_cast<uintptr_t>(p));
  for (void* p : w.col_data) addr.push_back(reinterpret_cast<uintptr_t>(p));
  for (void* p : w.col_scale) addr.push_back(reinterpret_cast<uintptr_t>(p));
  bool vec = true;  // 16-byte data moves when both data copies allow them
  for (int64_t g = 0; g < groups; ++g)
    vec = vec && (addr[g] & 15u) == 0 && (addr[2 * groups + g] & 15u) == 0;
  const Tables t{
      static_cast<const uintptr_t*>(be.upload(addr.data(), addr.size() * sizeof(uintptr_t))), groups};
  const int64_t n = w.rows, k = w.cols;
  const bool mx = w.format == Tiled2dFormat::kMxfp8;
  const int64_t per_group =
      mx ? n * k / 16 + n / kMxfp8Block * k : k * (n / 2) + k * (n / kNvfp4Block);
  const int64_t blocks = (groups * per_group + kThreads - 1) / kThreads;
  PACKMOE_CHECK(blocks < (int64_t{1} << 31), "weight_2d_columnwise: grid too large");
  if (mx)
    mxfp8_columnwise_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, be.stream()>>>(t, n, k, vec);
  else
    nvfp4_columnwise_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, be.stream()>>>(t, n, k);
  PACKMOE_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace packmoe
