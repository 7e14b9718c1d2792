// The KV-cached forward (nn/kv_cache.h): KvCache, Attention::forward_cached,
// DecoderLayer::forward_cached and the model-level step. The same ops as the training forward
// (nn/attention.cpp, nn/decoder_layer.cpp, nn/model.cpp) on the new rows only: the whole prompt
// goes through the causal attention op, later tokens through attention_kv over the cache.
#include "nn/kv_cache.h"

#include <cmath>
#include <string>

#include "nn/decoder_layer.h"
#include "nn/layer_ops.h"
#include "nn/rms_norm.h"

namespace packmoe {

KvCache::KvCache(Backend& backend, const ModelConfig& config, int64_t capacity)
    : capacity_(capacity) {
  PACKMOE_CHECK(capacity >= 1 && capacity <= config.max_position_embeddings,
                "KvCache capacity " << capacity << " outside [1, max_position_embeddings = "
                                    << config.max_position_embeddings << "]");
  const int64_t width = config.num_key_value_heads * config.head_dim;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    layers_.push_back({Tensor::empty(backend, DType::kBF16, {capacity, width}),
                       Tensor::empty(backend, DType::kBF16, {capacity, width})});
}

PositionTables rope_tables(Backend& backend, const ModelConfig& config, int64_t first,
                           int64_t count) {
  const int64_t half = config.head_dim / 2;
  std::vector<int32_t> positions(static_cast<size_t>(count));
  for (int64_t t = 0; t < count; ++t) positions[t] = static_cast<int32_t>(first + t);
  std::vector<float> cos(count * half), sin(count * half);  // (count, D/2)
  RopeTableArgs r;
  r.tokens = count;
  r.head_dim = config.head_dim;
  r.theta = config.rope_theta;
  r.positions = positions.data();
  r.cos = cos.data();
  r.sin = sin.data();
  check_op(rope_table(r), "rope_table");
  PositionTables tables;
  tables.cos = backend.to_device(Tensor::view(cos.data(), DType::kF32, {count, half}, Device::kCPU));
  tables.sin = backend.to_device(Tensor::view(sin.data(), DType::kF32, {count, half}, Device::kCPU));
  return tables;
}

Tensor Attention::forward_cached(const Tensor& x, const PositionTables& rope, LayerKv& kv,
                                 int64_t past) {
  Backend& b = *backend_;
  const int64_t T = x.dim(0), H = shape_.hidden, D = shape_.head_dim;
  const int64_t Hq = shape_.q_heads, Hkv = shape_.kv_heads;
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(1) == H &&
                    past + T <= kv.k.dim(0),
                "Attention forward_cached: x must be (T, " << H << ") bf16 with past + T within "
                                                           << "the cache, got "
                                                           << shape_string(x.shape()));
  Tensor q, k, v;  // (T, Hq*D), (T, Hkv*D), (T, Hkv*D) BF16
  project(x, rope, q, k, v);
  const size_t row_bytes = static_cast<size_t>(Hkv * D) * sizeof(uint16_t);
  b.copy(kv.k.data_as<uint16_t>() + past * Hkv * D, k.data(), T * row_bytes,
         Backend::CopyKind::kDeviceToDevice);
  b.copy(kv.v.data_as<uint16_t>() + past * Hkv * D, v.data(), T * row_bytes,
         Backend::CopyKind::kDeviceToDevice);

  const Tensor attn = Tensor::empty(b, DType::kBF16, {T, Hq * D});
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (past == 0) {  // the whole sequence so far: the training forward's causal attention op
    const Tensor lse = Tensor::empty(b, DType::kF32, {1, Hq, T});
    AttentionArgs a;
    a.batch = 1;
    a.seq = T;
    a.q_heads = Hq;
    a.kv_heads = Hkv;
    a.head_dim = D;
    a.scale = scale;
    a.q = q.data_as<const uint16_t>();
    a.k = k.data_as<const uint16_t>();
    a.v = v.data_as<const uint16_t>();
    a.o = attn.data_as<uint16_t>();
    a.lse = lse.data_as<float>();
    check_op(ops::attention(b, a), "attention");
  } else {
    AttentionKvArgs a;
    a.queries = T;
    a.keys = past + T;
    a.q_heads = Hq;
    a.kv_heads = Hkv;
    a.head_dim = D;
    a.scale = scale;
    a.q = q.data_as<const uint16_t>();
    a.k = kv.k.data_as<const uint16_t>();
    a.v = kv.v.data_as<const uint16_t>();
    a.o = attn.data_as<uint16_t>();
    check_op(ops::attention_kv(b, a), "attention_kv");
  }
  return o_proj_.forward(attn, {T});  // (T, H)
}

Tensor DecoderLayer::forward_cached(const Tensor& x, const PositionTables& rope, LayerKv& kv,
                                    int64_t past) {
  const Tensor h =
      add(*backend_, x, attention_.forward_cached(input_norm_.forward_bf16(x), rope, kv, past));
  return mlp_residual(h);
}

Result<std::vector<float>> forward_cached(Model& model, std::span<const int32_t> ids,
                                          KvCache& cache) {
  PACKMOE_CHECK(model.state() == ModelState::kIdle,
                "forward_cached while a training forward's backward is owed");
  const ModelConfig& c = model.config();
  const int64_t T = static_cast<int64_t>(ids.size()), V = c.vocab_size, H = c.hidden_size;
  const int64_t past = cache.length();
  if (T < 1) return Status::error("forward_cached needs at least one new token");
  if (past + T > cache.capacity())
    return Status::error(std::to_string(past) + " cached + " + std::to_string(T) +
                         " new tokens exceed the cache's " + std::to_string(cache.capacity()) +
                         " positions");
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= V)
      return Status::error("token " + std::to_string(ids[t]) + " is outside the vocabulary [0, " +
                           std::to_string(V) + ")");

  Backend& b = model.backend();
  const Tensor dev_ids = b.to_device(
      Tensor::view(const_cast<int32_t*>(ids.data()), DType::kI32, {T}, Device::kCPU));
  Tensor x = Tensor::empty(b, DType::kF32, {T, H});  // (T, H) the residual stream
  EmbeddingArgs e;
  e.tokens = T;
  e.vocab = V;
  e.hidden = H;
  e.ids = dev_ids.data_as<const int32_t>();
  e.table = f32_weight(model.embedding());
  e.out = x.data_as<float>();
  check_op(ops::embedding(b, e), "embedding");

  const PositionTables rope = rope_tables(b, c, past, T);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    x = model.layer(i).forward_cached(x, rope, cache.layer(i), past);
  cache.length_ = past + T;

  // The norm is per row, so the last row alone gets the bits it gets among all rows.
  const Tensor last = Tensor::view(x.data_as<float>() + (T - 1) * H, DType::kF32, {1, H},
                                   x.device());
  const Tensor logits = model.lm_head().forward(model.final_norm().forward_bf16(last), {1});
  std::vector<float> out(static_cast<size_t>(V));  // (V)
  b.copy(out.data(), logits.data(), out.size() * sizeof(float), Backend::CopyKind::kDeviceToHost);
  b.synchronize();
  return out;
}

}  // namespace packmoe
