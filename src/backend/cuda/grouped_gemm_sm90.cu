// The sm_90a grouped GEMM (grouped_gemm_sm90.h): a persistent, warp-specialized wgmma kernel.
//
// Work: the output of every active group is cut into kSm90TileM x BN tiles (BN from the tile
// heuristic, grouped_gemm_sm90_tiles.h); tile indices run over all groups (group g owns
// [tile_begin_g, tile_begin_g + m_tiles_g * n_tiles), n fastest, so CTAs running at the same time
// share A rows and B columns through L2). CTA b takes tiles b, b + grid, ... (grid = #SMs).
//
// CTA = 3 warpgroups. Warpgroup 0 gives its registers away (setmaxnreg) and one thread of it is the
// producer: per 64-deep reduction step it waits for a free shared-memory stage, announces the
// stage's bytes on the stage's `full` mbarrier and issues TMA loads of the A (128 x 64) and B
// (64 x BN) tiles. Warpgroups 1 and 2 are the consumers, rows [0, 64) and [64, 128) of the tile:
// per stage they wait on `full`, issue four m64nBNk16 wgmmas (FP32 accumulators in registers),
// and release the stage on its `empty` mbarrier once those wgmmas have completed (one step later,
// so the tensor cores always have the next stage queued). After the last step each consumer writes
// its 64 x BN fragment straight from registers: rows >= mk and columns >= nk are masked.
//
// Shared memory, 128-byte swizzle (the TMA maps and the wgmma descriptors agree on it):
//   K-major operand (rows x 64 reduction elements): row r at r * 128 B, 8-row atoms of 1024 B; a
//     wgmma k16 step advances the descriptor's start by 32 B inside the swizzle row.
//   MN-major operand (64 reduction rows x 64 output elements per 8 KB block, blocks along MN):
//     reduction row k at k * 128 B; leading byte offset = 8192 (next 64 MN elements), stride byte
//     offset = 1024 (next 8 reduction rows); a k16 step advances the start by 2048 B.
// Partial tiles: TMA fills elements outside a group's tensor with zeros, so rows beyond m_g add
// exact zeros to a wgrad reduction and partial M / N / K tiles need no special path.
//
// Exactness and determinism: the products of BF16 values are exact in FP32 and each output is the
// FP32 sum over the reduction in a fixed order (64-wide steps, wgmma's internal order inside a
// step); no split-K, no atomics. The same shapes give the same bytes, wherever the operands live.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backend/cuda/grouped_gemm_sm90.h"
#include "backend/cuda/grouped_gemm_sm90_ptx.cuh"
#include "backend/cuda/grouped_gemm_sm90_tiles.h"

