// The decoding loop of `packmoe generate` (docs/generate.md): the prompt is prefilled once into a
// KV cache, then one token per step runs through the model (nn/kv_cache.h) and the next is chosen
// from its logits (generate/sampling.h), until an end-of-sequence token, max_new_tokens or the
// model's max_position_embeddings. Invariant: step n's choice depends only on the logits and
// (seed, n), so a run is reproducible on any machine that computes the same logits.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "generate/sampling.h"
#include "nn/model.h"

namespace packmoe::generate {

struct GenerateConfig {
  int64_t max_new_tokens = 64;  // >= 1
  SamplingConfig sampling;
  std::vector<int32_t> stop_ids;  // end-of-sequence tokens (emitted, then generation stops)
};

enum class StopReason { kEos, kMaxNewTokens, kMaxPositions };
const char* stop_reason_name(StopReason r);  // "eos", "max_new_tokens", "max_positions"

struct GenerateResult {
  std::vector<int32_t> ids;  // the new tokens, an end-of-sequence token included
  StopReason stop = StopReason::kMaxNewTokens;
};

// Called once per new token with its id and the logits (V) it was chosen from.
using TokenCallback = std::function<void(int32_t id, std::span<const float> logits)>;

// Generates after `prompt` (>= 1 tokens, at most max_position_embeddings, every id < V; else a
// Status error before anything is computed). The cache holds prompt + max_new_tokens positions
// (at most max_position_embeddings: generation stops there).
Result<GenerateResult> generate(Model& model, std::span<const int32_t> prompt,
                                const GenerateConfig& config, const TokenCallback& on_token = {});

}  // namespace packmoe::generate
