// Optimizer shard encode/decode and the assembly of shards into the full state.
#include "dist/optimizer_state.h"

#include <bit>
#include <cstring>
#include <string>

namespace packmoe {
namespace {

static_assert(std::endian::native == std::endian::little, "the shard file is little-endian");

constexpr char kMagic[8] = {'P', 'K', 'M', 'O', 'S', 'H', 'R', 'D'};
constexpr uint32_t kVersion = 1;

void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  const size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, p, n);
}

template <typename T>
void put(std::vector<uint8_t>& out, const T& v) {
  put_bytes(out, &v, sizeof(T));
}

void put_floats(std::vector<uint8_t>& out, const std::vector<float>& v) {
  put_bytes(out, v.data(), v.size() * sizeof(float));
}

// Sequential reads that fail (once) instead of running past the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  template <typename T>
  bool get(T& v) {
    if (b_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool get_floats(std::vector<float>& v, int64_t n) {
    if (n < 0 || static_cast<uint64_t>(n) > (b_.size() - pos_) / sizeof(float)) return false;
    v.resize(n);
    std::memcpy(v.data(), b_.data() + pos_, n * sizeof(float));
    pos_ += n * sizeof(float);
    return true;
  }
  bool at_end() const { return pos_ == b_.size(); }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

Status bad(const std::string& why) { return Status::error("optimizer shard: " + why); }

}  // namespace

std::vector<uint8_t> encode_optimizer_shard(const OptimizerShard& s) {
  std::vector<uint8_t> out;
  put_bytes(out, kMagic, sizeof(kMagic));
  put(out, kVersion);
  put(out, static_cast<int32_t>(s.world_size));
  put(out, static_cast<int32_t>(s.rank));
  put(out, s.steps);
  put(out, static_cast<int64_t>(s.params.size()));
  for (const ParamGeometry& g : s.params) {
    put(out, g.experts);
    put(out, g.rows);
    put(out, g.cols);
    put(out, g.unit_rows);
  }
  put(out, static_cast<int64_t>(s.pieces.size()));
  for (const ShardPiece& p : s.pieces) {
    put(out, static_cast<int64_t>(p.param));
    put(out, p.begin);
    put(out, p.count);
    put(out, p.offset);
  }
  put_floats(out, s.master);
  put_floats(out, s.exp_avg);
  put_floats(out, s.exp_avg_sq);
  return out;
}

Result<OptimizerShard> decode_optimizer_shard(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  char magic[sizeof(kMagic)];
  uint32_t version = 0;
  if (!r.get(magic) || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0)
    return bad("not a packmoe optimizer shard (bad magic)");
  if (!r.get(version) || version != kVersion)
    return bad("version " + std::to_string(version) + ", expected " + std::to_string(kVersion));
  OptimizerShard s;
  int32_t world = 0, rank = 0;
  int64_t params = 0, pieces = 0;
  if (!r.get(world) || !r.get(rank) || !r.get(s.steps) || !r.get(params))
    return bad("truncated header");
  s.world_size = world;
  s.rank = rank;
  if (world < 1 || rank < 0 || rank >= world || s.steps < 0 || params < 1 || params > (1 << 24))
    return bad("header out of range (world " + std::to_string(world) + ", rank " +
               std::to_string(rank) + ", " + std::to_string(params) + " parameters)");
  for (int64_t p = 0; p < params; ++p) {
    ParamGeometry g;
    if (!r.get(g.experts) || !r.get(g.rows) || !r.get(g.cols) || !r.get(g.unit_rows))
      return bad("truncated parameter table");
    if (g.experts < 1 || g.rows < 1 || g.cols < 1 || g.unit_rows < 1 ||
        g.experts > (int64_t{1} << 20) || g.rows > (int64_t{1} << 31) ||
        g.cols > (int64_t{1} << 31))
      return bad("parameter " + std::to_string(p) + " has an invalid shape");
    s.params.push_back(g);
  }
  if (!r.get(pieces) || pieces < 0 || pieces > params) return bad("bad piece count");
  int64_t total = 0;
  for (int64_t i = 0; i < pieces; ++i) {
    int64_t param = 0;
    ShardPiece p;
    if (!r.get(param) || !r.get(p.begin) || !r.get(p.count) || !r.get(p.offset))
      return bad("truncated piece table");
    if (param < 0 || param >= params || p.begin < 0 || p.count < 1 ||
        p.begin > s.params[param].numel() - p.count)
      return bad("piece " + std::to_string(i) + " lies outside its parameter");
    p.param = static_cast<int>(param);
    total += p.count;
    s.pieces.push_back(p);
  }
  if (!r.get_floats(s.master, total) || !r.get_floats(s.exp_avg, total) ||
      !r.get_floats(s.exp_avg_sq, total))
    return bad("truncated state arrays (" + std::to_string(total) + " elements each expected)");
  if (!r.at_end()) return bad("trailing bytes after the state arrays");
  return s;
}

Result<FullOptimizerState> assemble_optimizer_state(const std::vector<OptimizerShard>& shards) {
  if (shards.empty()) return Status::error("optimizer state: no shards");
  const OptimizerShard& first = shards[0];
  const int world = first.world_size;
  if (static_cast<int>(shards.size()) != world)
    return Status::error("optimizer state: " + std::to_string(shards.size()) + " shards of a " +
                         std::to_string(world) + "-rank save");
  FullOptimizerState full;
  full.steps = first.steps;
  full.params = first.params;
  const size_t params = full.params.size();
  std::vector<std::vector<uint8_t>> covered(params);
  for (size_t p = 0; p < params; ++p) {
    const int64_t n = full.params[p].numel();
    full.master.emplace_back(n);
    full.exp_avg.emplace_back(n);
    full.exp_avg_sq.emplace_back(n);
    covered[p].assign(n, 0);
  }
  std::vector<bool> seen(world, false);
  for (const OptimizerShard& s : shards) {
    if (s.world_size != world || s.steps != first.steps || s.params != first.params)
      return Status::error(
          "optimizer state: rank " + std::to_string(s.rank) +
          "'s shard is from another save (world size, steps or parameters differ)");
    if (s.rank < 0 || s.rank >= world || seen[s.rank])
      return Status::error("optimizer state: rank " + std::to_string(s.rank) +
                           " is missing from the range or given twice");
    seen[s.rank] = true;
    int64_t at = 0;
    for (const ShardPiece& piece : s.pieces) {
      if (piece.param < 0 || static_cast<size_t>(piece.param) >= params || piece.begin < 0 ||
          piece.count < 0 || piece.begin + piece.count > full.params[piece.param].numel() ||
          at + piece.count > static_cast<int64_t>(s.master.size()) ||
          s.exp_avg.size() != s.master.size() || s.exp_avg_sq.size() != s.master.size())
        return Status::error("optimizer state: rank " + std::to_string(s.rank) +
                             " has a piece outside its parameter or its arrays");
      for (int64_t i = 0; i < piece.count; ++i) {
        uint8_t& c = covered[piece.param][piece.begin + i];
        if (c)
          return Status::error("optimizer state: element " + std::to_string(piece.begin + i) +
                               " of parameter " + std::to_string(piece.param) +
                               " is in two shards");
        c = 1;
        full.master[piece.param][piece.begin + i] = s.master[at + i];
        full.exp_avg[piece.param][piece.begin + i] = s.exp_avg[at + i];
        full.exp_avg_sq[piece.param][piece.begin + i] = s.exp_avg_sq[at + i];
      }
      at += piece.count;
    }
  }
  for (size_t p = 0; p < params; ++p)
    for (size_t i = 0; i < covered[p].size(); ++i)
      if (!covered[p][i])
        return Status::error("optimizer state: element " + std::to_string(i) + " of parameter " +
                             std::to_string(p) + " is in no shard");
  return full;
}

}  // namespace packmoe
