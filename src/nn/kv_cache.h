// The KV cache of inference (docs/generate.md): per decoder layer the keys (after k_norm and RoPE)
// and values of every token of ONE sequence so far, as the attention core reads them (BF16), and
// the cached forward that runs only the new tokens through the model. Invariant: rows
// [0, length()) of every layer hold exactly the K / V bytes the whole-sequence forward computes
// for those positions, so a cached step's logits are what that forward gives its last row (on the
// CPU bitwise but for the GEMMs' row blocking; the bound: docs/generate.md).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "nn/attention.h"
#include "nn/model.h"

namespace packmoe {

// One layer's cache: rows [0, length) of the sequence, in the backend's memory.
struct LayerKv {
  Tensor k;  // (capacity, Hkv*D) BF16, keys after k_norm and RoPE at their positions
  Tensor v;  // (capacity, Hkv*D) BF16, values as projected
};

class KvCache {
 public:
  // Room for `capacity` positions (1 <= capacity <= max_position_embeddings) in every layer;
  // allocates 2 * layers * capacity * Hkv * D BF16 values on `backend`.
  KvCache(Backend& backend, const ModelConfig& config, int64_t capacity);

  int64_t length() const { return length_; }      // positions cached
  int64_t capacity() const { return capacity_; }
  LayerKv& layer(int64_t i) { return layers_.at(static_cast<size_t>(i)); }
  void clear() { length_ = 0; }  // a new sequence (the bytes stay, unread)

 private:
  friend Result<std::vector<float>> forward_cached(Model&, std::span<const int32_t>, KvCache&);
  int64_t capacity_;
  int64_t length_ = 0;
  std::vector<LayerKv> layers_;
};

// The RoPE table of positions [first, first + count), in `backend`'s memory, no document mask.
PositionTables rope_tables(Backend& backend, const ModelConfig& config, int64_t first,
                           int64_t count);

// Runs the n >= 1 new tokens `ids` of the cached sequence (positions [length, length + n)) through
// `model` (an evaluation forward: nothing is saved for backward, gradients untouched), appends
// their K / V to every layer of `cache` and returns the LM head's logits of the LAST new token,
// (V) F32 on the host. A token outside the vocabulary, or more tokens than the cache has room
// for, is a Status error before anything is computed.
Result<std::vector<float>> forward_cached(Model& model, std::span<const int32_t> ids,
                                          KvCache& cache);

}  // namespace packmoe
