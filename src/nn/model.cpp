// Model: builds the layers from a ModelWeights map and runs the decoder's forward / backward.
// The host only checks the batch and builds the RoPE table; the losses stay in the backend's
// memory until the caller reads them (read_losses), so a micro-batch never waits on the device.
#include "nn/model.h"

#include "nn/decoder_layer.h"
#include "nn/layer_ops.h"
#include "nn/lm_head_loss.h"

namespace packmoe {

struct Model::Impl {
  std::unique_ptr<GroupedParam> embed;  // (1, V, H); null when tied to the LM head
  std::vector<std::unique_ptr<DecoderLayer>> layers;
  std::unique_ptr<RmsNorm> final_norm;
  std::unique_ptr<GroupedLinear> lm_head;  // (1, V, H)
  // params() indices: [first, end) of each decoder layer, the final norm, the untied LM head.
  std::vector<std::pair<size_t, size_t>> layer_params;
  size_t final_norm_param = 0, lm_head_param = 0;

  // RoPE table of the last batch shape (positions 0..S-1 per row).
  int64_t rope_batch = 0, rope_seq = 0;
  PositionTables rope;

  // Saved by a training forward.
  int64_t tokens = 0;     // T
  float loss_scale = 0;   // of the aux loss in the backward it began
  Tensor ids;             // (T) I32
  Tensor dlm;             // (T, H) F32: the LM head's dgrad, computed with the loss
  // Every MoE layer's router statistics of the last forward (null without MoE layers or aux loss).
  std::shared_ptr<AuxLossStats> aux_stats;

  const GroupedParam& embedding() const { return embed ? *embed : lm_head->param(); }
  GroupedParam& embedding() { return embed ? *embed : lm_head->param(); }
};

namespace {

const Tensor& weight(const ModelWeights& w, const std::string& name) { return w.at(name); }

std::string layer_name(int64_t i, const char* rest) {
  return "model.layers." + std::to_string(i) + "." + rest;
}

MoEBlockConfig moe_config(const ModelConfig& c, const ModelPrecision& p, int64_t layer) {
  MoEBlockConfig m;
  m.top_k = c.num_experts_per_tok;
  m.norm_topk_prob = c.norm_topk_prob;
  m.aux_loss_coef = static_cast<float>(c.router_aux_loss_coef);
  m.recipe = p.recipe;
  // Every layer's FC1 / FC2 get their own SR streams: (seed << 16) + layer, then x2 (+1).
  m.recipe.sr_seed = (p.recipe.sr_seed << 16) + static_cast<uint64_t>(layer);
  m.primary = p.primary;
  m.layout = p.layout;
  m.grad_accum_fusion = p.grad_accum_fusion;
  m.delay_wgrad = false;
  m.out_dtype = DType::kF32;
  m.activation_dtype = DType::kBF16;
  return m;
}

Status check_tokens(const std::vector<int32_t>& v, int64_t vocab, bool allow_ignore,
                    const char* what) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (allow_ignore && v[i] == -100) continue;
    if (v[i] < 0 || v[i] >= vocab)
      return Status::error(std::string(what) + "[" + std::to_string(i) + "] = " +
                           std::to_string(v[i]) + " is outside the vocabulary [0, " +
                           std::to_string(vocab) + ")");
  }
  return Status::ok();
}

// The batch's optional document starts and positions: B * S each; within a row doc_start is
// nondecreasing with 0 <= doc_start[t] <= (t's position in the row); positions lie in
// [0, max_positions).
Status check_layout(const Batch& batch, int64_t max_positions) {
  const int64_t S = batch.seq, T = batch.batch * S;
  if (!batch.doc_start.empty()) {
    if (static_cast<int64_t>(batch.doc_start.size()) != T)
      return Status::error("batch doc_start has " + std::to_string(batch.doc_start.size()) +
                           " entries for B x S = " + std::to_string(T) + " tokens");
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = t % S, d = batch.doc_start[t];
      if (d < 0 || d > i || (i > 0 && d < batch.doc_start[t - 1]))
        return Status::error("batch doc_start[" + std::to_string(t) + "] = " + std::to_string(d) +
                             " is not a document start of position " + std::to_string(i));
    }
  }
  if (!batch.positions.empty()) {
    if (static_cast<int64_t>(batch.positions.size()) != T)
      return Status::error("batch positions has " + std::to_string(batch.positions.size()) +
                           " entries for B x S = " + std::to_string(T) + " tokens");
    for (int64_t t = 0; t < T; ++t)
      if (batch.positions[t] < 0 || batch.positions[t] >= max_positions)
        return Status::error("batch positions[" + std::to_string(t) + "] = " +
                             std::to_string(batch.positions[t]) + " is outside [0, " +
                             std::to_string(max_positions) + ")");
  }
  return Status::ok();
}

}  // namespace

