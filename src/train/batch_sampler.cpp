// Token stream construction (separators between documents), token range checks and the window
// arithmetic of BatchSampler.
#include "train/batch_sampler.h"

#include <algorithm>
#include <sstream>

namespace packmoe::train {
namespace {

// The stream and, in `doc_begin`, the stream index where each document starts (a separator
// belongs to the document before it).
std::vector<uint32_t> build_stream(io::TokenDataset& data, const StreamOptions& options,
                                   std::vector<int64_t>& doc_begin) {
  doc_begin.clear();
  const int64_t sep = options.separator ? 1 : 0;
  for (size_t d = 0; d < data.num_documents(); ++d)
    doc_begin.push_back(static_cast<int64_t>(data.doc_offsets[d]) + sep * static_cast<int64_t>(d));
  if (!options.separator || data.num_documents() < 2) return std::move(data.tokens);
  std::vector<uint32_t> stream;
  stream.reserve(data.tokens.size() + data.num_documents() - 1);
  for (size_t d = 0; d < data.num_documents(); ++d) {
    if (d > 0) stream.push_back(*options.separator);
    const auto doc = data.document(d);
    stream.insert(stream.end(), doc.begin(), doc.end());
  }
  return stream;
}

}  // namespace

Result<BatchSampler> BatchSampler::create(io::TokenDataset data, int64_t vocab_size, int64_t batch,
                                          int64_t seq, const StreamOptions& options) {
  PACKMOE_CHECK(batch >= 1 && seq >= 1 && vocab_size >= 1,
                "sampler shape B=" << batch << " S=" << seq << " V=" << vocab_size);
  const std::string source = data.source.empty() ? "token data" : data.source;
  for (size_t i = 0; i < data.tokens.size(); ++i) {
    if (data.tokens[i] >= static_cast<uint64_t>(vocab_size)) {
      std::ostringstream e;
      e << source << ": token " << data.tokens[i] << " at index " << i
        << " is not below the model's vocab_size " << vocab_size;
      return Status::error(e.str());
    }
  }
  if (options.separator && *options.separator >= static_cast<uint64_t>(vocab_size)) {
    std::ostringstream e;
    e << "document separator token " << *options.separator << " is not below vocab_size "
      << vocab_size;
    return Status::error(e.str());
  }
  if (options.document_mask == DocumentMask::kIndex && data.num_documents() == 0)
    return Status::error(source + ": --attention-mask document needs the data's document "
                                  "boundaries (this data has none): give --eod-token");
  if (options.document_mask == DocumentMask::kEodToken &&
      options.eod_token >= static_cast<uint64_t>(vocab_size))
    return Status::error("--eod-token " + std::to_string(options.eod_token) +
                         " is not below vocab_size " + std::to_string(vocab_size));
  std::vector<int64_t> doc_begin;
  std::vector<uint32_t> stream = build_stream(data, options, doc_begin);
  if (static_cast<int64_t>(stream.size()) < seq + 1) {
    std::ostringstream e;
    e << source << ": " << stream.size() << " tokens, fewer than seq_len + 1 = " << seq + 1;
    return Status::error(e.str());
  }
  if (options.document_mask != DocumentMask::kIndex) doc_begin.clear();
  return BatchSampler(std::move(stream), std::move(doc_begin), source, batch, seq, options);
}

const char* document_mask_name(DocumentMask mask) {
  return mask == DocumentMask::kNone ? "causal" : "document";
}

void BatchSampler::mark_documents(Batch& b, int64_t r, int64_t offset) const {
  int32_t* start = b.doc_start.data() + r * seq_;  // (S)
  if (options_.document_mask == DocumentMask::kIndex) {
    // The last document starting at or before each token; clipped to the row's start.
    auto next = std::upper_bound(doc_begin_.begin(), doc_begin_.end(), offset);
    int64_t current = next == doc_begin_.begin() ? offset : *(next - 1);
    for (int64_t t = 0; t < seq_; ++t) {
      while (next != doc_begin_.end() && *next <= offset + t) current = *next++;
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
  if (options_.reset_positions)
    for (int64_t t = 0; t < seq_; ++t) b.positions[r * seq_ + t] = static_cast<int32_t>(t - start[t]);
}

int64_t BatchSampler::windows_per_epoch() const {
  return (stream_tokens() - seq_ - 1) / seq_ + 1;
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
    if (position_.offset + seq_ + 1 > stream_tokens()) {
      position_.offset = 0;
      ++position_.epoch;
    }
    const uint32_t* w = stream_.data() + position_.offset;  // (S + 1)
    for (int64_t t = 0; t < seq_; ++t) {
      b.inputs[r * seq_ + t] = static_cast<int32_t>(w[t]);
      b.targets[r * seq_ + t] = static_cast<int32_t>(w[t + 1]);
    }
    if (documents) mark_documents(b, r, position_.offset);
    position_.offset += seq_;
  }
  return b;
}

SamplerPosition BatchSampler::next_row_position() const {
  if (position_.offset + seq_ + 1 > stream_tokens()) return {0, position_.epoch + 1};
  return position_;
}

Status BatchSampler::check_position(const SamplerPosition& p) const {
  if (p.epoch < 0 || p.offset < 0 || p.offset % seq_ != 0 || p.offset + seq_ + 1 > stream_tokens()) {
    std::ostringstream e;
    e << source_ << ": sampler position (epoch " << p.epoch << ", offset " << p.offset
      << ") is not a window start of this stream (" << stream_tokens() << " tokens, seq_len "
      << seq_ << ")";
    return Status::error(e.str());
  }
  return Status::ok();
}

Status BatchSampler::set_position(const SamplerPosition& p) {
  PACKMOE_RETURN_IF_ERROR(check_position(p));
  position_ = p;
  return Status::ok();
}

Result<std::vector<Batch>> fixed_batches(io::TokenDataset data, int64_t vocab_size, int64_t batch,
                                         int64_t seq, int64_t count, const StreamOptions& options) {
  const std::string source = data.source.empty() ? "token data" : data.source;
  Result<BatchSampler> sampler =
      BatchSampler::create(std::move(data), vocab_size, batch, seq, options);
  if (!sampler) return sampler.status();
  BatchSampler& s = sampler.value();
  if (s.windows_per_epoch() < count * batch) {
    std::ostringstream e;
    e << source << ": " << s.windows_per_epoch() << " windows of seq_len + 1 = " << seq + 1
      << " tokens, fewer than the " << count * batch << " an evaluation reads (eval_batches "
      << count << " x micro_batch_size " << batch << ")";
    return Status::error(e.str());
  }
  std::vector<Batch> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(s.next());
  return out;
}

}  // namespace packmoe::train
