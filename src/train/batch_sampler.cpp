// Token stream construction (separators between documents), token range checks and the window
// arithmetic of BatchSampler.
#include "train/batch_sampler.h"

#include <sstream>

namespace packmoe::train {
namespace {

std::vector<uint32_t> build_stream(io::TokenDataset& data, const StreamOptions& options) {
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
  std::vector<uint32_t> stream = build_stream(data, options);
  if (static_cast<int64_t>(stream.size()) < seq + 1) {
    std::ostringstream e;
    e << source << ": " << stream.size() << " tokens, fewer than seq_len + 1 = " << seq + 1;
    return Status::error(e.str());
  }
  return BatchSampler(std::move(stream), source, batch, seq);
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
