// Tile shape of the sm_90a grouped GEMM per problem shape: every CTA computes a kTileM x bn
// output tile (two consumer warpgroups of 64 rows) over the whole reduction, bn in {128, 256}.
// A function of shapes only, so a result never depends on where its operands live.
#pragma once

#include <cstdint>
#include <vector>

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
int32_t sm90_band(int bn, int64_t kred, int64_t n_tiles);

}  // namespace packmoe
