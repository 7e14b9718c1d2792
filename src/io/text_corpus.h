// The default training corpus: plain text files (by default the Debian `fortunes` package's
// /usr/share/games/fortunes), split into documents, tokenized byte-level (V = 256, token = byte
// value) and split train/validation by a fixed hash of each document's bytes (io/data_split.h),
// or by position when the hash leaves a side without documents (a single plain file). The split
// depends only on the documents, never on thread count or the machine.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/token_data.h"

namespace packmoe::io {

inline constexpr uint32_t kByteVocab = 256;  // V of the byte-level tokenizer
inline constexpr const char* kDefaultCorpusDir = "/usr/share/games/fortunes";
inline constexpr const char* kDefaultCorpusPackage = "fortunes";  // Debian/Ubuntu package

struct TextCorpusOptions {
  // Text files, or directories whose regular files (not recursive, sorted by name) are read;
  // in directories, hidden files and the fortune index files `*.dat` and `*.u8` are skipped.
  // Empty: kDefaultCorpusDir.
  std::vector<std::string> paths;
  // A line consisting of exactly this text ends a document (the fortune file format uses "%").
  // Empty: each file is one document. Documents of only whitespace are dropped.
  std::string separator_line = "%";
  // Share of documents (by hash, see is_validation_document; of tokens when split by position)
  // that go to validation, in [0, 1].
  double validation_fraction = 0.1;
};

struct TextCorpus {
  TokenDataset train;        // byte tokens, doc_offsets per document, in file then text order
  TokenDataset validation;   // same, the documents chosen by the hash (or the tail)
  bool split_by_position = false;  // the hash left a side empty: the last tokens validate
  std::vector<std::string> files;  // the files read, in order
  uint64_t text_bytes = 0;   // bytes of all kept documents (train + validation)
};

// Reads the corpus. Errors name the path: a missing default corpus says to install the
// `fortunes` package (scripts/install-deps.sh does), an empty corpus or a bad fraction says so.
Result<TextCorpus> load_text_corpus(const TextCorpusOptions& options = {});

// Byte-level tokenizer: one token per byte, token = unsigned byte value (< kByteVocab).
std::vector<uint32_t> byte_tokenize(std::string_view text);
// Inverse; tokens >= 256 are a programmer error (checked).
std::string byte_detokenize(std::span<const uint32_t> tokens);

// 64-bit FNV-1a of the bytes (offset basis 14695981039346656037, prime 1099511628211): fixed
// forever, so a split stays the same across versions.
uint64_t document_hash(std::string_view text);
// A document goes to validation iff document_hash(text) % 1'000'000 < fraction x 1'000'000
// (rounded down): about `fraction` of documents, chosen by content, deterministic.
bool is_validation_document(std::string_view text, double fraction);

}  // namespace packmoe::io
