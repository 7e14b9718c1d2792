// Tile shape of the sm_90a grouped GEMM per problem shape: every CTA computes a kTileM x bn
// output tile (two consumer warpgroups of 64 rows) over the whole reduction, bn in {128, 256}.
// A function of shapes only, so a result never depends on where its operands live.
#pragma once

#include <cstdint>
#include <vector>

#include "core/hd.h"

namespace packmoe {

constexpr int kSm90TileM = 128;
constexpr int kSm90TileK = 64;

struct Sm90Tiles {
  int bn = 256;     // output columns per tile
  int cluster = 2;  // CTAs per cluster; 2: pairs share one operand tile through TMA multicast
};

// mk / kred per group (0 = no work), nk output columns, sms the multiprocessor count.
Sm90Tiles choose_sm90_tiles(const std::vector<int64_t>& mk, const std::vector<int64_t>& kred,
                            int64_t nk, int sms);

// n-tiles per band of a group's tile order (m-rows of the band run one after the other): as many
// as keep the band's B operand (bn columns x kred, BF16) within about a third of the H200's L2.
// Host and device (the schedule kernel of device token counts computes it too).
PACKMOE_HD int32_t sm90_band(int bn, int64_t kred, int64_t n_tiles) {
  constexpr int64_t kBandBytes = int64_t{16} << 20;
  const int64_t b_tile = static_cast<int64_t>(bn) * kred * 2;
  const int64_t band = kBandBytes / (b_tile > 1 ? b_tile : 1);
  const int64_t most = n_tiles > 1 ? n_tiles : 1;
  return static_cast<int32_t>(band < 1 ? 1 : band > most ? most : band);
}

// Work units of a group with m_tiles m-tiles: pairs of m-tiles sharing an n-tile, then (odd
// m_tiles, clusters of 2) the last m-tile's pairs of n-tiles. Host and device.
PACKMOE_HD int64_t sm90_units(int64_t m_tiles, int64_t n_tiles, int cluster) {
  return m_tiles / cluster * n_tiles + (m_tiles % cluster) * ((n_tiles + cluster - 1) / cluster);
}

// Token counts for the tile choice of a call whose counts are on the device (not known to the
// host): `capacity` rows split evenly over `groups`, rounded up to `align`.
std::vector<int64_t> sm90_uniform_split(int64_t capacity, int64_t groups, int64_t align);

}  // namespace packmoe
