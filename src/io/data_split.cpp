// split_documents: the hash rule, then the position cut when a side has no document.
#include "io/data_split.h"

#include <algorithm>
#include <cmath>

#include "core/status.h"

namespace packmoe::io {

uint64_t document_index_key(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

DocumentSplit split_documents(std::span<const TokenRange> docs, std::span<const uint64_t> keys,
                              double fraction) {
  PACKMOE_CHECK(docs.size() == keys.size(), docs.size() << " documents, " << keys.size() << " keys");
  PACKMOE_CHECK(fraction >= 0 && fraction <= 1, "split fraction " << fraction);
  DocumentSplit s;
  const auto threshold = static_cast<uint64_t>(std::floor(fraction * kSplitBuckets));
  for (size_t d = 0; d < docs.size(); ++d)
    (keys[d] % kSplitBuckets < threshold ? s.validation : s.train).push_back(docs[d]);
  if (fraction <= 0 || fraction >= 1 || (!s.train.empty() && !s.validation.empty())) return s;

  // By position: the last ceil(fraction x T) tokens validate, at least 1 and at most T - 1.
  uint64_t total = 0;
  for (const TokenRange& d : docs) total += d.size();
  if (total < 2) return s;
  uint64_t valid = static_cast<uint64_t>(std::ceil(fraction * static_cast<double>(total)));
  valid = std::min(std::max<uint64_t>(valid, 1), total - 1);
  const uint64_t cut = total - valid;  // tokens before the cut train
  s = DocumentSplit{};
  s.by_position = true;
  uint64_t seen = 0;
  for (const TokenRange& d : docs) {
    if (seen + d.size() <= cut) {
      s.train.push_back(d);
    } else if (seen >= cut) {
      s.validation.push_back(d);
    } else {  // the document the cut falls in
      const uint64_t at = d.begin + (cut - seen);
      s.train.push_back({d.begin, at});
      s.validation.push_back({at, d.end});
    }
    seen += d.size();
  }
  return s;
}

}  // namespace packmoe::io
