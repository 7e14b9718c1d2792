// Epoch streams (document order, separators), the blend's picks, window reads through
// io::TokenArray (memory-mapped files are read row by row, never whole) and document marks.
#include "train/batch_sampler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace packmoe::train {
namespace {

std::string side_name(bool validation) { return validation ? "validation" : "training"; }

}  // namespace

DataSource in_memory_source(io::TokenDataset data, std::optional<uint32_t> separator) {
  DataSource s;
  s.name = data.source.empty() ? "token data" : data.source;
  s.boundaries_known = !data.doc_offsets.empty();
  s.separator = separator;
  if (s.boundaries_known) {
    for (size_t d = 0; d < data.num_documents(); ++d)
      s.documents.push_back({data.doc_offsets[d], data.doc_offsets[d + 1]});
  } else {
    s.documents.push_back({0, data.tokens.size()});
  }
  s.tokens = io::TokenArray::owned(std::move(data.tokens));
  return s;
}

DataBlend single_source(io::TokenDataset data, std::optional<uint32_t> separator) {
  DataBlend b;
  b.sources.push_back(in_memory_source(std::move(data), separator));
  return b;
}

const char* document_mask_name(DocumentMask mask) {
  return mask == DocumentMask::kNone ? "causal" : "document";
}

Result<BatchSampler> BatchSampler::create(DataBlend data, int64_t vocab_size, int64_t batch,
                                          int64_t seq, const StreamOptions& options,
                                          bool validation) {
  PACKMOE_CHECK(batch >= 1 && seq >= 1 && vocab_size >= 1,
                "sampler shape B=" << batch << " S=" << seq << " V=" << vocab_size);
  const uint64_t vocab = static_cast<uint64_t>(vocab_size);
  if (data.sources.empty()) return Status::error("no " + side_name(validation) + " data");
  if (data.sources.size() > kMaxBlendSources)
    return Status::error(std::to_string(data.sources.size()) + " data sources, more than " +
                         std::to_string(kMaxBlendSources));
  if (!data.weights.empty() && data.weights.size() != data.sources.size())
    return Status::error(std::to_string(data.weights.size()) + " weights for " +
                         std::to_string(data.sources.size()) + " data sources");
  for (double w : data.weights)
    if (!(w > 0) || !std::isfinite(w)) {
      std::ostringstream e;
      e << "data weight " << w << " must be a positive number";
      return Status::error(e.str());
    }
  if (options.document_mask == DocumentMask::kEodToken && options.eod_token >= vocab)
    return Status::error("--eod-token " + std::to_string(options.eod_token) +
                         " is not below vocab_size " + std::to_string(vocab_size));
  std::vector<Stream> streams;
  for (DataSource& src : data.sources) {
    const std::string& name = src.name;
    if (options.document_mask == DocumentMask::kIndex && !src.boundaries_known)
      return Status::error(name + ": --attention-mask document needs the data's document "
                                  "boundaries (this data has none): give --eod-token");
    if (src.separator && *src.separator >= vocab)
      return Status::error(name + ": document separator token " +
                           std::to_string(*src.separator) + " is not below vocab_size " +
                           std::to_string(vocab_size));
    if (src.packed) {
      if (src.packed->pad >= vocab)
        return Status::error(name + ": padding token " + std::to_string(src.packed->pad) +
                             " is not below vocab_size " + std::to_string(vocab_size));
      if (src.documents.empty())
        return Status::error(name + ": the " + side_name(validation) +
                             " side of the data has no conversations" +
                             (validation ? " (raise --valid-fraction or give --valid-data)" : ""));
      int64_t tokens = 0;
      for (const io::TokenRange& r : src.documents) {
        PACKMOE_RETURN_IF_ERROR(src.tokens.check_range(r.begin, r.end, vocab, name));
        tokens += static_cast<int64_t>(r.size());
      }
      Result<std::vector<int64_t>> rows = rows_of_packed(src, seq);
      if (!rows) return rows.status();
      Stream s;
      s.source = std::move(src);
      s.rows = std::move(rows.value());
      s.shape.tokens = tokens;
      s.shape.windows = static_cast<int64_t>(s.rows.size()) - 1;
      s.shape.packed = true;
      streams.push_back(std::move(s));
      continue;
    }
    std::erase_if(src.documents, [](const io::TokenRange& r) { return r.size() == 0; });
    int64_t tokens = 0;
    for (const io::TokenRange& r : src.documents) {
      PACKMOE_RETURN_IF_ERROR(src.tokens.check_range(r.begin, r.end, vocab, name));
      tokens += static_cast<int64_t>(r.size());
    }
    if (src.separator && src.documents.size() > 1)
      tokens += static_cast<int64_t>(src.documents.size()) - 1;
    if (tokens < seq + 1) {
      std::ostringstream e;
      e << name << ": the " << side_name(validation) << " side of the data has " << tokens
        << " tokens, fewer than the seq_len + 1 = " << seq + 1 << " one row needs";
      e << (validation ? " (raise --valid-fraction, lower --seq-len or give --valid-data)"
                       : " (lower --seq-len or give more data)");
      return Status::error(e.str());
    }
    Stream s;
    s.source = std::move(src);
    s.shape.tokens = tokens;
    s.shape.windows = (tokens - seq - 1) / seq + 1;
    if (s.shape.windows > static_cast<int64_t>(kMaxBlendWeight))
      return Status::error(name + ": " + std::to_string(s.shape.windows) +
                           " samples per epoch, more than this sampler counts");
    streams.push_back(std::move(s));
  }
  std::vector<uint64_t> weights;
  if (data.weights.empty()) {
    for (const Stream& s : streams) weights.push_back(static_cast<uint64_t>(s.shape.windows));
  } else {
    weights = BlendOrder::quantize(data.weights);
  }
  BatchSampler sampler(std::move(streams), BlendOrder(std::move(weights)), batch, seq, options,
                       validation);
  for (size_t d = 0; d < sampler.streams_.size(); ++d) sampler.load_epoch(d, 0);
  return sampler;
}