Model::Model(Backend& backend, const ModelConfig& config, const ModelPrecision& precision,
             const ModelWeights& init, ExpertSlice experts)
    : backend_(&backend), config_(config), precision_(precision), impl_(std::make_unique<Impl>()) {
  const Status valid = validate_model_weights(config, init, backend.device());
  PACKMOE_CHECK(valid.is_ok(), "Model: " << valid.message());
  if (experts.count == 0) experts.count = config.num_experts;
  PACKMOE_CHECK(experts.first >= 0 && experts.count >= 1 &&
                    experts.first + experts.count <= config.num_experts,
                "Model: experts [" << experts.first << ", " << experts.first + experts.count
                                   << ") of " << config.num_experts);
  expert_slice_ = experts;
  // Experts [first, first + count) of an (E, N, K) init: a view, which the params copy.
  auto slice = [&](const Tensor& all) {
    const int64_t per_expert = all.dim(1) * all.dim(2);
    return Tensor::view(static_cast<float*>(all.data()) + experts.first * per_expert, DType::kF32,
                        {experts.count, all.dim(1), all.dim(2)}, all.device());
  };
  const ModelConfig& c = config_;
  const Layout layout = precision.layout;
  const bool fusion = precision.grad_accum_fusion;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Impl& m = *impl_;

  const Tensor& embed = weight(init, "model.embed_tokens.weight");
  if (c.tie_word_embeddings) {
    m.lm_head = std::make_unique<GroupedLinear>(backend, dense_linear_config(layout, fusion),
                                                as_single_group(embed));
  } else {
    m.embed = std::make_unique<GroupedParam>(backend, QuantRecipe{Recipe::kBF16, false, 0},
                                             PrimaryWeight::kHighPrecision, layout,
                                             as_single_group(embed));
    m.lm_head = std::make_unique<GroupedLinear>(backend, dense_linear_config(layout, fusion),
                                                as_single_group(weight(init, "lm_head.weight")));
  }

  AttentionShape shape;
  shape.hidden = c.hidden_size;
  shape.q_heads = c.num_attention_heads;
  shape.kv_heads = c.num_key_value_heads;
  shape.head_dim = c.head_dim;
  shape.eps = eps;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayerInit li;
    li.input_norm = weight(init, layer_name(i, "input_layernorm.weight"));
    li.post_norm = weight(init, layer_name(i, "post_attention_layernorm.weight"));
    li.attention.q = weight(init, layer_name(i, "self_attn.q_proj.weight"));
    li.attention.k = weight(init, layer_name(i, "self_attn.k_proj.weight"));
    li.attention.v = weight(init, layer_name(i, "self_attn.v_proj.weight"));
    li.attention.o = weight(init, layer_name(i, "self_attn.o_proj.weight"));
    li.attention.q_norm = weight(init, layer_name(i, "self_attn.q_norm.weight"));
    li.attention.k_norm = weight(init, layer_name(i, "self_attn.k_norm.weight"));
    MoEBlockConfig mc;
    const bool is_moe = c.is_moe_layer(i);
    if (is_moe) {
      mc = moe_config(c, precision, i);
      li.moe.router = weight(init, layer_name(i, "mlp.gate.weight"));
      li.moe.fc1 = slice(weight(init, layer_name(i, "mlp.experts.gate_up_proj")));
      li.moe.fc2 = slice(weight(init, layer_name(i, "mlp.experts.down_proj")));
    } else {
      li.mlp_gate_up = weight(init, layer_name(i, "mlp.gate_up_proj"));
      li.mlp_down = weight(init, layer_name(i, "mlp.down_proj.weight"));
    }
    m.layers.push_back(std::make_unique<DecoderLayer>(backend, shape, eps, layout, fusion,
                                                      is_moe ? &mc : nullptr, li));
  }
  m.final_norm = std::make_unique<RmsNorm>(backend, layout, eps, weight(init, "model.norm.weight"));
  // One aux loss over every MoE layer's router outputs, as Hugging Face forms it.
  if (c.router_aux_loss_coef != 0.0)
    for (auto& layer : m.layers)
      if (layer->moe()) {
        if (!m.aux_stats) m.aux_stats = std::make_shared<AuxLossStats>(backend, c.num_experts);
        layer->moe()->share_aux_loss_stats(m.aux_stats);
      }

  // The parameter list, in model_param_specs order, with the linear that owns each (null for the
  // norms and the untied embedding) and whether a layer reads its FP32 weight (norms, embedding).
  const std::vector<ParamSpec> specs = model_param_specs(c);
  struct Entry {
    GroupedParam* param;
    GroupedLinear* linear;
    bool reads_fp32;
  };
  std::vector<Entry> order;
  auto add_linear = [&](GroupedLinear& l) { order.push_back({&l.param(), &l, false}); };
  auto add_fp32 = [&](GroupedParam& p) { order.push_back({&p, nullptr, true}); };
  if (m.embed)
    add_fp32(*m.embed);
  else  // tied: the embedding lookup reads the LM head's FP32 weight
    order.push_back({&m.lm_head->param(), m.lm_head.get(), true});
  for (auto& layer : m.layers) {
    const size_t first = order.size();
    Attention& a = layer->attention();
    add_fp32(layer->input_norm().param());
    for (GroupedLinear* l : {&a.q_proj(), &a.k_proj(), &a.v_proj(), &a.o_proj()}) add_linear(*l);
    add_fp32(a.q_norm().param());
    add_fp32(a.k_norm().param());
    add_fp32(layer->post_norm().param());
    if (MoEBlock* moe = layer->moe()) {
      for (GroupedLinear* l : {&moe->router(), &moe->fc1(), &moe->fc2()}) add_linear(*l);
    } else {
      add_linear(layer->mlp()->gate_up());
      add_linear(layer->mlp()->down());
    }
    m.layer_params.emplace_back(first, order.size());
  }
  m.final_norm_param = order.size();
  add_fp32(m.final_norm->param());
  m.lm_head_param = order.size();
  if (!c.tie_word_embeddings) add_linear(*m.lm_head);
  PACKMOE_CHECK(order.size() == specs.size(), "Model: parameter list out of step with the specs");
  for (size_t i = 0; i < specs.size(); ++i) {
    const bool expert = specs[i].name.find(".mlp.experts.") != std::string::npos;
    params_.push_back(
        {specs[i].name, order[i].param, specs[i].weight_decay, order[i].reads_fp32, expert});
    if (order[i].linear) linears_.push_back(order[i].linear);
  }
}

