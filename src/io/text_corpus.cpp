// Text corpus loading: files -> documents (split at separator lines) -> byte tokens -> train /
// validation (io/data_split.h: by content hash, by position when the hash leaves a side empty).
// File order is sorted by name so the token stream is the same on every machine; the split is by
// hash so adding a file never moves another file's documents.
#include "io/text_corpus.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>

#include "core/checked_math.h"
#include "io/data_split.h"
#include "io/read_file.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

// A regular file only (a FIFO would block, /dev/zero never end: io/read_file.h), of at most a
// sixteenth of host memory: each byte is held as text and, until the split is copied out, as two
// 4-byte tokens (the whole corpus, then its side).
Status read_text(const std::string& path, std::string* out) {
  const uint64_t limit = static_cast<uint64_t>(host_memory_bytes() / 16);
  Result<std::string> text = read_regular_file(path, limit);
  if (!text) return text.status();
  *out = std::move(text).value();
  return Status::ok();
}

// Splits at lines equal to `sep` (with "\n" or "\r\n" endings); each document keeps its own
// line endings. The last document needs no separator after it.
std::vector<std::string_view> split_documents(std::string_view text, const std::string& sep) {
  std::vector<std::string_view> docs;
  if (sep.empty()) {
    docs.push_back(text);
    return docs;
  }
  size_t doc_begin = 0, line_begin = 0;
  while (line_begin < text.size()) {
    size_t nl = text.find('\n', line_begin);
    const size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(line_begin, line_end - line_begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    if (line == sep) {
      docs.push_back(text.substr(doc_begin, line_begin - doc_begin));
      doc_begin = next;
    }
    line_begin = next;
  }
  docs.push_back(text.substr(doc_begin));
  return docs;
}

void append_document(TokenDataset* data, std::string_view doc) {
  for (unsigned char c : doc) data->tokens.push_back(c);
  data->doc_offsets.push_back(data->tokens.size());
}

}  // namespace

std::vector<uint32_t> byte_tokenize(std::string_view text) {
  std::vector<uint32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string byte_detokenize(std::span<const uint32_t> tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    PACKMOE_CHECK(tokens[i] < kByteVocab, "token " << tokens[i] << " is not a byte");
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

uint64_t document_hash(std::string_view text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool is_validation_document(std::string_view text, double fraction) {
  constexpr uint64_t kBuckets = 1'000'000;
  const auto threshold = static_cast<uint64_t>(std::floor(fraction * kBuckets));
  return document_hash(text) % kBuckets < threshold;
}

Result<TextCorpus> load_text_corpus(const TextCorpusOptions& options) {
  if (!(options.validation_fraction >= 0.0 && options.validation_fraction <= 1.0)) {
    return Status::error("text corpus: validation fraction " +
                         std::to_string(options.validation_fraction) + " is not in [0, 1]");
  }
  const bool is_default = options.paths.empty();
  const std::vector<std::string> roots =
      is_default ? std::vector<std::string>{kDefaultCorpusDir} : options.paths;
  const std::string install_hint = std::string(" (the default corpus is installed by the Debian/") +
                                   "Ubuntu package '" + kDefaultCorpusPackage +
                                   "': apt-get install " + kDefaultCorpusPackage +
                                   ", or scripts/install-deps.sh)";

  TextCorpus corpus;
  corpus.train.doc_offsets = {0};  // zero documents, boundaries known
  corpus.validation.doc_offsets = {0};
  for (const std::string& root : roots) {
    std::error_code ec;
    const fs::file_status st = fs::status(root, ec);
    if (ec || !fs::exists(st)) {
      return Status::error(root + ": corpus path not found" + (is_default ? install_hint : ""));
    }
    if (fs::is_directory(st)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(root, ec)) {
        const std::string name = e.path().filename().string();
        if (name.empty() || name[0] == '.' || ends_with(name, ".dat") || ends_with(name, ".u8")) {
          continue;  // .dat: strfile's binary index; .u8: symlinks to the same text
        }
        std::error_code fec;
        if (fs::is_regular_file(e.path(), fec)) found.push_back(e.path().string());
      }
      if (ec) return Status::error(root + ": cannot list directory: " + ec.message());
      std::sort(found.begin(), found.end());
      corpus.files.insert(corpus.files.end(), found.begin(), found.end());
    } else {
      corpus.files.push_back(root);
    }
  }
  if (corpus.files.empty()) {
    return Status::error(roots.front() + ": no text files in the corpus" +
                         (is_default ? install_hint : ""));
  }

  // Every kept document in file order, then split (io/data_split.h: by content hash, or by
  // position when the hash leaves a side empty, e.g. one plain file).
  TokenDataset all;
  all.doc_offsets = {0};
  std::vector<TokenRange> docs;
  std::vector<uint64_t> keys;
  for (const std::string& path : corpus.files) {
    std::string text;
    PACKMOE_RETURN_IF_ERROR(read_text(path, &text));
    for (std::string_view doc : split_documents(text, options.separator_line)) {
      if (is_blank(doc)) continue;
      corpus.text_bytes += doc.size();
      docs.push_back({all.tokens.size(), all.tokens.size() + doc.size()});
      keys.push_back(document_hash(doc));
      append_document(&all, doc);
    }
  }
  const DocumentSplit split = io::split_documents(docs, keys, options.validation_fraction);
  corpus.split_by_position = split.by_position;
  for (const auto& [ranges, out] : {std::pair{&split.train, &corpus.train},
                                    std::pair{&split.validation, &corpus.validation}}) {
    for (const TokenRange& r : *ranges) {
      out->tokens.insert(out->tokens.end(), all.tokens.begin() + static_cast<std::ptrdiff_t>(r.begin),
                         all.tokens.begin() + static_cast<std::ptrdiff_t>(r.end));
      out->doc_offsets.push_back(out->tokens.size());
    }
  }
  if (corpus.text_bytes == 0) {
    return Status::error(roots.front() + ": the corpus files hold no text" +
                         (is_default ? install_hint : ""));
  }
  corpus.train.source = corpus.validation.source = roots.front() + (roots.size() > 1 ? ", ..." : "");
  return corpus;
}

}  // namespace packmoe::io
