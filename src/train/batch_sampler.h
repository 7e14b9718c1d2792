// BatchSampler: cuts a blend of token sources into micro-batches of B rows x S tokens for the
// Model. Each source's epoch stream is its documents in an order (seeded shuffle per epoch, or
// source order), concatenated; its samples are the windows stream[kS, kS + S + 1) that fit
// (inputs the first S tokens, targets the last S), read in an order (seeded shuffle per epoch,
// or k = 0, 1, ...); an SFT source's samples are instead its documents packed whole into rows
// (rows_of_packed), ignored targets where no loss is taken. Each row comes from the source the
// blend rule picks (train/sample_order.h).
// Invariant: the batches are a pure function of (sources, options, state), the state is a count
// of samples drawn per source, observable and settable, so a resumed run reads exactly the
// rows it would have read; no thread count, machine or floating point enters.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/data_split.h"
#include "io/token_data.h"
#include "io/token_mmap.h"
#include "nn/model.h"
#include "train/sample_order.h"

namespace packmoe::train {

// How attention sees the documents of a row (Megatron's reset_attention_mask and
// reset_position_ids; packed THD sequences).
enum class DocumentMask {
  kNone,      // causal over the whole row (Megatron's default)
  kIndex,     // documents from the data's document boundaries; a separator belongs to the
              // document it follows
  kEodToken,  // a document ends with (and includes) each eod_token in the row
};

// One source of a blend: documents (token ranges of `tokens`, source order; a split side holds
// pieces of the source's documents). With `separator` set that token is inserted between
// consecutive documents of the epoch stream (the byte corpus uses '\n', so fortunes stay apart
// by a blank line; Megatron and llm.c data carry their own end-of-document tokens and use none).
// SFT data (train/sft_data.h): each document is a whole conversation, packed into rows rather
// than windowed (rows_of_packed), with a loss flag per token.
struct PackedDocuments {
  std::shared_ptr<const std::vector<uint8_t>> trained;  // (tokens) 1: a target with loss
  std::vector<int64_t> lines;  // (documents) each one's line in `file`, for messages
  std::string file;
  uint32_t pad = 0;            // the input of a row's unused tail (whose targets are ignored)
};

struct DataSource {
  std::string name;  // for messages
  io::TokenArray tokens;
  std::vector<io::TokenRange> documents;
  bool boundaries_known = true;  // false: one run of tokens whose documents are unknown (llm.c)
  std::optional<uint32_t> separator;
  std::optional<PackedDocuments> packed;  // SFT: the documents are packed, not windowed
};

// Packing (SFT): documents in source order fill rows of S tokens, each whole; one that does not
// fit in what is left of a row starts the next row, the rest padded. Row r holds documents
// [first[r], first[r + 1]). A document longer than S is an error naming its file and line.
// Row positions: input t of a document, target t + 1 when that token is trained, else
// kIgnoredTarget; a document's last position and the padding are never targets.
Result<std::vector<int64_t>> rows_of_packed(const DataSource& source, int64_t seq);
inline constexpr int32_t kIgnoredTarget = -100;

// Sources and their weights. Weighted: each row comes from source d with probability w_d / sum w
// (exactly, in counts: sample_order.h). Unweighted (weights empty): each source weighs its number
// of samples per epoch, i.e. the sources are concatenated, as Megatron-Core reads a blend
// without weights: an epoch of the blend reads every sample of every source once.
struct DataBlend {
  std::vector<DataSource> sources;
  std::vector<double> weights;  // (sources) > 0, or empty
};

// An in-memory dataset as a source: its documents (or, without doc_offsets, one run of tokens
// whose boundaries are unknown), named by data.source; and a blend of just that source.
DataSource in_memory_source(io::TokenDataset data, std::optional<uint32_t> separator = std::nullopt);
DataBlend single_source(io::TokenDataset data, std::optional<uint32_t> separator = std::nullopt);

// Windows may span a document boundary; with a document mask, each token attends only inside
// its own document (Batch::doc_start), and with reset_positions its RoPE position counts from its
// document's first token in the row. `shuffle`: documents and samples in a seeded order per epoch
// (Megatron's GPTDataset document / shuffle indices), from `seed`; off: source order.
struct StreamOptions {
  DocumentMask document_mask = DocumentMask::kNone;
  uint32_t eod_token = 0;  // kEodToken
  bool reset_positions = false;
  bool shuffle = false;
  uint64_t seed = 0;
};

// "causal" | "document" (the CLI's --attention-mask names; document means kIndex or kEodToken,
// as the caller decides).
const char* document_mask_name(DocumentMask mask);

// What a checkpoint records of the sampler: samples drawn from each source so far.
struct SamplerState {
  std::vector<int64_t> consumed;  // (sources)
};
// A source's stream, the same in every epoch: what a checkpoint checks its data against.
struct SourceShape {
  int64_t tokens = 0;   // stream tokens per epoch (separators included)
  int64_t windows = 0;  // samples per epoch: floor((tokens - S - 1) / S) + 1; packed: its rows
  bool packed = false;  // SFT documents packed into rows (DataSource::packed)
  bool operator==(const SourceShape&) const = default;
};

class BatchSampler {
 public:
  // `validation` picks the validation orders (independent of the training ones) and the
  // messages' wording. Errors, naming the source: no documents, a token >= vocab_size (the token
  // and its index), fewer than S + 1 stream tokens (the side, its tokens and what it needs),
  // weights of another count or not positive, kIndex without document boundaries, a separator or
  // eod_token >= vocab_size.
  static Result<BatchSampler> create(DataBlend data, int64_t vocab_size, int64_t batch,
                                     int64_t seq, const StreamOptions& options = {},
                                     bool validation = false);

