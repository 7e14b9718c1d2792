// Streaming writer of a Megatron-LM indexed dataset (<prefix>.bin + <prefix>.idx, the layout
// read_megatron reads: docs/formats.md), one sequence per document, for corpora larger than
// memory. Invariant: nothing appears under the target names until finish() succeeds; the .bin and
// .idx are written as temporary files beside them, fsync'd and renamed (.bin first, as
// write_megatron does), and a writer destroyed unfinished removes its temporary files.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/status.h"
#include "io/token_data.h"

namespace packmoe::io {

class MegatronWriter {
 public:
  // Errors: a float dtype, or the temporary files cannot be created beside `prefix`.
  static Result<MegatronWriter> create(const std::string& prefix, MegatronDType dtype);
  MegatronWriter(MegatronWriter&&) noexcept;
  MegatronWriter& operator=(MegatronWriter&&) noexcept;
  ~MegatronWriter();

  // Appends one document. Errors (the writer is then unusable): a token that does not fit the
  // dtype, a document of 2^31 tokens or more, a failed write.
  Status add_document(std::span<const uint32_t> tokens);
  // Writes the index and moves both files into place.
  Status finish();

  uint64_t documents() const;
  uint64_t tokens() const;

 private:
  struct State;
  explicit MegatronWriter(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace packmoe::io
