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
  int bn = 256;  // output columns per tile
};

// mk / kred per group (0 = no work), nk output columns, sms the multiprocessor count.
Sm90Tiles choose_sm90_tiles(const std::vector<int64_t>& mk, const std::vector<int64_t>& kred,
                            int64_t nk, int sms);

}  // namespace packmoe
