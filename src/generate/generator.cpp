// The prefill-then-step loop of generate/generator.h.
#include "generate/generator.h"

#include <algorithm>
#include <string>

#include "nn/kv_cache.h"

namespace packmoe::generate {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::kEos: return "eos";
    case StopReason::kMaxNewTokens: return "max_new_tokens";
    case StopReason::kMaxPositions: return "max_positions";
  }
  return "?";
}

Result<GenerateResult> generate(Model& model, std::span<const int32_t> prompt,
                                const GenerateConfig& config, const TokenCallback& on_token) {
  const ModelConfig& c = model.config();
  const int64_t n = static_cast<int64_t>(prompt.size()), limit = c.max_position_embeddings;
  PACKMOE_RETURN_IF_ERROR(validate(config.sampling));
  if (config.max_new_tokens < 1)
    return Status::error("--max-new-tokens must be >= 1, got " +
                         std::to_string(config.max_new_tokens));
  if (n < 1) return Status::error("the prompt has no tokens");
  if (n > limit)
    return Status::error("the prompt has " + std::to_string(n) +
                         " tokens, more than the model's max_position_embeddings = " +
                         std::to_string(limit));

  // The last new token is only emitted, never run, so the cache needs n + max_new - 1 rows.
  const int64_t room = limit - n;  // >= 0; compared first so that a huge max_new cannot overflow
  KvCache cache(model.backend(), c,
                config.max_new_tokens - 1 >= room ? limit : n + config.max_new_tokens - 1);
  Result<std::vector<float>> logits = forward_cached(model, prompt, cache);
  GenerateResult out;
  for (int64_t step = 0;; ++step) {
    if (!logits) return logits.status();
    const int32_t id = choose_token(logits.value(), config.sampling, static_cast<uint64_t>(step));
    out.ids.push_back(id);
    if (on_token) on_token(id, logits.value());
    if (std::find(config.stop_ids.begin(), config.stop_ids.end(), id) != config.stop_ids.end()) {
      out.stop = StopReason::kEos;
      break;
    }
    if (static_cast<int64_t>(out.ids.size()) == config.max_new_tokens) {
      out.stop = StopReason::kMaxNewTokens;
      break;
    }
    if (cache.length() == limit) {  // the new token would sit past the last position
      out.stop = StopReason::kMaxPositions;
      break;
    }
    logits = forward_cached(model, std::span<const int32_t>(&out.ids.back(), 1), cache);
  }
  return out;
}

}  // namespace packmoe::generate
