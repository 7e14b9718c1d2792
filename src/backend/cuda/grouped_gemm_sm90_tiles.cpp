// Tile heuristic of the sm_90a grouped GEMM (grouped_gemm_sm90_tiles.h). Model: the launch is a
// persistent grid of `sms` CTAs, each tile costs its MMA work (tile area x reduction, a 128-wide
// tile at 0.85 of a 256-wide one's rate: half the B operand reuse per A load), and the time is
// the per-CTA share of the total plus one tile (the tail of the last wave). Wide tiles win on
// large problems; narrow ones when nk is small or padding to 256 wastes a column block, or when
// there are too few tiles to fill the grid. Clusters of 2 always: a pair shares its B (or A)
// tile through TMA multicast, a third less L2 -> shared memory traffic per CTA (measured on the
// H200: 560-615 TFLOP/s without, 630-660 with, on the large shapes; docs/gemm-sm90.md). Calls
// whose token counts stay on the device choose from an even split of their capacity instead.
#include "backend/cuda/grouped_gemm_sm90_tiles.h"

#include <algorithm>

namespace packmoe {

namespace {

double estimated_time(const std::vector<int64_t>& mk, const std::vector<int64_t>& kred,
                      int64_t nk, int sms, int bn, double rate) {
  const int64_t n_tiles = (nk + bn - 1) / bn;
  double work = 0, largest = 0;
  int64_t tiles = 0;
  for (size_t g = 0; g < mk.size(); ++g) {
    if (mk[g] <= 0 || kred[g] <= 0) continue;
    const int64_t m_tiles = (mk[g] + kSm90TileM - 1) / kSm90TileM;
    const int64_t k_steps = (kred[g] + kSm90TileK - 1) / kSm90TileK;
    const double one = static_cast<double>(kSm90TileM) * bn * k_steps / rate;
    tiles += m_tiles * n_tiles;
    work += one * static_cast<double>(m_tiles * n_tiles);
    largest = std::max(largest, one);
  }
  if (tiles == 0) return 0;
  const int64_t busy = std::min<int64_t>(tiles, sms);
  return work / static_cast<double>(busy) + largest;
}

}  // namespace

Sm90Tiles choose_sm90_tiles(const std::vector<int64_t>& mk, const std::vector<int64_t>& kred,
                            int64_t nk, int sms) {
  const double wide = estimated_time(mk, kred, nk, sms, 256, 1.0);
  const double narrow = estimated_time(mk, kred, nk, sms, 128, 0.85);
  return Sm90Tiles{narrow < wide ? 128 : 256, 2};
}

std::vector<int64_t> sm90_uniform_split(int64_t capacity, int64_t groups, int64_t align) {
  const int64_t per = (capacity / std::max<int64_t>(groups, 1) + align - 1) / align * align;
  return std::vector<int64_t>(static_cast<size_t>(groups), std::max(per, align));
}

}  // namespace packmoe
