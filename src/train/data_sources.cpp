// --data parsing, and each source read (text) or mapped (token files) and split.
#include "train/data_sources.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>

#include "io/data_split.h"
#include "io/text_corpus.h"
#include "io/token_mmap.h"
#include "tokenize/encode_documents.h"
#include "train/sft_data.h"

namespace packmoe::train {
namespace {

std::optional<double> number(const std::string& w) {
  char* end = nullptr;
  const double v = std::strtod(w.c_str(), &end);
  if (end == w.c_str() || *end != '\0') return std::nullopt;
  return v;
}

// A byte-token dataset (the text corpus's documents) re-encoded with `tokenizer`, each document
// followed by its eos token where it has one.
Result<io::TokenDataset> tokenize_dataset(const io::TokenDataset& bytes,
                                          const tokenize::Tokenizer& tokenizer) {
  std::vector<std::string> texts;
  for (size_t d = 0; d < bytes.num_documents(); ++d)
    texts.push_back(io::byte_detokenize(bytes.document(d)));
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  tokenize::EncodeFailure failure;
  Result<std::vector<std::vector<uint32_t>>> ids =
      tokenize::encode_documents(tokenizer, views, tokenize::default_threads(), &failure);
  if (!ids)
    return Status::error(bytes.source + ": document " + std::to_string(failure.document) + ": " +
                         failure.status.message());
  io::TokenDataset out;
  out.source = bytes.source;
  out.doc_offsets = {0};
  for (const std::vector<uint32_t>& doc : ids.value()) {
    out.tokens.insert(out.tokens.end(), doc.begin(), doc.end());
    if (tokenizer.eos_id()) out.tokens.push_back(*tokenizer.eos_id());
    out.doc_offsets.push_back(out.tokens.size());
  }
  return out;
}

Status load_sft_source(const std::string& path, double fraction,
                       const tokenize::Tokenizer* tokenizer, LoadedData* out,
                       std::string* description);

// One source: "fortunes" | "text:PATH" | "megatron:PREFIX" | "llmc:SHARD", split by
// `fraction` (io/data_split.h; text by content hash, token files by document index; a side
// left empty: by position). Token files stay memory-mapped; text is read into memory.
Status load_source(const std::string& spec, const char* flag, double fraction,
                   const tokenize::Tokenizer* tokenizer, LoadedData* out, std::string* description) {
  const size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const std::string path = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (spec == "fortunes" || (kind == "text" && !path.empty())) {
    io::TextCorpusOptions opt;
    if (kind == "text") opt.paths = {path};
    opt.validation_fraction = fraction;
    Result<io::TextCorpus> corpus = io::load_text_corpus(opt);
    if (!corpus) return corpus.status();
    const std::string name = kind == "text" ? path : io::kDefaultCorpusDir;
    corpus.value().train.source = corpus.value().validation.source = name;
    // Byte tokens: documents joined by a newline; a tokenizer's: each ends with its eos.
    std::optional<uint32_t> separator = static_cast<uint32_t>('\n');
    if (tokenizer) {
      separator = std::nullopt;
      for (io::TokenDataset* d : {&corpus.value().train, &corpus.value().validation}) {
        Result<io::TokenDataset> t = tokenize_dataset(*d, *tokenizer);
        if (!t) return t.status();
        *d = std::move(t.value());
      }
    }
    out->train.sources.push_back(in_memory_source(std::move(corpus.value().train), separator));
    out->validation.sources.push_back(
        in_memory_source(std::move(corpus.value().validation), separator));
    *description = (kind == "text" ? path : std::string("fortunes")) + " (" +
                   (tokenizer ? std::string(tokenizer->kind()) + " tokenizer" : "byte tokens") +
                   ", " + std::to_string(corpus.value().files.size()) + " files" +
                   (corpus.value().split_by_position ? ", split by position" : "") + ")";
    return Status::ok();
  }
  if (kind == "sft" && !path.empty())
    return load_sft_source(path, fraction, tokenizer, out, description);
  if ((kind != "megatron" && kind != "llmc") || path.empty())
    return Status::error(std::string(flag) + " '" + spec +
                         "' must be fortunes, text:PATH, megatron:PREFIX, llmc:SHARD or "
                         "sft:FILE.jsonl (or a "
                         "list of them, each with a weight or none: \"0.7 megatron:a 0.3 "
                         "megatron:b\")");
  Result<io::MappedTokens> mapped =
      kind == "megatron" ? io::map_megatron(path) : io::map_llmc_shard(path);
  if (!mapped) return mapped.status();
  io::MappedTokens& m = mapped.value();
  // Documents (no boundaries: one run, split by position), each keyed by its index in the file.
  std::vector<io::TokenRange> docs;
  std::vector<uint64_t> keys;
  if (m.doc_offsets.empty()) m.doc_offsets = {0, m.tokens.size()};
  for (size_t d = 0; d + 1 < m.doc_offsets.size(); ++d) {
    if (m.doc_offsets[d + 1] == m.doc_offsets[d]) continue;
    docs.push_back({m.doc_offsets[d], m.doc_offsets[d + 1]});
    keys.push_back(io::document_index_key(d));
  }
  const bool boundaries_known = kind == "megatron";
  io::DocumentSplit split = io::split_documents(docs, keys, fraction);
  for (auto [ranges, blend] : {std::pair{&split.train, &out->train},
                               std::pair{&split.validation, &out->validation}}) {
    DataSource src;
    src.name = m.source.empty() ? path : m.source;
    src.tokens = m.tokens;
    src.documents = std::move(*ranges);
    src.boundaries_known = boundaries_known;
    blend->sources.push_back(std::move(src));
  }
  *description = spec + (split.by_position ? " (split by position)" : "");
  return Status::ok();
}

// "sft:FILE.jsonl": conversations (train/sft_data.h), each whole on one side of the split: by
// its line's hash, or, when that leaves a side empty, the last conversation validates.
Status load_sft_source(const std::string& path, double fraction,
                       const tokenize::Tokenizer* tokenizer, LoadedData* out,
                       std::string* description) {
  if (!tokenizer)
    return Status::error("sft:" + path + " needs --tokenizer (its chat template renders the "
                         "conversations)");
  Result<SftRenderer> renderer = SftRenderer::create(*tokenizer);
  if (!renderer) return renderer.status();
  Result<std::vector<SftConversation>> read = read_sft_file(path, renderer.value());
  if (!read) return read.status();
  const std::vector<SftConversation>& conversations = read.value();
  const size_t n = conversations.size();
  std::vector<bool> validates(n);
  size_t valid = 0;
  for (size_t i = 0; i < n; ++i) {
    validates[i] = fraction > 0 &&
                   conversations[i].key % io::kSplitBuckets <
                       static_cast<uint64_t>(fraction * static_cast<double>(io::kSplitBuckets));
    valid += validates[i] ? 1 : 0;
  }
  bool moved = false;
  if (fraction > 0 && n >= 2 && valid == 0) validates[n - 1] = moved = true;
  if (fraction > 0 && n >= 2 && valid == n) validates[0] = false, moved = true;
  std::vector<uint32_t> tokens;
  auto trained = std::make_shared<std::vector<uint8_t>>();
  std::vector<io::TokenRange> ranges;
  for (const SftConversation& c : conversations) {
    ranges.push_back({tokens.size(), tokens.size() + c.tokens.size()});
    tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
    trained->insert(trained->end(), c.trained.begin(), c.trained.end());
  }
  const io::TokenArray array = io::TokenArray::owned(std::move(tokens));
  const uint32_t pad = tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0));
  for (bool side : {false, true}) {
    DataSource src;
    src.name = path;
    src.tokens = array;
    src.packed = PackedDocuments{trained, {}, path, pad};
    for (size_t i = 0; i < n; ++i)
      if (validates[i] == side) {
        src.documents.push_back(ranges[i]);
        src.packed->lines.push_back(conversations[i].line);
      }
    (side ? out->validation : out->train).sources.push_back(std::move(src));
  }
  *description = "sft:" + path + " (" + std::to_string(n) + " conversations, " +
                 (renderer.value().has_template() ? "chat template" : "plain template") +
                 (moved ? ", one moved to keep both sides" : "") + ")";
  return Status::ok();
}

}  // namespace