Model::~Model() = default;

void Model::set_grad_sr_offset(uint64_t offset) {
  for (GroupedLinear* l : linears_) l->set_grad_sr_offset(offset);
}

void Model::set_recompute(Recompute mode) {
  PACKMOE_CHECK(state_ == ModelState::kIdle, "set_recompute with a backward owed");
  recompute_ = mode;
  for (auto& layer : impl_->layers) layer->set_recompute(mode);
}

Result<ForwardLosses> Model::forward(const Batch& batch) {
  Result<QueuedLosses> queued = queue_forward(batch, std::nullopt);
  if (!queued) return queued.status();
  return read_losses(*backend_, {queued.value()})[0];
}

Result<ForwardLosses> Model::forward(const Batch& batch, float loss_scale) {
  return forward(batch, loss_scale, loss_scale);
}

Result<ForwardLosses> Model::forward(const Batch& batch, float loss_scale, float aux_scale) {
  Result<QueuedLosses> queued = queue_forward(batch, loss_scale, aux_scale);
  if (!queued) return queued.status();
  return read_losses(*backend_, {queued.value()})[0];
}

Result<QueuedLosses> Model::queue_forward(const Batch& batch, std::optional<float> loss_scale,
                                          std::optional<float> aux_scale) {
  PACKMOE_CHECK(state_ != ModelState::kForwardDone,
                "forward after a training forward whose backward has not run: the LM head's "
                "gradient is already in main_grad, so that backward is owed");
  const ModelConfig& c = config_;
  const int64_t B = batch.batch, S = batch.seq, T = B * S, V = c.vocab_size;
  if (B <= 0 || S <= 0)
    return Status::error("batch must have B > 0 rows of S > 0 tokens, got B = " +
                         std::to_string(B) + ", S = " + std::to_string(S));
  if (static_cast<int64_t>(batch.inputs.size()) != T ||
      static_cast<int64_t>(batch.targets.size()) != T)
    return Status::error("batch of B x S = " + std::to_string(T) + " tokens has " +
                         std::to_string(batch.inputs.size()) + " inputs and " +
                         std::to_string(batch.targets.size()) + " targets");
  if (S > c.max_position_embeddings)
    return Status::error("sequence length " + std::to_string(S) + " exceeds max_position_embeddings " +
                         std::to_string(c.max_position_embeddings));
  PACKMOE_RETURN_IF_ERROR(check_tokens(batch.inputs, V, false, "input"));
  PACKMOE_RETURN_IF_ERROR(check_tokens(batch.targets, V, true, "target"));

  Backend& b = *backend_;
  Impl& m = *impl_;
  const int64_t H = c.hidden_size, D = c.head_dim;
  PACKMOE_RETURN_IF_ERROR(check_layout(batch, c.max_position_embeddings));
  const bool own_positions = !batch.positions.empty();
  if (own_positions || m.rope_batch != B || m.rope_seq != S) {
    std::vector<int32_t> positions = batch.positions;
    if (!own_positions) {
      positions.resize(T);
      for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t % S);
    }
    std::vector<float> cos(T * (D / 2)), sin(T * (D / 2));
    RopeTableArgs r;
    r.tokens = T;
    r.head_dim = D;
    r.theta = c.rope_theta;
    r.positions = positions.data();
    r.cos = cos.data();
    r.sin = sin.data();
    PACKMOE_RETURN_IF_ERROR(rope_table(r));
    m.rope.cos = b.to_device(Tensor::view(cos.data(), DType::kF32, {T, D / 2}, Device::kCPU));
    m.rope.sin = b.to_device(Tensor::view(sin.data(), DType::kF32, {T, D / 2}, Device::kCPU));
    // A table made from a batch's own positions is not reused by the next batch.
    m.rope_batch = own_positions ? 0 : B;
    m.rope_seq = own_positions ? 0 : S;
  }
  m.rope.doc_start =
      batch.doc_start.empty()
          ? Tensor{}
          : b.to_device(Tensor::view(const_cast<int32_t*>(batch.doc_start.data()), DType::kI32,
                                     {T}, Device::kCPU));

  m.tokens = T;
  m.ids = b.to_device(Tensor::view(const_cast<int32_t*>(batch.inputs.data()), DType::kI32, {T},
                                   Device::kCPU));

  Tensor x = Tensor::empty(b, DType::kF32, {T, H});
  EmbeddingArgs e;
  e.tokens = T;
  e.vocab = V;
  e.hidden = H;
  e.ids = m.ids.data_as<const int32_t>();
  e.table = f32_weight(m.embedding());
  e.out = x.data_as<float>();
  check_op(ops::embedding(b, e), "embedding");

  QueuedLosses losses;
  losses.aux_coef = static_cast<float>(c.router_aux_loss_coef);
  losses.values = Tensor::empty(b, DType::kF32, {2});  // lm | aux
  b.fill_zero(losses.values.data(), losses.values.nbytes());
  float* const loss_values = losses.values.data_as<float>();
  if (m.aux_stats) m.aux_stats->reset(b);
  for (auto& layer : m.layers) x = layer->forward(x, B, S, m.rope);
  // One aux loss over every MoE layer's router statistics, left in the backend's memory.
  if (m.aux_stats) m.aux_stats->loss(b, loss_values + 1);
  // The LM head and the loss in chunks of tokens (nn/lm_head_loss.h); training also runs the
  // head's backward here, since the loss scale is known: its weight gradient is added into
  // main_grad now and dh waits for backward().
  Result<LmHeadLoss> head =
      lm_head_loss(m.lm_head->param(), m.final_norm->forward_bf16(x), batch.targets,
                   loss_scale, {}, loss_values);
  if (!head) return head.status();
  losses.target_tokens = head.value().valid;
  if (loss_scale) {
    m.loss_scale = aux_scale.value_or(*loss_scale);
    m.dlm = std::move(head.value().dh);
    state_ = ModelState::kForwardDone;
  }
  return losses;
}