  size_t sources() const { return streams_.size(); }
  std::vector<SourceShape> shapes() const;
  int64_t tokens() const;  // of the sources' documents, separators not counted

  Batch next();  // B rows, each from the source the blend picks
  SamplerState state() const { return {consumed_}; }
  // Errors unless one count per source, each >= 0.
  Status check_state(const SamplerState& state) const;
  Status set_state(const SamplerState& state);  // check_state, then continue from there
  // Rows from the start (no sample drawn) before some source would repeat a sample, at most
  // `limit`.
  int64_t rows_before_repeat(int64_t limit) const;

 private:
  struct Stream {  // one source's epoch stream
    DataSource source;
    SourceShape shape;
    int64_t epoch = -1;            // whose order `order` and `begin` hold
    std::vector<uint64_t> order;   // (D) the document at each place of the epoch
    std::vector<int64_t> begin;    // (D + 1) stream index of each place's first token
    std::vector<int64_t> rows;     // packed sources: (windows + 1) each row's first document
  };
  BatchSampler(std::vector<Stream> streams, BlendOrder blend, int64_t batch, int64_t seq,
               const StreamOptions& options, bool validation)
      : streams_(std::move(streams)),
        blend_(std::move(blend)),
        consumed_(streams_.size(), 0),
        batch_(batch),
        seq_(seq),
        options_(options),
        validation_(validation) {}
  void load_epoch(size_t d, int64_t epoch);
  // Row r of `b` from window `window` of source d's current epoch.
  void read_window(Batch& b, int64_t r, size_t d, int64_t window);
  void mark_documents(Batch& b, int64_t r, const Stream& s, int64_t offset) const;
  void read_packed_row(Batch& b, int64_t r, const Stream& s, int64_t row) const;
  void mark_positions(Batch& b, int64_t r) const;

  std::vector<Stream> streams_;
  BlendOrder blend_;
  std::vector<int64_t> consumed_;  // (sources)
  int64_t batch_, seq_;
  StreamOptions options_;
  bool validation_;
};

// The fixed evaluation set: the first batches of a validation sampler from its start, as many
// as fit (at most `count`) before any source repeats a sample, so every evaluation sees the same
// distinct windows. An error when not even one batch fits (the message says how many rows fit
// and what to change).
Result<std::vector<Batch>> fixed_batches(DataBlend data, int64_t vocab_size, int64_t batch,
                                         int64_t seq, int64_t count,
                                         const StreamOptions& options = {});

}  // namespace packmoe::train
