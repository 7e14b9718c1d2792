// The train / validation split of one data source: each document goes to validation by a fixed
// hash of a key (the text corpus: its bytes; token files: its index), so validation documents
// are drawn from across the whole source; when that leaves a side without documents (a single
// document, a few large ones) the source is cut by position instead, its last `fraction` of
// tokens (the document there split in two) going to validation. Invariant: with 0 < fraction < 1
// and at least 2 tokens, neither side is empty; the split depends only on the documents.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace packmoe::io {

struct TokenRange {
  uint64_t begin = 0, end = 0;  // [begin, end) of a token array
  uint64_t size() const { return end - begin; }
};

struct DocumentSplit {
  std::vector<TokenRange> train, validation;  // documents (or pieces of one) in source order
  bool by_position = false;                   // the hash left a side empty: cut by position
};

// Buckets of the hash rule: a document is validation iff key % kSplitBuckets < fraction x
// kSplitBuckets (rounded down).
inline constexpr uint64_t kSplitBuckets = 1'000'000;

// The split of `docs` (non-empty ranges, in order) with one key per document; fraction in [0, 1]
// (0: everything trains, 1: everything validates; no position cut for either).
DocumentSplit split_documents(std::span<const TokenRange> docs, std::span<const uint64_t> keys,
                              double fraction);

// The key of document `index` of a token file: a fixed 64-bit mix (splitmix64's finalizer).
uint64_t document_index_key(uint64_t index);

}  // namespace packmoe::io