std::vector<std::pair<int64_t, std::vector<int64_t>>> Model::expert_counts() const {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> out;
  for (size_t i = 0; i < impl_->layers.size(); ++i)
    if (MoEBlock* moe = impl_->layers[i]->moe())
      out.emplace_back(static_cast<int64_t>(i), moe->plan().counts);
  return out;
}

std::vector<ForwardLosses> read_losses(Backend& b, const std::vector<QueuedLosses>& queued) {
  constexpr size_t kBytes = 2 * sizeof(float);  // one QueuedLosses::values
  std::vector<float> host(2 * queued.size());
  if (queued.size() == 1) {
    b.copy(host.data(), queued[0].values.data(), kBytes, Backend::CopyKind::kDeviceToHost);
  } else if (!queued.empty()) {  // gathered on the device first: one wait for all of them
    const Tensor all = Tensor::empty(b, DType::kF32, {static_cast<int64_t>(host.size())});
    for (size_t i = 0; i < queued.size(); ++i)
      b.copy(all.data_as<float>() + 2 * i, queued[i].values.data(), kBytes,
             Backend::CopyKind::kDeviceToDevice);
    b.copy(host.data(), all.data(), host.size() * sizeof(float), Backend::CopyKind::kDeviceToHost);
  }
  std::vector<ForwardLosses> out(queued.size());
  for (size_t i = 0; i < queued.size(); ++i) {
    out[i].lm_loss = host[2 * i];
    out[i].aux_loss = host[2 * i + 1];
    out[i].aux_coef = queued[i].aux_coef;
    out[i].target_tokens = queued[i].target_tokens;
  }
  return out;
}

