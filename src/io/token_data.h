// Token datasets: readers and writers for Megatron-LM indexed datasets (<prefix>.idx + .bin) and
// llm.c token shards (docs/formats.md, "Files of other tools"). A TokenDataset a reader returns
// has passed every header and size check: magic, version, dtype, counts, arrays consistent with
// each other and with the file sizes, every token a non-negative integer below 2^32. No reader
// ever touches a byte outside a file; writers replace their targets atomically (temp + rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace packmoe::io {

// Tokens (T) plus, where the format says, document boundaries: document d is
// tokens[doc_offsets[d], doc_offsets[d+1]). doc_offsets is either empty (boundaries unknown) or
// has num_documents + 1 non-decreasing entries, the first 0 and the last tokens.size().
struct TokenDataset {
  std::vector<uint32_t> tokens;       // (T)
  std::vector<uint64_t> doc_offsets;  // (D + 1) or empty
  std::string source;                 // file(s) it came from, for messages

  size_t num_documents() const { return doc_offsets.empty() ? 0 : doc_offsets.size() - 1; }
  std::span<const uint32_t> document(size_t d) const;  // d < num_documents(), checked
};

// Checks the doc_offsets invariant above; the error starts with `what`.
Status validate_doc_offsets(const TokenDataset& data, const std::string& what);

// ---- Megatron-LM indexed dataset ----------------------------------------------------------------

// The .idx dtype codes of megatron/core/datasets/indexed_dataset.py (DType). Float codes exist in
// the format but are never token ids, so the reader rejects them.
enum class MegatronDType : uint8_t {
  kU8 = 1, kI8 = 2, kI16 = 3, kI32 = 4, kI64 = 5, kF64 = 6, kF32 = 7, kU16 = 8,
};
inline constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kMegatronVersion = 1;
inline constexpr uint64_t kMegatronHeaderBytes = 34;  // magic 9 + version 8 + dtype 1 + S 8 + D 8

// Reads <prefix>.idx and <prefix>.bin (a path ending in .idx or .bin is taken as its prefix).
// Documents are the index's documents (each a run of sequences); sequences must lie back to back
// in the .bin (as every Megatron builder writes them) and the .bin must hold exactly the indexed
// tokens. The optional multimodal `sequence_modes` array (S trailing bytes) is accepted and
// ignored.
Result<TokenDataset> read_megatron(const std::string& prefix);

// The checked index of <prefix> (every check of read_megatron but the token values), with the
// .bin's size checked against it; the .bin is not read (io/token_mmap.h maps it).
struct MegatronIndex {
  std::string prefix, bin_path;
  uint8_t dtype_code = 0;             // MegatronDType, an integer type
  uint64_t num_tokens = 0;            // the .bin's tokens
  std::vector<uint64_t> doc_offsets;  // (D + 1), in tokens
};
Result<MegatronIndex> read_megatron_index(const std::string& prefix);

// Writes <prefix>.bin then <prefix>.idx, one sequence per document (as preprocess_data.py does
// without --split-sentences); empty doc_offsets means one document. Fails, writing nothing, if a
// token does not fit `dtype`, dtype is a float code, doc_offsets are invalid, or a document has
// 2^31 tokens or more (sequence lengths are int32).
Status write_megatron(const std::string& prefix, const TokenDataset& data,
                      MegatronDType dtype = MegatronDType::kU16);

// ---- llm.c token shards -------------------------------------------------------------------------

inline constexpr size_t kLlmcHeaderInts = 256;  // 1024 bytes of little-endian int32
// GPT-2 shards: uint16 tokens (dev/data/data_common.py, and the only kind llmc/dataloader.h reads).
inline constexpr int32_t kLlmcGpt2Magic = 20240520;
inline constexpr int32_t kLlmcGpt2Version = 1;
// Llama-3 shards: uint32 tokens (data_common.py's writer).
inline constexpr int32_t kLlmcLlama3Magic = 20240801;
inline constexpr int32_t kLlmcLlama3Version = 7;

enum class LlmcFormat { kGpt2, kLlama3 };

// Reads one shard; the file size must be exactly header + count x token size. llm.c marks a
// document by *prepending* an end-of-text token (50256 for GPT-2); when `document_start_token` is
// given, documents start at each occurrence of it (tokens before the first one form a document of
// their own), otherwise doc_offsets stays empty.
Result<TokenDataset> read_llmc_shard(const std::string& path,
                                     std::optional<uint32_t> document_start_token = std::nullopt);

// The checked header of a shard (magic, version, count, the file size); tokens follow it at byte
// kLlmcHeaderInts x 4, `token_bytes` each (2: uint16, 4: uint32).
struct LlmcShardHeader {
  uint64_t count = 0;
  uint32_t token_bytes = 0;
};
Result<LlmcShardHeader> read_llmc_header(const std::string& path);

// Writes one shard (document boundaries are not stored: the format has none). Fails, writing
// nothing, if a token does not fit the format's token type or there are 2^31 tokens or more.
Status write_llmc_shard(const std::string& path, std::span<const uint32_t> tokens,
                        LlmcFormat format = LlmcFormat::kGpt2);

}  // namespace packmoe::io