std::vector<SourceShape> BatchSampler::shapes() const {
  std::vector<SourceShape> out;
  for (const Stream& s : streams_) out.push_back(s.shape);
  return out;
}

int64_t BatchSampler::tokens() const {
  int64_t n = 0;
  for (const Stream& s : streams_)
    for (const io::TokenRange& r : s.source.documents) n += static_cast<int64_t>(r.size());
  return n;
}

Result<std::vector<int64_t>> rows_of_packed(const DataSource& source, int64_t seq) {
  PACKMOE_CHECK(source.packed && source.packed->lines.size() == source.documents.size() &&
                    source.packed->trained->size() == source.tokens.size(),
                "packed source " << source.name << " without a flag per token and a line per document");
  std::vector<int64_t> first{0};
  int64_t used = 0;  // tokens in the current row
  for (size_t d = 0; d < source.documents.size(); ++d) {
    const int64_t n = static_cast<int64_t>(source.documents[d].size());
    if (n > seq)
      return Status::error(source.packed->file + ":" + std::to_string(source.packed->lines[d]) +
                           ": the conversation has " + std::to_string(n) +
                           " tokens, more than seq_len = " + std::to_string(seq) +
                           " (raise --seq-len or shorten it)");
    if (used + n > seq) {
      first.push_back(static_cast<int64_t>(d));
      used = 0;
    }
    used += n;
  }
  first.push_back(static_cast<int64_t>(source.documents.size()));
  return first;
}

void BatchSampler::load_epoch(size_t d, int64_t epoch) {
  Stream& s = streams_[d];
  if (s.epoch == epoch || (!options_.shuffle && s.epoch >= 0)) return;  // unshuffled: one order
  if (s.source.packed) {  // packed rows are fixed; only their order (next()) changes by epoch
    s.epoch = epoch;
    return;
  }
  const uint64_t D = s.source.documents.size();
  const uint64_t key = order_key(options_.seed,
                                 validation_ ? OrderKind::kValidDocuments : OrderKind::kTrainDocuments,
                                 d, static_cast<uint64_t>(epoch));
  s.order.resize(D);
  s.begin.resize(D + 1);
  s.begin[0] = 0;
  const int64_t sep = s.source.separator ? 1 : 0;
  for (uint64_t j = 0; j < D; ++j) {
    s.order[j] = options_.shuffle ? permute(j, D, key) : j;
    s.begin[j + 1] = s.begin[j] + static_cast<int64_t>(s.source.documents[s.order[j]].size()) +
                     (j + 1 < D ? sep : 0);
  }
  PACKMOE_CHECK(s.begin[D] == s.shape.tokens, "epoch stream of " << s.begin[D] << " tokens, not "
                                                                 << s.shape.tokens);
  s.epoch = epoch;
}