void Model::backward() {
  PACKMOE_CHECK(state_ == ModelState::kForwardDone,
                "Model backward needs a training forward first (and runs once per forward)");
  Backend& b = *backend_;
  Impl& m = *impl_;
  const ModelConfig& c = config_;
  const int64_t T = m.tokens, V = c.vocab_size, H = c.hidden_size;
  const float loss_scale = m.loss_scale;

  if (m.embed) grad_ready(m.lm_head_param, m.lm_head_param + 1);  // tied: after the embedding
  Tensor dx = m.final_norm->backward(m.dlm);  // (T, H)
  m.dlm = Tensor{};
  grad_ready(m.final_norm_param, m.final_norm_param + 1);
  for (size_t i = m.layers.size(); i-- > 0;) {
    dx = m.layers[i]->backward(dx, loss_scale);
    grad_ready(m.layer_params[i].first, m.layer_params[i].second);
  }

  // The op sums each row's tokens of this micro-batch from zero, then adds the sum to main_grad,
  // as the GEMM epilogues add theirs: so N data-parallel ranks, each adding its micro-batch's sum,
  // give bitwise what one process accumulating the N micro-batches gives (docs/dist.md; tied, the
  // LM head's sum lands between them and only the bound holds).
  EmbeddingBackwardArgs eb;
  eb.tokens = T;
  eb.vocab = V;
  eb.hidden = H;
  eb.ids = m.ids.data_as<const int32_t>();
  eb.dout = dx.data_as<const float>();
  eb.dtable = f32_grad(m.embedding());
  // The op adds onto every row it touches: a table of stale values is zeroed first.
  if (m.embedding().take_grad_write() == GradWrite::kOverwrite)
    b.fill_zero(eb.dtable, static_cast<size_t>(V * H) * sizeof(float));
  check_op(ops::embedding_backward(b, eb), "embedding_backward");
  grad_ready(0, 1);  // the embedding table (tied: also the LM head)
  state_ = ModelState::kIdle;
}

DecoderLayer& Model::layer(int64_t i) {
  PACKMOE_CHECK(i >= 0 && i < static_cast<int64_t>(impl_->layers.size()), "no layer " << i);
  return *impl_->layers[static_cast<size_t>(i)];
}
RmsNorm& Model::final_norm() { return *impl_->final_norm; }
GroupedLinear& Model::lm_head() { return *impl_->lm_head; }
const GroupedParam& Model::embedding() const { return impl_->embedding(); }

void Model::grad_ready(size_t first, size_t end) const {
  if (!grad_ready_) return;
  for (size_t i = first; i < end; ++i) grad_ready_(i);
}

void Model::zero_grad() {
  for (NamedParam& p : params_) p.param->zero_grad();
}

}  // namespace packmoe