namespace packmoe {
namespace {

using namespace sm90;

constexpr int kThreads = 384;            // producer warpgroup + 2 consumer warpgroups
constexpr int kBox = 64;                 // elements in one 128-byte swizzle row
constexpr int kBlockBytes = kBox * kSm90TileK * 2;  // one 64 x 64 BF16 box: 8 KB
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kSm90TileK == kBox, "one swizzle row per reduction step");

template <int BN>
struct Layout {
  static constexpr int kABytes = kSm90TileM * kSm90TileK * 2;
  static constexpr int kBBytes = BN * kSm90TileK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + align
};

// One active group on the device.
struct GroupTiles {
  void* out;
  int32_t mk, kred;
  int32_t tile_begin;
  int32_t group;  // the caller's group index (alpha); tensor maps are indexed like this table
};

struct Params {
  const CUtensorMap* a_maps;
  const CUtensorMap* b_maps;
  const GroupTiles* groups;
  int32_t num_groups, total_tiles, n_tiles, nk;
  int32_t out_bf16, accumulate;
  const float* alpha_lhs;
  const float* alpha_rhs;
};

__device__ __forceinline__ int find_group(const GroupTiles* t, int count, int tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t[mid].tile_begin <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <int BN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_step(float (&acc)[BN / 2], uint64_t da, uint64_t db,
                                           uint32_t scale_d) {
  if constexpr (BN == 256)
    wgmma_m64n256k16<kTransA, kTransB>(acc, da, db, scale_d);
  else
    wgmma_m64n128k16<kTransA, kTransB>(acc, da, db, scale_d);
}

template <int BN, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void produce(const Params& p, uint8_t* smem, uint64_t* full,
                                        uint64_t* empty) {
  using L = Layout<BN>;
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    const int gi = find_group(p.groups, p.num_groups, tile);
    const GroupTiles g = p.groups[gi];
    const int local = tile - g.tile_begin;
    const int m0 = (local / p.n_tiles) * kSm90TileM;
    const int n0 = (local % p.n_tiles) * BN;
    const CUtensorMap* am = p.a_maps + gi;
    const CUtensorMap* bm = p.b_maps + gi;
    tensormap_acquire(am);
    tensormap_acquire(bm);
    const int k_steps = (g.kred + kSm90TileK - 1) / kSm90TileK;
    for (int ks = 0; ks < k_steps; ++ks) {
      mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* sa = smem + stage * L::kStageBytes;
      uint8_t* sb = sa + L::kABytes;
      mbar_arrive_expect_tx(&full[stage], L::kStageBytes);
      const int k0 = ks * kSm90TileK;
      if constexpr (kAKMajor) {
        tma_load_2d(sa, am, &full[stage], k0, m0);  // box (64 k, 128 rows)
      } else {
        tma_load_2d(sa, am, &full[stage], m0, k0);  // boxes (64 rows, 64 k)
        tma_load_2d(sa + kBlockBytes, am, &full[stage], m0 + kBox, k0);
      }
      if constexpr (kBKMajor) {
        tma_load_2d(sb, bm, &full[stage], k0, n0);  // box (64 k, BN cols)
      } else {
#pragma unroll
        for (int j = 0; j < BN / kBox; ++j)
          tma_load_2d(sb + j * kBlockBytes, bm, &full[stage], n0 + j * kBox, k0);
      }
      if (++stage == L::kStages) stage = 0, phase ^= 1;
    }
  }
}

// Consumer warpgroup `half` (0: tile rows [0, 64), 1: [64, 128)), thread t of it.
template <int BN, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void consume(const Params& p, uint8_t* smem, uint64_t* full,
                                        uint64_t* empty, int half, int t) {
  using L = Layout<BN>;
  constexpr int kTransA = kAKMajor ? 0 : 1, kTransB = kBKMajor ? 0 : 1;
  // Descriptor steps per k16: 32 B inside the swizzle row (K-major), two 8-row atoms (MN-major).
  constexpr uint32_t kStepA = kAKMajor ? 32 : 2048, kStepB = kBKMajor ? 32 : 2048;
  constexpr uint32_t kLboA = kAKMajor ? 16 : kBlockBytes, kLboB = kBKMajor ? 16 : kBlockBytes;
  const uint32_t smem_base = smem_addr(smem);
  const int warp = t / 32, lane = t % 32;
  float acc[BN / 2];
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    const int gi = find_group(p.groups, p.num_groups, tile);
    const GroupTiles g = p.groups[gi];
    const int local = tile - g.tile_begin;
    const int m0 = (local / p.n_tiles) * kSm90TileM;
    const int n0 = (local % p.n_tiles) * BN;
    const int k_steps = (g.kred + kSm90TileK - 1) / kSm90TileK;
    int prev = 0;
    for (int ks = 0; ks < k_steps; ++ks) {
      mbar_wait(&full[stage], phase);
      // This warpgroup's 64 rows of A: the second 8 KB (64 rows x 128 B, or the second MN box).
      const uint32_t sa = smem_base + stage * L::kStageBytes + half * kBlockBytes;
      const uint32_t sb = smem_base + stage * L::kStageBytes + L::kABytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kSm90TileK / 16; ++kk) {
        const uint64_t da = wgmma_desc(sa + kk * kStepA, kLboA, 1024);
        const uint64_t db = wgmma_desc(sb + kk * kStepB, kLboB, 1024);
        wgmma_step<BN, kTransA, kTransB>(acc, da, db, (ks | kk) != 0 ? 1u : 0u);
      }
      wgmma_commit();
      if (ks > 0) {
        wgmma_wait<1>();  // the previous step's wgmmas are done: its stage is free
        if (t == 0) mbar_arrive(&empty[prev]);
      }
      prev = stage;
      if (++stage == L::kStages) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    if (t == 0) mbar_arrive(&empty[prev]);

    // Epilogue: row 16 warp + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1).
    const int row = m0 + half * 64 + warp * 16 + lane / 4;
    const int col = n0 + 2 * (lane % 4);
    const bool scaled = p.alpha_lhs != nullptr;
    const float alpha = scaled ? p.alpha_lhs[g.group] * p.alpha_rhs[g.group] : 1.0f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int c = col + 8 * j;
      if (c >= p.nk) continue;  // nk is even: c + 1 < nk too
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row + 8 * i;
        if (r >= g.mk) continue;
        const size_t at = static_cast<size_t>(r) * p.nk + c;
        float v0 = acc[4 * j + 2 * i], v1 = acc[4 * j + 2 * i + 1];
        if (p.out_bf16) {
          if (scaled) v0 *= alpha, v1 *= alpha;
          *reinterpret_cast<__nv_bfloat162*>(static_cast<uint16_t*>(g.out) + at) =
              __floats2bfloat162_rn(v0, v1);
        } else {
          float2* q = reinterpret_cast<float2*>(static_cast<float*>(g.out) + at);
          if (p.accumulate) {
            const float2 old = *q;
            v0 = __fmaf_rn(alpha, v0, old.x);
            v1 = __fmaf_rn(alpha, v1, old.y);
          } else if (scaled) {
            v0 *= alpha, v1 *= alpha;
          }
          *q = make_float2(v0, v1);
        }
      }
    }
  }
}

