// MoEBlock forward / backward: the router linear, the MoE ops of backend/ops/moe.h and the two
// grouped expert linears, in the order the header lists; every intermediate is a backend tensor,
// and with the BF16 recipe no op here copies to the host (the routing plan's counts stay on the
// device); a quantized recipe copies the expert counts once per forward.
#include "nn/moe_block.h"

namespace packmoe {
namespace {

GroupedLinearConfig router_config(const MoEBlockConfig& cfg) {
  GroupedLinearConfig c;
  c.recipe = QuantRecipe{Recipe::kBF16, false, 0};
  c.primary = PrimaryWeight::kHighPrecision;
  c.layout = cfg.layout;
  c.grad_accum_fusion = cfg.grad_accum_fusion;
  c.delay_wgrad = false;
  c.out_dtype = DType::kF32;  // logits, and dx for the F32 sum with the expert path
  return c;
}

GroupedLinearConfig expert_config(const MoEBlockConfig& cfg, uint64_t sr_seed) {
  GroupedLinearConfig c;
  c.recipe = cfg.recipe;
  c.recipe.sr_seed = sr_seed;
  c.primary = cfg.primary;
  c.layout = cfg.layout;
  c.grad_accum_fusion = cfg.grad_accum_fusion;
  c.delay_wgrad = cfg.delay_wgrad;
  c.out_dtype = cfg.activation_dtype;
  return c;
}

Tensor router_init(const Tensor& router) {  // (E, H) -> (1, E, H)
  PACKMOE_CHECK(router.rank() == 2,
                "MoEBlock router init must be (E, H), got " << shape_string(router.shape()));
  return router.reshaped({1, router.dim(0), router.dim(1)});
}

}  // namespace

AuxLossStats::AuxLossStats(Backend& backend, int64_t experts)
    : counts(Tensor::empty(backend, DType::kI64, {experts})),
      prob_sums(Tensor::empty(backend, DType::kF32, {experts})) {
  reset(backend);
}

void AuxLossStats::reset(Backend& backend) {
  backend.fill_zero(counts.data(), counts.nbytes());
  backend.fill_zero(prob_sums.data(), prob_sums.nbytes());
  tokens = 0;
}

void AuxLossStats::loss(Backend& backend, float* aux) const {
  AuxLossArgs a;
  a.tokens = tokens;
  a.experts = counts.numel();
  a.counts = counts.data_as<const int64_t>();
  a.prob_sums = prob_sums.data_as<const float>();
  a.aux = aux;
  check_op(ops::aux_loss(backend, a), "aux_loss");
}

MoEBlock::MoEBlock(Backend& backend, const MoEBlockConfig& cfg, const MoEBlockInit& init)
    : backend_(&backend),
      cfg_(cfg),
      router_(backend, router_config(cfg), router_init(init.router)),
      fc1_(backend, expert_config(cfg, 2 * cfg.recipe.sr_seed), init.fc1),
      fc2_(backend, expert_config(cfg, 2 * cfg.recipe.sr_seed + 1), init.fc2) {
  const int64_t e = init.router.dim(0), h = init.router.dim(1);
  const int64_t el = fc1_.param().experts(), f = fc2_.param().k();
  PACKMOE_CHECK(el >= 1 && e % el == 0 && fc1_.param().n() == 2 * f && fc1_.param().k() == h,
                "MoEBlock fc1 init must be (E_local, 2F, H) with E_local dividing E = "
                    << e << ", 2F = " << 2 * f << ", H = " << h);
  PACKMOE_CHECK(fc2_.param().experts() == el && fc2_.param().n() == h,
                "MoEBlock fc2 init must be (E_local, H, F) with E_local = " << el << ", H = " << h);
  PACKMOE_CHECK(cfg.top_k >= 1 && cfg.top_k <= e,
                "MoEBlock top_k " << cfg.top_k << " for " << e << " experts");
  PACKMOE_CHECK(cfg.out_dtype == DType::kBF16 || cfg.out_dtype == DType::kF32,
                "MoEBlock outputs bf16 or f32");
  PACKMOE_CHECK(cfg.activation_dtype == DType::kBF16 || cfg.activation_dtype == DType::kF32,
                "MoEBlock activations are bf16 or f32");
  if (cfg.aux_loss_coef != 0.0f) aux_stats_ = std::make_shared<AuxLossStats>(backend, e);
}

std::vector<GroupedParam*> MoEBlock::params() {
  return {&router_.param(), &fc1_.param(), &fc2_.param()};
}

void MoEBlock::zero_grad() {
  for (GroupedParam* p : params()) p->zero_grad();
}

Tensor MoEBlock::forward(const Tensor& x, bool recomputed) {
  PACKMOE_CHECK(state_ != BlockState::kWgradPending,
                "MoEBlock forward with delayed wgrads pending: run backward_dw first, or their "
                "gradients are lost");
  const int64_t E = experts(), H = hidden(), k = cfg_.top_k;
  PACKMOE_CHECK(x.dtype() == DType::kBF16 && x.rank() == 2 && x.dim(1) == H && x.dim(0) > 0,
                "MoEBlock forward: x must be (T, " << H << ") bf16 with T > 0, got "
                                                   << shape_string(x.shape()));
  PACKMOE_CHECK(x.device() == backend_->device(),
                "MoEBlock forward: x is not in the backend's memory");
  const int64_t T = x.dim(0);
  Backend& b = *backend_;

  // Router: logits (T, E) F32 = x . W_r^T, one GEMM group of T tokens.
  const Tensor logits = router_.forward(x, {T});
  probs_ = Tensor::empty(b, DType::kF32, {T, E});
  idx_ = Tensor::empty(b, DType::kI32, {T, k});
  w_ = Tensor::empty(b, DType::kF32, {T, k});
  RouterTopkArgs ra;
  ra.tokens = T;
  ra.experts = E;
  ra.top_k = k;
  ra.norm_topk_prob = cfg_.norm_topk_prob;
  ra.logits = logits.data_as<const float>();
  ra.probs = probs_.data_as<float>();
  ra.idx = idx_.data_as<int32_t>();
  ra.w = w_.data_as<float>();
  check_op(ops::router_topk(b, ra), "router_topk");

  if (cfg_.aux_loss_coef != 0.0f && !recomputed) {
    if (!aux_stats_shared_) aux_stats_->reset(b);
    AuxLossStatsArgs aa;
    aa.tokens = T;
    aa.experts = E;
    aa.top_k = k;
    aa.probs = probs_.data_as<const float>();
    aa.idx = idx_.data_as<const int32_t>();
    aa.counts = aux_stats_->counts.data_as<int64_t>();
    aa.prob_sums = aux_stats_->prob_sums.data_as<float>();
    check_op(ops::aux_loss_stats(b, aa), "aux_loss_stats");
    aux_stats_->tokens += T;
  }

  // The plan stays in the backend's memory: the rows buffers hold the most rows any plan can
  // have (C), the GEMMs read the padded counts there and the row ops skip the rows past M.
  const int64_t align = token_alignment(cfg_.recipe.recipe);
  const int64_t C = routing_plan_max_rows(T, E, k, align);
  tokens_ = T;
  capacity_ = C;
  dest_ = Tensor::empty(b, DType::kI32, {T, k});
  row_slot_ = Tensor::empty(b, DType::kI32, {C});  // the first M rows are the plan's
  counts_ = Tensor::empty(b, DType::kI64, {E + 1});
  plan_rows_.counts = Tensor::empty(b, DType::kI64, {E});
  plan_rows_.used = Tensor::empty(b, DType::kI64, {1});
  RoutingPlanArgs rp;
  rp.tokens = T;
  rp.experts = E;
  rp.top_k = k;
  rp.align = align;
  rp.max_rows = C;
  rp.idx = idx_.data_as<const int32_t>();
  rp.dest = dest_.data_as<int32_t>();
  rp.row_slot = row_slot_.data_as<int32_t>();
  rp.counts = counts_.data_as<int64_t>();
  rp.padded_counts = plan_rows_.counts.data_as<int64_t>();
  rp.rows = plan_rows_.used.data_as<int64_t>();
  check_op(ops::routing_plan(b, rp), "routing_plan");
  has_plan_ = true;

  ExpertRows all = plan_rows_;
  // A quantized recipe groups its activation rows by the counts on the host, and a dispatcher
  // that exchanges rows needs them there too: the host waits for them now, before the permute is
  // queued, so the device permutes while the host prepares what follows (waiting after the
  // permute, the device would sit idle meanwhile).
  if (fc1_.param().recipe_ops().quantized() || dispatcher_->needs_host_counts()) {
    all.host_counts.assign(static_cast<size_t>(all.counts.numel()), 0);  // (E)
    b.copy(all.host_counts.data(), all.counts.data(), all.counts.nbytes(),
           Backend::CopyKind::kDeviceToHost);
  }

  // xp (C, H) BF16: each expert's tokens, then zero padding rows (and zeros past row M).
  all.rows = Tensor::empty(b, DType::kBF16, {C, H});
  PermuteArgs pa;
  pa.tokens = T;
  pa.hidden = H;
  pa.top_k = k;
  pa.rows = C;
  pa.dtype = DType::kBF16;
  pa.row_slot = row_slot_.data_as<const int32_t>();
  pa.dest = dest_.data_as<const int32_t>();
  pa.x = x.data();
  pa.xp = all.rows.data();
  check_op(ops::permute(b, pa), "permute");

  // The expert MLP runs on the rows of this rank's experts (all of them, locally).
  ExpertRows local;
  if (dispatcher_->dispatch_dtype() == DispatchDtype::kRecipe) {
    h_ = forward_fc1_from_payload(all, local);
  } else {
    local = dispatcher_->dispatch(all);
    // A dispatcher that made new counts without knowing them on the host: one wait for both
    // FC1 and FC2.
    if (local.host_counts.empty() && fc1_.param().recipe_ops().quantized()) {
      local.host_counts.assign(static_cast<size_t>(local.counts.numel()), 0);
      b.copy(local.host_counts.data(), local.counts.data(), local.counts.nbytes(),
             Backend::CopyKind::kDeviceToHost);
    }
    h_ = local.host_counts.empty() ? fc1_.forward(local.rows, local.counts)
                                   : fc1_.forward(local.rows, local.host_counts);  // (CL, 2F)
  }
  const Tensor a = swiglu(local);                                                // (CL, F)
  yp_ = dispatcher_->combine(local.host_counts.empty()
                                 ? fc2_.forward(a, local.counts)
                                 : fc2_.forward(a, local.host_counts));  // (C, H)
  if (recompute_swiglu_) fc2_.release_input();

  Tensor y = Tensor::empty(b, cfg_.out_dtype, {T, H});
  UnpermuteArgs ua;
  ua.tokens = T;
  ua.hidden = H;
  ua.top_k = k;
  ua.rows = C;
  ua.dest = dest_.data_as<const int32_t>();
  ua.w = w_.data_as<const float>();
  ua.yp_dtype = cfg_.activation_dtype;
  ua.yp = yp_.data();
  ua.y_dtype = cfg_.out_dtype;
  ua.y = y.data();
  check_op(ops::unpermute(b, ua), "unpermute");
  state_ = BlockState::kForwardDone;
  return y;
}

Tensor MoEBlock::backward(const Tensor& dy, GradAccum accum, float loss_scale) {
  // Under expert parallelism the wgrads wait for the combine to start, so they overlap it.
  const bool overlap = dispatcher_->overlaps_combine();
  const GroupedLinear::Wgrad wgrad =
      overlap ? GroupedLinear::Wgrad::kQueued : GroupedLinear::Wgrad::kAsConfigured;
  PACKMOE_CHECK(state_ == BlockState::kForwardDone,
                "MoEBlock backward needs a forward first (and runs once per forward)");
  const int64_t T = tokens_, E = experts(), H = hidden(), F = ffn(), k = cfg_.top_k;
  const int64_t C = capacity_;
  PACKMOE_CHECK((dy.dtype() == DType::kBF16 || dy.dtype() == DType::kF32) && dy.rank() == 2 &&
                    dy.dim(0) == T && dy.dim(1) == H,
                "MoEBlock backward: dy must be (" << T << ", " << H << ") bf16 or f32, got "
                                                  << shape_string(dy.shape()));
  PACKMOE_CHECK(dy.device() == backend_->device(),
                "MoEBlock backward: dy is not in the backend's memory");
  Backend& b = *backend_;

  // Combine: dyp (C, H) BF16 (FC2's dY operand) and dL/dw (T, k).
  ExpertRows all = plan_rows_;
  all.rows = Tensor::empty(b, DType::kBF16, {C, H});
  const Tensor& dyp = all.rows;
  const Tensor dw = Tensor::empty(b, DType::kF32, {T, k});
  UnpermuteBackwardArgs ub;
  ub.tokens = T;
  ub.hidden = H;
  ub.top_k = k;
  ub.rows = C;
  ub.dest = dest_.data_as<const int32_t>();
  ub.row_slot = row_slot_.data_as<const int32_t>();
  ub.w = w_.data_as<const float>();
  ub.yp_dtype = cfg_.activation_dtype;
  ub.yp = yp_.data();
  ub.dy_dtype = dy.dtype();
  ub.dy = dy.data();
  ub.dyp_dtype = DType::kBF16;
  ub.dyp = dyp.data();
  ub.dw = dw.data_as<float>();
  check_op(ops::unpermute_backward(b, ub), "unpermute_backward");

  // dY rows travel to the experts as the inputs did (the forward's plan: dispatch_again), dX rows
  // come back as the outputs did.
  const ExpertRows local = dispatcher_->dispatch_again(all);
  const int64_t CL = local.rows.dim(0);
  if (recompute_swiglu_) fc2_.restore_input(swiglu(local));
  const Tensor da = fc2_.backward(local.rows, accum, wgrad);      // (CL, F)
  const Tensor dh = Tensor::empty(b, DType::kBF16, {CL, 2 * F});  // FC1's dY operand
  SwigluBackwardArgs sb;
  sb.rows = CL;
  sb.rows_device = local.used.data_as<const int64_t>();
  sb.ffn = F;
  sb.in_dtype = cfg_.activation_dtype;
  sb.in = h_.data();
  sb.dout_dtype = cfg_.activation_dtype;
  sb.dout = da.data();
  sb.din_dtype = DType::kBF16;
  sb.din = dh.data();
  if (CL > 0) check_op(ops::swiglu_backward(b, sb), "swiglu_backward");
  // dX rows go back while the router's backward runs, and under expert parallelism the two
  // expert wgrads, which the dgrads queued (delay_wgrad leaves them queued for backward_dw): none
  // of these reads the rows.
  const Tensor dxp = dispatcher_->start_combine(fc1_.backward(dh, accum, wgrad));  // (C, H)
  if (overlap && !cfg_.delay_wgrad) {
    fc2_.backward_dw();
    fc1_.backward_dw();
  }

  // Router path: dlogits (T, E) F32 from the combine weights and the aux loss, rounded to BF16
  // once because it is the router GEMMs' dY operand.
  const Tensor dlogits = Tensor::empty(b, DType::kF32, {T, E});
  RouterTopkBackwardArgs rb;
  rb.tokens = T;
  rb.experts = E;
  rb.top_k = k;
  rb.norm_topk_prob = cfg_.norm_topk_prob;
  rb.probs = probs_.data_as<const float>();
  rb.idx = idx_.data_as<const int32_t>();
  rb.dw = dw.data_as<const float>();
  rb.dlogits = dlogits.data_as<float>();
  check_op(ops::router_topk_backward(b, rb), "router_topk_backward");
  if (cfg_.aux_loss_coef != 0.0f) {
    AuxLossBackwardArgs ab;
    ab.tokens = T;
    ab.experts = E;
    ab.total_tokens = aux_stats_->tokens;
    ab.daux = cfg_.aux_loss_coef * loss_scale;
    ab.probs = probs_.data_as<const float>();
    ab.counts = aux_stats_->counts.data_as<const int64_t>();
    ab.dlogits = dlogits.data_as<float>();
    check_op(ops::aux_loss_backward(b, ab), "aux_loss_backward");
  }
  const Tensor dlogits_bf16 = Tensor::empty(b, DType::kBF16, {T, E});
  check_op(
      ops::cast_f32_to_bf16(b, one_segment<const float>(dlogits), one_segment<uint16_t>(dlogits_bf16)),
      "cast dlogits");
  const Tensor dx_router = router_.backward(dlogits_bf16, accum);  // (T, H) F32

  dispatcher_->finish_combine();
  Tensor dx = Tensor::empty(b, DType::kF32, {T, H});
  PermuteBackwardArgs pb;
  pb.tokens = T;
  pb.hidden = H;
  pb.top_k = k;
  pb.rows = C;
  pb.dest = dest_.data_as<const int32_t>();
  pb.dxp_dtype = cfg_.activation_dtype;
  pb.dxp = dxp.data();
  pb.dx = dx.data_as<float>();
  check_op(ops::permute_backward(b, pb), "permute_backward");
  check_op(ops::add_f32(b, one_segment<float>(dx), one_segment<const float>(dx_router)), "dx sum");

  // The linears keep what their queued wgrads read; the block's own saved tensors are done.
  probs_ = idx_ = w_ = h_ = yp_ = dest_ = row_slot_ = Tensor{};
  plan_rows_ = ExpertRows{};
  state_ = cfg_.delay_wgrad ? BlockState::kWgradPending : BlockState::kIdle;
  return dx;
}

void MoEBlock::backward_dw() {
  PACKMOE_CHECK(state_ == BlockState::kWgradPending,
                "MoEBlock backward_dw without queued wgrads (they run once per backward, and are "
                "only queued with delay_wgrad)");
  fc2_.backward_dw();
  fc1_.backward_dw();
  state_ = BlockState::kIdle;
}

Tensor MoEBlock::forward_fc1_from_payload(ExpertRows& all, ExpertRows& local) {
  const LinearRecipe& recipe = fc1_.param().recipe_ops();
  PACKMOE_CHECK(recipe.quantized(), "MoEBlock: --dispatch-dtype recipe with the bf16 recipe");
  // Each expert's rows are one quantization group: on its holder, the group of this source.
  PACKMOE_CHECK(!all.host_counts.empty(), "MoEBlock: a payload dispatch without host counts");
  DispatchPayload sent = recipe.dispatch_payload(all.rows, all.host_counts);  // (C, W) U8
  all.rows = sent.rows;
  all.amax = sent.amax;
  local = dispatcher_->dispatch(all);
  PACKMOE_CHECK(!local.host_counts.empty(),
                "MoEBlock: a payload's dispatcher must give the counts on the host");
  return fc1_.forward_received({local.rows, local.amax}, local.host_counts);  // (CL, 2F)
}

Tensor MoEBlock::swiglu(const ExpertRows& local) const {
  const int64_t CL = local.rows.dim(0), F = ffn();
  Tensor a = Tensor::empty(*backend_, DType::kBF16, {CL, F});
  SwigluArgs sa;
  sa.rows = CL;
  sa.rows_device = local.used.data_as<const int64_t>();
  sa.ffn = F;
  sa.in_dtype = cfg_.activation_dtype;
  sa.in = h_.data();
  sa.out_dtype = DType::kBF16;
  sa.out = a.data();
  // Expert parallelism can bring a rank no row at all (its experts got no token anywhere).
  if (CL > 0) check_op(ops::swiglu(*backend_, sa), "swiglu");
  return a;
}

void MoEBlock::release() {
  PACKMOE_CHECK(state_ == BlockState::kForwardDone, "MoEBlock release needs a forward first");
  for (GroupedLinear* l : {&router_, &fc1_, &fc2_}) l->release_input();
  probs_ = idx_ = w_ = h_ = yp_ = dest_ = row_slot_ = Tensor{};
  plan_rows_ = ExpertRows{};
  state_ = BlockState::kIdle;
}

void MoEBlock::set_token_dispatcher(std::unique_ptr<TokenDispatcher> dispatcher) {
  PACKMOE_CHECK(dispatcher != nullptr, "MoEBlock: a null token dispatcher");
  PACKMOE_CHECK(state_ == BlockState::kIdle,
                "MoEBlock: the token dispatcher changes only between steps (state Idle)");
  dispatcher_ = std::move(dispatcher);
}

RoutingPlan MoEBlock::plan() const {
  PACKMOE_CHECK(has_plan_, "MoEBlock plan before the first forward");
  std::vector<int64_t> counts(counts_.numel());  // (E + 1)
  backend_->copy(counts.data(), counts_.data(), counts_.nbytes(), Backend::CopyKind::kDeviceToHost);
  Result<RoutingPlan> plan = routing_plan_from_counts(counts.data(), tokens_, experts(), cfg_.top_k,
                                                      token_alignment(cfg_.recipe.recipe));
  PACKMOE_CHECK(plan.is_ok(), "routing plan of the router's own indices: " << plan.status().message());
  return std::move(plan).value();
}

float MoEBlock::aux_loss() const {
  PACKMOE_CHECK(cfg_.aux_loss_coef != 0.0f, "aux_loss: the aux loss is off (aux_loss_coef = 0)");
  PACKMOE_CHECK(has_plan_, "aux_loss before the first forward");
  const Tensor aux = Tensor::empty(*backend_, DType::kF32, {1});
  aux_stats_->loss(*backend_, aux.data_as<float>());
  float host = 0.0f;
  backend_->copy(&host, aux.data(), sizeof host, Backend::CopyKind::kDeviceToHost);
  return host;
}

void MoEBlock::share_aux_loss_stats(std::shared_ptr<AuxLossStats> stats) {
  PACKMOE_CHECK(cfg_.aux_loss_coef != 0.0f, "share_aux_loss_stats: the aux loss is off");
  PACKMOE_CHECK(stats && stats->counts.numel() == experts(),
                "share_aux_loss_stats: statistics of " << experts() << " experts needed");
  PACKMOE_CHECK(state_ == BlockState::kIdle, "share_aux_loss_stats only in state Idle");
  aux_stats_ = std::move(stats);
  aux_stats_shared_ = true;
}

}  // namespace packmoe
