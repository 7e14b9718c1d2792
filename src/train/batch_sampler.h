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

// How attention sees the documents of a row (Megatron's reset_attention_mask and
// reset_position_ids; packed THD sequences).
enum class DocumentMask {
  kNone,      // causal over the whole row (Megatron's default)
  kIndex,     // documents from the data's document index (doc_offsets); a separator belongs to
              // the document it follows
  kEodToken,  // a document ends with (and includes) each eod_token in the row
};

// The stream is the dataset's tokens in order. Documents are concatenated; with `separator` set
// and boundaries known (doc_offsets), that token is inserted between consecutive documents
// (the byte corpus uses '\n', so fortunes stay apart by a blank line; Megatron and llm.c data
// carry their own end-of-document tokens and use none). Windows may span a document boundary;
// with a document mask, each token attends only inside its own document (Batch::doc_start), and
// with reset_positions its RoPE position counts from its document's first token in the row.
struct StreamOptions {
  std::optional<uint32_t> separator;
  DocumentMask document_mask = DocumentMask::kNone;
  uint32_t eod_token = 0;  // kEodToken
  bool reset_positions = false;
};

// "causal" | "document" (the CLI's --attention-mask names; document means kIndex or kEodToken,
// as the caller decides).
const char* document_mask_name(DocumentMask mask);

struct SamplerPosition {
  int64_t offset = 0;  // stream index of the next row's first token, a multiple of S
  int64_t epoch = 0;   // completed passes over the stream
};

class BatchSampler {
 public:
  // Errors, naming data.source: a token >= vocab_size (the token and its index), or a stream of
  // fewer than S + 1 tokens; kIndex without a document index, an eod_token >= vocab_size.
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
  BatchSampler(std::vector<uint32_t> stream, std::vector<int64_t> doc_begin, std::string source,
               int64_t batch, int64_t seq, const StreamOptions& options)
      : stream_(std::move(stream)),
        doc_begin_(std::move(doc_begin)),
        source_(std::move(source)),
        batch_(batch),
        seq_(seq),
        options_(options) {}
  // Row r's doc_start (and positions) from its window starting at stream index `offset`.
  void mark_documents(Batch& b, int64_t r, int64_t offset) const;

  std::vector<uint32_t> stream_;     // (T)
  std::vector<int64_t> doc_begin_;   // kIndex: stream index of each document's first token
  std::string source_;
  int64_t batch_, seq_;
  StreamOptions options_;
  SamplerPosition position_;
};

// The fixed evaluation set: the first `count` batches of a sampler over `data` from position 0,
// so every evaluation sees the same windows. An error when they do not fit in one pass (the
// message says how many windows there are and how many are needed).
Result<std::vector<Batch>> fixed_batches(io::TokenDataset data, int64_t vocab_size, int64_t batch,
                                         int64_t seq, int64_t count,
                                         const StreamOptions& options = {});

}  // namespace packmoe::train