template <int BN, bool kAKMajor, bool kBKMajor>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm_sm90_kernel(const __grid_constant__ Params p) {
  using L = Layout<BN>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kStages * L::kStageBytes);
  uint64_t* empty = full + L::kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(&full[s], 1);   // the producer's expect_tx arrival (+ the TMA bytes)
      mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (t == 0) produce<BN, kAKMajor, kBKMajor>(p, smem, full, empty);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consume<BN, kAKMajor, kBKMajor>(p, smem, full, empty, wg - 1, t);
  }
}

// ---- host ---------------------------------------------------------------------------------------

// 2-D BF16 tensor (outer, inner) row-major, box (box_outer, 64) with 128-byte swizzle.
struct MapKey {
  const void* ptr;
  int64_t inner, outer;
  int box_outer;
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && inner == o.inner && outer == o.outer && box_outer == o.box_outer;
  }
};
struct MapKeyHash {
  size_t operator()(const MapKey& k) const {
    size_t h = std::hash<const void*>()(k.ptr);
    for (int64_t v : {k.inner, k.outer, static_cast<int64_t>(k.box_outer)})
      h = h * 0x9E3779B97F4A7C15ull + static_cast<size_t>(v);
    return h;
  }
};

class MapCache {
 public:
  // Encoded maps are pure functions of the key; the cache only saves host time (weights keep
  // their pointers from call to call).
  const CUtensorMap& get(const MapKey& k) {
    auto it = maps_.find(k);
    if (it != maps_.end()) return it->second;
    if (maps_.size() >= kMaxMaps) maps_.clear();
    CUtensorMap m;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k.inner), static_cast<cuuint64_t>(k.outer)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k.inner) * 2};
    const cuuint32_t box[2] = {kBox, static_cast<cuuint32_t>(k.box_outer)};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = encode()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(k.ptr),
                                dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    PACKMOE_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (" << static_cast<int>(r)
                                         << ") for a (" << k.outer << ", " << k.inner
                                         << ") BF16 tensor");
    return maps_.emplace(k, m).first->second;
  }

  std::mutex mu;

 private:
  static constexpr size_t kMaxMaps = size_t{1} << 16;
  static PFN_cuTensorMapEncodeTiled_v12000 encode() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q{};
      PACKMOE_CUDA_CHECK(
          cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
      PACKMOE_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                    "the driver has no cuTensorMapEncodeTiled");
      return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }();
    return fn;
  }
  std::unordered_map<MapKey, CUtensorMap, MapKeyHash> maps_;
};

MapCache& map_cache() {
  static auto* c = new MapCache();  // leaked: lives as long as the process-wide backend
  return *c;
}

// Test and tuning knobs: PACKMOE_GEMM_SM90_TILE_N (128 | 256) forces the tile width,
// PACKMOE_GEMM_SM90_CTAS caps the persistent grid (a small grid makes every CTA walk many tiles).
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : 0;
}

template <int BN, bool kAKMajor, bool kBKMajor>
void launch(CudaBackend& be, const Params& p) {
  auto kernel = grouped_gemm_sm90_kernel<BN, kAKMajor, kBKMajor>;
  static const bool configured = [&] {
    PACKMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            Layout<BN>::kSmemBytes));
    return true;
  }();
  (void)configured;
  int grid = std::min(p.total_tiles, be.sm_count());
  const int cap = env_int("PACKMOE_GEMM_SM90_CTAS");
  if (cap > 0) grid = std::min(grid, cap);
  kernel<<<grid, kThreads, Layout<BN>::kSmemBytes, be.stream()>>>(p);
  PACKMOE_CUDA_CHECK_LAUNCH();
}

template <int BN>
void launch_layout(CudaBackend& be, const Params& p, bool a_k, bool b_k) {
  if (a_k && b_k) return launch<BN, true, true>(be, p);
  if (a_k && !b_k) return launch<BN, true, false>(be, p);
  if (!a_k && !b_k) return launch<BN, false, false>(be, p);
  PACKMOE_CHECK(false, "grouped_gemm_sm90: MN-major A with K-major B is not instantiated");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool sm90_gemm_device_ok(CudaBackend& be) {
  static std::mutex mu;
  static std::unordered_map<int, bool> ok;
  std::lock_guard<std::mutex> lock(mu);
  auto it = ok.find(be.device_index());
  if (it != ok.end()) return it->second;
  int major = 0, minor = 0;
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be.device_index()));
  PACKMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, be.device_index()));
  return ok[be.device_index()] = major == 9 && minor == 0;
}