void BatchSampler::read_packed_row(Batch& b, int64_t r, const Stream& s, int64_t row) const {
  const PackedDocuments& p = *s.source.packed;
  const std::vector<uint8_t>& trained = *p.trained;
  int32_t* inputs = b.inputs.data() + r * seq_;    // (S)
  int32_t* targets = b.targets.data() + r * seq_;  // (S)
  const bool documents = options_.document_mask != DocumentMask::kNone;
  std::vector<uint32_t> doc;
  int64_t t = 0;
  const auto start_document = [&](int64_t from, int64_t to) {
    if (documents && options_.document_mask == DocumentMask::kIndex)
      for (int64_t i = from; i < to; ++i) b.doc_start[r * seq_ + i] = static_cast<int32_t>(from);
  };
  for (int64_t d = s.rows[static_cast<size_t>(row)]; d < s.rows[static_cast<size_t>(row) + 1]; ++d) {
    const io::TokenRange& range = s.source.documents[static_cast<size_t>(d)];
    const int64_t n = static_cast<int64_t>(range.size());
    doc.resize(static_cast<size_t>(n));
    s.source.tokens.read(range.begin, static_cast<uint64_t>(n), doc.data());
    for (int64_t i = 0; i < n; ++i) {
      inputs[t + i] = static_cast<int32_t>(doc[static_cast<size_t>(i)]);
      const bool target = i + 1 < n && trained[range.begin + static_cast<uint64_t>(i) + 1] != 0;
      targets[t + i] = target ? static_cast<int32_t>(doc[static_cast<size_t>(i) + 1]) : kIgnoredTarget;
    }
    start_document(t, t + n);
    t += n;
  }
  start_document(t, seq_);  // the padding: a document of its own
  for (; t < seq_; ++t) {
    inputs[t] = static_cast<int32_t>(p.pad);
    targets[t] = kIgnoredTarget;
  }
  if (documents && options_.document_mask == DocumentMask::kEodToken) mark_documents(b, r, s, 0);
  else if (documents) mark_positions(b, r);
}

void BatchSampler::mark_positions(Batch& b, int64_t r) const {
  if (!options_.reset_positions) return;
  for (int64_t t = 0; t < seq_; ++t)
    b.positions[r * seq_ + t] = static_cast<int32_t>(t - b.doc_start[r * seq_ + t]);
}

void BatchSampler::read_window(Batch& b, int64_t r, size_t d, int64_t window) {
  const Stream& s = streams_[d];
  if (s.source.packed) {
    read_packed_row(b, r, s, window);
    return;
  }
  const int64_t offset = window * seq_;
  std::vector<uint32_t> w(static_cast<size_t>(seq_ + 1));  // (S + 1)
  size_t j = static_cast<size_t>(std::upper_bound(s.begin.begin(), s.begin.end(), offset) -
                                 s.begin.begin() - 1);
  int64_t p = offset, filled = 0;
  while (filled < seq_ + 1) {
    while (p >= s.begin[j + 1]) ++j;
    const io::TokenRange& doc = s.source.documents[s.order[j]];
    const int64_t local = p - s.begin[j], len = static_cast<int64_t>(doc.size());
    if (local < len) {
      const int64_t n = std::min(len - local, seq_ + 1 - filled);
      s.source.tokens.read(doc.begin + static_cast<uint64_t>(local), static_cast<uint64_t>(n),
                           w.data() + filled);
      filled += n;
      p += n;
    } else {  // the separator after document j
      w[static_cast<size_t>(filled++)] = *s.source.separator;
      ++p;
    }
  }
  for (int64_t t = 0; t < seq_; ++t) {
    b.inputs[r * seq_ + t] = static_cast<int32_t>(w[t]);
    b.targets[r * seq_ + t] = static_cast<int32_t>(w[t + 1]);
  }
  if (options_.document_mask != DocumentMask::kNone) mark_documents(b, r, s, offset);
}

