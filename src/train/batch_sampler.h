// BatchSampler: cuts a token stream into micro-batches of B rows x S tokens for the Model. Row r is
// the window stream[p, p + S + 1): inputs its first S tokens, targets the last S (shifted by one,
// none ignored); p advances by S per row and wraps to 0 (a new epoch) when fewer than S + 1 tokens
// remain. Invariant: the batches are a pure function of (stream, position), and the position is
// observable and settable, so a resumed run reads exactly the windows it would have read.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/status.h"
#include "io/token_data.h"
#include "nn/model.h"

namespace packmoe::train {

// The stream is the dataset's tokens in order. Documents are concatenated; with `separator` set
// and boundaries known (doc_offsets), that token is inserted between consecutive documents
// (the byte corpus uses '\n', so fortunes stay apart by a blank line; Megatron and llm.c data
// carry their own end-of-document tokens and use none). Windows may span a document boundary:
// attention is causal over the whole row, as Megatron's default (no attention-mask reset).
struct StreamOptions {
  std::optional<uint32_t> separator;
};

struct SamplerPosition {
  int64_t offset = 0;  // stream index of the next row's first token, a multiple of S
  int64_t epoch = 0;   // completed passes over the stream
};

class BatchSampler {
 public:
  // Errors, naming data.source: a token >= vocab_size (the token and its index), or a stream of
  // fewer than S + 1 tokens.
  static Result<BatchSampler> create(io::TokenDataset data, int64_t vocab_size, int64_t batch,
                                     int64_t seq, const StreamOptions& options = {});

  int64_t stream_tokens() const { return static_cast<int64_t>(stream_.size()); }
  // Windows starting at 0, S, 2S, ... that fit: floor((T - S - 1) / S) + 1.
  int64_t windows_per_epoch() const;

  Batch next();  // B rows, then the position has advanced B windows (wrapping as needed)
  SamplerPosition position() const { return position_; }
  // Where the next row starts: position(), or (0, epoch + 1) after the last window of an epoch
  // (what next() wraps to first). The same windows follow; set_position accepts it.
  SamplerPosition next_row_position() const;
  // Errors unless 0 <= offset, offset a multiple of S, offset + S + 1 <= stream_tokens, epoch >= 0.
  Status check_position(const SamplerPosition& position) const;
  Status set_position(const SamplerPosition& position);  // check_position, then move there

 private:
  BatchSampler(std::vector<uint32_t> stream, std::string source, int64_t batch, int64_t seq)
      : stream_(std::move(stream)), source_(std::move(source)), batch_(batch), seq_(seq) {}
  std::vector<uint32_t> stream_;  // (T)
  std::string source_;
  int64_t batch_, seq_;
  SamplerPosition position_;
};

// The fixed evaluation set: the first `count` batches of a sampler over `data` from position 0,
// so every evaluation sees the same windows. An error when they do not fit in one pass (the
// message says how many windows there are and how many are needed).
Result<std::vector<Batch>> fixed_batches(io::TokenDataset data, int64_t vocab_size, int64_t batch,
                                         int64_t seq, int64_t count,
                                         const StreamOptions& options = {});

}  // namespace packmoe::train