bool sm90_gemm_shape_ok(const Sm90Gemm& p) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (p.nk <= 0 || p.nk % 8 != 0 || p.nk >= kMax) return false;
  if (p.a_k_major == false && p.b_k_major == true) return false;
  if (p.accumulate && p.out_bf16) return false;
  for (size_t g = 0; g < p.mk.size(); ++g) {
    const int64_t mk = p.mk[g], kred = p.kred[g];
    if (mk <= 0 || kred <= 0) continue;
    if (mk >= kMax || kred >= kMax) return false;
    if ((p.a_k_major ? kred : mk) % 8 != 0) return false;  // A row length
    if (p.b_k_major && kred % 8 != 0) return false;         // B row length (else nk)
  }
  return true;
}

Status grouped_gemm_sm90(CudaBackend& be, const Sm90Gemm& p) {
  if (!sm90_gemm_shape_ok(p)) return Status::error("grouped_gemm_sm90: unsupported shape");
  const size_t G = p.mk.size();
  Sm90Tiles tiles = choose_sm90_tiles(p.mk, p.kred, p.nk, be.sm_count());
  const int forced = env_int("PACKMOE_GEMM_SM90_TILE_N");
  if (forced == 128 || forced == 256) tiles.bn = forced;
  const int bn = tiles.bn;
  const int64_t n_tiles = (p.nk + bn - 1) / bn;

  std::vector<GroupTiles> table;
  std::vector<CUtensorMap> amaps, bmaps;
  int64_t total = 0;
  {
    MapCache& cache = map_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    for (size_t g = 0; g < G; ++g) {
      const int64_t mk = p.mk[g], kred = p.kred[g];
      if (mk <= 0 || kred <= 0) continue;
      PACKMOE_CHECK(aligned16(p.a[g]) && aligned16(p.b[g]) && aligned16(p.out[g]),
                    "grouped_gemm_sm90: group " << g << " has a pointer off 16-byte alignment");
      table.push_back(GroupTiles{p.out[g], static_cast<int32_t>(mk), static_cast<int32_t>(kred),
                                 static_cast<int32_t>(total), static_cast<int32_t>(g)});
      total += (mk + kSm90TileM - 1) / kSm90TileM * n_tiles;
      amaps.push_back(p.a_k_major ? cache.get({p.a[g], kred, mk, kSm90TileM})
                                  : cache.get({p.a[g], mk, kred, kSm90TileK}));
      bmaps.push_back(p.b_k_major ? cache.get({p.b[g], kred, p.nk, bn})
                                  : cache.get({p.b[g], p.nk, kred, kSm90TileK}));
    }
  }
  if (total == 0) return Status::ok();
  PACKMOE_CHECK(total < (int64_t{1} << 31), "grouped_gemm_sm90: " << total << " tiles");

  // One upload: [A maps][B maps][group table]; the staging buffers are 256-byte aligned and a
  // CUtensorMap is 64-byte aligned.
  const size_t n = table.size();
  const size_t maps_bytes = n * sizeof(CUtensorMap);
  std::vector<uint8_t> blob(2 * maps_bytes + n * sizeof(GroupTiles));
  std::memcpy(blob.data(), amaps.data(), maps_bytes);
  std::memcpy(blob.data() + maps_bytes, bmaps.data(), maps_bytes);
  std::memcpy(blob.data() + 2 * maps_bytes, table.data(), n * sizeof(GroupTiles));
  const auto* dev = static_cast<const uint8_t*>(be.upload(blob.data(), blob.size()));

  Params k{};
  k.a_maps = reinterpret_cast<const CUtensorMap*>(dev);
  k.b_maps = reinterpret_cast<const CUtensorMap*>(dev + maps_bytes);
  k.groups = reinterpret_cast<const GroupTiles*>(dev + 2 * maps_bytes);
  k.num_groups = static_cast<int32_t>(n);
  k.total_tiles = static_cast<int32_t>(total);
  k.n_tiles = static_cast<int32_t>(n_tiles);
  k.nk = static_cast<int32_t>(p.nk);
  k.out_bf16 = p.out_bf16 ? 1 : 0;
  k.accumulate = p.accumulate ? 1 : 0;
  k.alpha_lhs = p.alpha_lhs;
  k.alpha_rhs = p.alpha_rhs;
  if (bn == 256)
    launch_layout<256>(be, k, p.a_k_major, p.b_k_major);
  else
    launch_layout<128>(be, k, p.a_k_major, p.b_k_major);
  return Status::ok();
}

}  // namespace packmoe
