// Encoding many documents on several threads. Each document is encoded on its own (a tokenizer
// keeps no state between calls), so the ids are a pure function of the documents, whatever the
// thread count; results come back in input order.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "tokenize/tokenizer.h"

namespace packmoe::tokenize {

struct EncodeFailure {
  size_t document = 0;  // index of the first document that failed
  Status status;
};

// out[i] = encode(docs[i]); on failure, the failure of the lowest-index document (the others may
// or may not have been encoded). threads >= 1.
Result<std::vector<std::vector<uint32_t>>> encode_documents(const Tokenizer& tokenizer,
                                                            std::span<const std::string_view> docs,
                                                            int threads,
                                                            EncodeFailure* failure = nullptr);

// A sensible default thread count: the hardware's, at least 1.
int default_threads();

}  // namespace packmoe::tokenize