void BatchSampler::mark_documents(Batch& b, int64_t r, const Stream& s, int64_t offset) const {
  int32_t* start = b.doc_start.data() + r * seq_;  // (S)
  if (options_.document_mask == DocumentMask::kIndex) {
    // The last document starting at or before each token; clipped to the row's start.
    const auto first = s.begin.begin(), last = s.begin.end() - 1;  // document starts only
    auto next = std::upper_bound(first, last, offset);
    int64_t current = next == first ? offset : *(next - 1);
    for (int64_t t = 0; t < seq_; ++t) {
      while (next != last && *next <= offset + t) current = *next++;
      start[t] = static_cast<int32_t>(std::max<int64_t>(current - offset, 0));
    }
  } else {  // kEodToken: the token after an eod starts a document
    int32_t current = 0;
    for (int64_t t = 0; t < seq_; ++t) {
      start[t] = current;
      if (b.inputs[r * seq_ + t] == static_cast<int32_t>(options_.eod_token))
        current = static_cast<int32_t>(t + 1);
    }
  }
  mark_positions(b, r);
}

Batch BatchSampler::next() {
  Batch b;
  b.batch = batch_;
  b.seq = seq_;
  b.inputs.resize(static_cast<size_t>(batch_ * seq_));   // (B, S)
  b.targets.resize(static_cast<size_t>(batch_ * seq_));  // (B, S)
  const bool documents = options_.document_mask != DocumentMask::kNone;
  if (documents) b.doc_start.resize(static_cast<size_t>(batch_ * seq_));                   // (B, S)
  if (documents && options_.reset_positions) b.positions.resize(static_cast<size_t>(batch_ * seq_));
  for (int64_t r = 0; r < batch_; ++r) {
    const size_t d = blend_.next(consumed_);
    const Stream& s = streams_[d];
    const int64_t W = s.shape.windows;
    const int64_t epoch = consumed_[d] / W, k = consumed_[d] % W;
    load_epoch(d, epoch);
    const OrderKind kind = validation_ ? OrderKind::kValidSamples : OrderKind::kTrainSamples;
    const int64_t window =
        options_.shuffle ? static_cast<int64_t>(permute(static_cast<uint64_t>(k),
                                                        static_cast<uint64_t>(W),
                                                        order_key(options_.seed, kind, d,
                                                                  static_cast<uint64_t>(epoch))))
                         : k;
    read_window(b, r, d, window);
    ++consumed_[d];
  }
  return b;
}

Status BatchSampler::check_state(const SamplerState& state) const {
  if (state.consumed.size() != streams_.size())
    return Status::error("sampler state of " + std::to_string(state.consumed.size()) +
                         " sources, this data has " + std::to_string(streams_.size()));
  int64_t total = 0;
  for (int64_t c : state.consumed)
    if (c < 0 || __builtin_add_overflow(total, c, &total))
      return Status::error("sampler state: a sample count " + std::to_string(c) +
                           " out of range");
  return Status::ok();
}

Status BatchSampler::set_state(const SamplerState& state) {
  PACKMOE_RETURN_IF_ERROR(check_state(state));
  consumed_ = state.consumed;
  return Status::ok();
}

int64_t BatchSampler::rows_before_repeat(int64_t limit) const {
  std::vector<int64_t> counts(streams_.size(), 0);
  int64_t n = 0;
  for (; n < limit; ++n) {
    const size_t d = blend_.next(counts);
    if (counts[d] == streams_[d].shape.windows) break;
    ++counts[d];
  }
  return n;
}

Result<std::vector<Batch>> fixed_batches(DataBlend data, int64_t vocab_size, int64_t batch,
                                         int64_t seq, int64_t count, const StreamOptions& options) {
  std::string names;
  bool packed = false;  // SFT rows hold up to S tokens, not S + 1
  for (const DataSource& s : data.sources) {
    names += (names.empty() ? "" : ", ") + s.name;
    packed = packed || s.packed.has_value();
  }
  Result<BatchSampler> sampler =
      BatchSampler::create(std::move(data), vocab_size, batch, seq, options, /*validation=*/true);
  if (!sampler) return sampler.status();
  BatchSampler& s = sampler.value();
  const int64_t rows = s.rows_before_repeat(count * batch);
  if (rows < batch) {
    std::ostringstream e;
    e << names << ": the validation data gives " << rows << " distinct rows of "
      << (packed ? "seq_len = " + std::to_string(seq) : "seq_len + 1 = " + std::to_string(seq + 1))
      << " tokens, fewer than the micro_batch_size = " << batch
      << " of one evaluation batch (lower --micro-batch or --seq-len, raise --valid-fraction, "
         "or give --valid-data)";
    return Status::error(e.str());
  }
  std::vector<Batch> out;
  for (int64_t i = 0; i < rows / batch; ++i) out.push_back(s.next());
  return out;
}

}  // namespace packmoe::train