Result<DataSpec> parse_data_spec(const std::string& value, const char* flag) {
  std::vector<std::string> words;
  std::string word;
  for (char c : value + " ") {
    if (c == ' ' || c == ',' || c == '\t' || c == '\n') {
      if (!word.empty()) words.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  }
  const std::string what = std::string(flag) + " '" + value + "'";
  if (words.empty()) return Status::error(what + " names no data");
  const bool weighted = number(words.front()).has_value();
  if (weighted && words.size() % 2 != 0)
    return Status::error(what + ": a weighted list is pairs of a weight and a source");
  DataSpec spec;
  for (size_t i = 0; i < words.size(); i += weighted ? 2 : 1) {
    const std::optional<double> w = number(words[i]);
    if (weighted) {
      if (!w || !(*w > 0) || !std::isfinite(*w))
        return Status::error(what + ": '" + words[i] +
                             "' is not a positive weight (every source has one, or none does)");
      spec.weights.push_back(*w);
      spec.sources.push_back(words[i + 1]);
    } else {
      if (w)
        return Status::error(what + ": '" + words[i] +
                             "' is a weight, but the first source has none (every source has "
                             "one, or none does)");
      spec.sources.push_back(words[i]);
    }
  }
  return spec;
}

Result<LoadedData> load_data(const DataSpec& spec, const char* flag, double valid_fraction,
                             const tokenize::Tokenizer* tokenizer) {
  LoadedData out;
  for (size_t i = 0; i < spec.sources.size(); ++i) {
    std::string d;
    PACKMOE_RETURN_IF_ERROR(load_source(spec.sources[i], flag, valid_fraction, tokenizer, &out, &d));
    std::string w;
    if (!spec.weights.empty()) {
      std::ostringstream s;
      s << spec.weights[i] << " ";
      w = s.str();
    }
    out.description += (i ? (spec.weights.empty() ? ", " : " + ") : "") + w + d;
  }
  out.train.weights = out.validation.weights = spec.weights;
  return out;
}

Result<LoadedData> load_data(const std::string& value, const char* flag, double valid_fraction,
                             const tokenize::Tokenizer* tokenizer) {
  Result<DataSpec> spec = parse_data_spec(value, flag);
  if (!spec) return spec.status();
  return load_data(spec.value(), flag, valid_fraction, tokenizer);
}

}  // namespace packmoe::train
