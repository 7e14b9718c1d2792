// TokenArray: a read-only array of token ids, either memory-mapped from a token file (Megatron
// .bin, llm.c shard: read on demand in the file's own integer type, never loaded whole) or held
// in memory. MappedTokens: such a file's tokens with its document boundaries. Invariant: every
// index a reader passes is inside the array (checked), and check_range has rejected any value
// that is not a token id below the model's vocabulary before a sampler reads one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/token_data.h"

namespace packmoe::io {

// The integer element types of token files (the Megatron .idx dtypes, plus llm.c's uint32).
enum class TokenType : uint8_t { kU8, kI8, kI16, kU16, kI32, kU32, kI64 };

class TokenArray {
 public:
  TokenArray() = default;
  static TokenArray owned(std::vector<uint32_t> tokens);  // in memory
  // `count` elements of `type` at byte `offset` of the regular file `path` (checked against its
  // size), mapped read-only. The file must not change while the array lives.
  static Result<TokenArray> map(const std::string& path, uint64_t offset, uint64_t count,
                                TokenType type);

  uint64_t size() const { return count_; }
  TokenType type() const { return type_; }
  // out[0, n) = tokens [begin, begin + n), converted to uint32 (values checked by check_range).
  void read(uint64_t begin, uint64_t n, uint32_t* out) const;
  // An error naming `source` and the first token of [begin, end) that is negative or >= limit;
  // no pass over the data when the type cannot hold such a value (uint16 with limit >= 65536).
  Status check_range(uint64_t begin, uint64_t end, uint64_t limit,
                     const std::string& source) const;

 private:
  int64_t at(uint64_t i) const;
  std::shared_ptr<const void> owner_;  // the vector or the mapping
  const uint8_t* base_ = nullptr;
  uint64_t count_ = 0;
  TokenType type_ = TokenType::kU32;
};

// A token file's tokens and its documents: [doc_offsets[d], doc_offsets[d + 1]) for each d, or
// doc_offsets empty when the format has no boundaries (llm.c shards).
struct MappedTokens {
  TokenArray tokens;
  std::vector<uint64_t> doc_offsets;
  std::string source;
};

// The .idx read and checked (read_megatron_index), the .bin mapped.
Result<MappedTokens> map_megatron(const std::string& prefix);
// The header checked (read_llmc_header), the tokens mapped; no document boundaries.
Result<MappedTokens> map_llmc_shard(const std::string& path);
// An in-memory dataset as MappedTokens (its tokens moved into an owned TokenArray).
MappedTokens in_memory(TokenDataset data);

}  // namespace packmoe::io
