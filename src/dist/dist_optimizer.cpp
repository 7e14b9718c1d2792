// DistOptimizer: construction (plan, buffer views, master shard), the step, the three parameter
// gather modes and the state save / load.
#include "dist/dist_optimizer.h"

#include <cmath>
#include <cstring>
#include <string>

#include "optim/grad_clip.h"

namespace packmoe {
namespace {

ShardPlan plan_for(const std::vector<DistParam>& params, int world, int64_t bucket_elems) {
  std::vector<ParamGeometry> g;
  for (const DistParam& d : params)
    g.push_back({d.param->experts(), d.param->n(), d.param->k(), d.param->shard_unit_rows()});
  Result<ShardPlan> plan = ShardPlan::make(std::move(g), world, bucket_elems);
  PACKMOE_CHECK(plan.is_ok(), plan.status().message());
  return std::move(plan).value();
}

}  // namespace

std::string_view gather_mode_name(GatherMode m) {
  switch (m) {
    case GatherMode::kBf16:
      return "bf16";
    case GatherMode::kLowp:
      return "lowp";
    case GatherMode::kReuseGradBuffer:
      return "reuse-grad-buffer";
  }
  return "?";
}

Result<GatherMode> parse_gather_mode(std::string_view s) {
  for (GatherMode m : {GatherMode::kBf16, GatherMode::kLowp, GatherMode::kReuseGradBuffer})
    if (s == gather_mode_name(m)) return m;
  return Status::error("unknown parameter gather mode '" + std::string(s) +
                       "' (bf16, lowp, reuse-grad-buffer)");
}

DistOptimizer::DistOptimizer(Communicator& comm, std::vector<DistParam> params,
                             const DistOptimizerConfig& cfg)
    : comm_(&comm),
      be_(&comm.backend()),
      cfg_(cfg),
      params_(std::move(params)),
      plan_(plan_for(params_, comm.size(), cfg.bucket_elems)),
      grads_(comm, plan_),
      pieces_(plan_.pieces(comm.rank())),
      master_(*be_, shard().size() * sizeof(float)),
      norm_(*be_, sizeof(double)) {
  for (size_t p = 0; p < params_.size(); ++p) {
    const GroupedParam& gp = *params_[p].param;
    PACKMOE_CHECK(&gp.backend() == be_, "param " << p
                                                 << " lives in another backend than the "
                                                    "communicator's buffers");
    PACKMOE_CHECK(gp.fp32_state() == Fp32State::kInitHeld,
                  "param " << p << " is already under an optimizer (its init is gone)");
  }
  be_->fill_zero(master_.get(), master_.size());

  // Every main_grad views its slot: E consecutive (N, K) groups, whichever the layout.
  for (int p = 0; p < plan_.params(); ++p) {
    GroupedParam& gp = *params_[p].param;
    const int64_t per_expert = gp.n() * gp.k();
    std::vector<void*> views;
    for (int64_t e = 0; e < gp.experts(); ++e)
      views.push_back(grads_.data() + plan_.slot(p).offset + e * per_expert);
    gp.bind_main_grad(views);
  }
  // The master shard from the params' FP32 inits; then only kFp32 params keep a full copy, as
  // the replica their layers read.
  float* master = static_cast<float*>(master_.get());
  for (const ShardPiece& piece : pieces_)
    params_[piece.param].param->copy_init(piece.begin, piece.count,
                                          master + (piece.offset - shard().begin));
  for (DistParam& d : params_) {
    if (d.form == WeightForm::kFp32)
      d.param->keep_fp32_replica();
    else
      d.param->release_init();
  }

  traffic_.param_elements = plan_.param_elements();
  traffic_.reduce_scatter_bytes = plan_.total() * static_cast<int64_t>(sizeof(float));
  bucket_params_.assign(plan_.buckets().size(), 0);
  for (int p = 0; p < plan_.params(); ++p) {
    size_t b = 0;
    while (plan_.buckets()[b].end <= plan_.slot(p).offset) ++b;  // buckets hold whole params
    bucket_of_.push_back(b);
    ++bucket_params_[b];
  }
  switch (cfg_.gather) {
    case GatherMode::kBf16:
    case GatherMode::kReuseGradBuffer:
      // Reuse: the image lies in the grad buffer's memory (4 bytes per element of which it takes
      // at most 2, at or below each element's own gradient), consumed by then.
      bf16_class_.emplace(make_class(bf16_ratio(), cfg_.gather == GatherMode::kBf16,
                                     cfg_.gather == GatherMode::kBf16 ? kBoundGatherImageAlign
                                                                      : kGatherImageAlign));
      traffic_.all_gather_bytes = bf16_class_->bytes;
      if (cfg_.gather == GatherMode::kBf16) build_amax_layout();  // AdamW takes it (apply)
      break;
    case GatherMode::kLowp:
      build_lowp_layout();
      break;
  }
  std::vector<std::pair<int64_t, int64_t>> fp32_ratio(params_.size(), {0, 1});
  bool any_fp32 = false;
  for (size_t p = 0; p < params_.size(); ++p)
    if (params_[p].form == WeightForm::kFp32) {
      fp32_ratio[p] = {static_cast<int64_t>(sizeof(float)), 1};
      any_fp32 = true;
    }
  if (any_fp32) {
    // On one rank the master is the whole param: the replicas view it, and no buffer is needed.
    GatherClass cls = make_class(fp32_ratio, comm.size() > 1, kGatherImageAlign);
    traffic_.fp32_bytes = cls.bytes;
    traffic_.all_gather_bytes += cls.bytes;
    if (comm.size() > 1) fp32_.emplace(std::move(cls));
  }
  stage();
  // With the BF16 gather, the image's slot of a BF16 param IS its primary: the gather lands in
  // place and no copy into the param follows (nor a second BF16 copy of the weights).
  if (cfg_.gather == GatherMode::kBf16)
    for (int p = 0; p < plan_.params(); ++p)
      if (params_[p].form != WeightForm::kFp32 && params_[p].param->keeps_bf16())
        params_[p].param->bind_bf16_primary(slot_views(
            *bf16_class_, static_cast<const uint8_t*>(bf16_class_->buffer->get()), p, 2));
  // Likewise a replica is its slot of the FP32 gather buffer (one rank: of the master).
  for (int p = 0; p < plan_.params(); ++p)
    if (params_[p].form == WeightForm::kFp32) {
      const GroupedParam& gp = *params_[p].param;
      std::vector<void*> views;
      for (int64_t e = 0; e < gp.experts(); ++e)
        views.push_back(const_cast<float*>(replica_source(p)) + e * gp.n() * gp.k());
      params_[p].param->bind_fp32_replica(views);
    }
  // The moments last: by now every init and every own BF16 copy that a bound slot replaced is
  // freed, so start-up never holds them together with the moments; and the device gets that
  // memory back first, or the moments (one block each) would be placed beside the freed inits
  // (one block per param), which the pool would keep reserved without ever reusing them whole.
  be_->release_unused_memory();
  for (std::optional<DeviceBuffer>* b : {&exp_avg_, &exp_avg_sq_}) {
    b->emplace(*be_, shard().size() * sizeof(float));
    be_->fill_zero((*b)->get(), (*b)->size());
  }
  grads_.advance(GradBufferState::kParamsStaged, "construction: masters staged for the gather");
}

float DistOptimizer::loss_scale(int64_t micro_batches) const {
  PACKMOE_CHECK(micro_batches >= 1, "loss_scale of " << micro_batches << " micro-batches");
  return 1.0f / static_cast<float>(micro_batches * comm_->size());
}

void DistOptimizer::prepare_forward() {
  if (grads_.state() == GradBufferState::kParamsStaged) gather_params();
  if (grads_.state() == GradBufferState::kParamsGathered) {
    if (cfg_.gather == GatherMode::kReuseGradBuffer) {  // the BF16 image was in the buffer
      grads_.fill_zero();
      grads_.advance(GradBufferState::kZeroed, "prepare_forward: buffer zeroed after the gather");
    } else {
      grads_.advance(GradBufferState::kStale, "prepare_forward: the gradients are written over");
    }
  }
  PACKMOE_CHECK(grads_.state() == GradBufferState::kZeroed ||
                    grads_.state() == GradBufferState::kStale ||
                    grads_.state() == GradBufferState::kAccumulating,
                "prepare_forward in grad buffer state " << grad_buffer_state_name(grads_.state()));
}

void DistOptimizer::prepare_backward(bool last_of_step) {
  const bool stale = grads_.state() == GradBufferState::kStale;
  grads_.advance(GradBufferState::kAccumulating,
                 "prepare_backward; a forward needs prepare_forward first");
  if (stale)
    for (DistParam& d : params_) d.param->expect_grad_overwrite();
  overlap_armed_ = last_of_step;
  if (last_of_step) {
    bucket_waiting_ = bucket_params_;
    param_ready_.assign(params_.size(), false);
  }
}

void DistOptimizer::grad_ready(int p) {
  if (!overlap_armed_) return;
  PACKMOE_CHECK(p >= 0 && p < plan_.params() && !param_ready_[p],
                "grad_ready(" << p << "): not a param, or reported twice in one backward");
  param_ready_[p] = true;
  const size_t b = bucket_of_[p];
  if (--bucket_waiting_[b] == 0) grads_.reduce_scatter_bucket(b);
}

DistStepResult DistOptimizer::step(double max_norm) {
  reduce_gradients();
  return apply(comm_->size() == 1 ? single_rank_grad_norm() : shard_grad_norm(), max_norm);
}

void DistOptimizer::reduce_gradients() {
  for (const DistParam& d : params_)
    PACKMOE_CHECK(d.param->grad_state() == GradState::kSettled,
                  "optimizer step with a delayed wgrad pending: its gradient would never reach "
                  "the update; run backward_dw first");
  for (size_t p = 0; p < params_.size(); ++p)
    PACKMOE_CHECK(params_[p].param->grad_write() == GradWrite::kAdd,
                  "optimizer step: the backward never wrote param " << p << "'s gradient, so its "
                  "slot still holds the step before's");
  overlap_armed_ = false;
  grads_.reduce_scatter();
}

void DistOptimizer::shard_squares_into_norm() {
  const FlatRange sh = shard();
  double* norm = static_cast<double*>(norm_.get());
  if (sh.size() > 0)
    check_op(ops::sum_squares(*be_, one_segment<const float>(grads_.data() + sh.begin, sh.size()),
                              norm),
             "sum_squares");
  else
    be_->fill_zero(norm, sizeof(double));
}

double DistOptimizer::norm_value() const {
  double sum = 0;
  const std::vector<uint8_t> bytes = norm_.download();
  std::memcpy(&sum, bytes.data(), sizeof(double));
  return sum;
}

double DistOptimizer::shard_sum_squares() {
  shard_squares_into_norm();
  return norm_value();
}

DistStepResult DistOptimizer::apply(double grad_norm, double max_norm) {
  const FlatRange sh = shard();
  const float* grads = grads_.data();
  DistStepResult r;
  r.grad_norm = grad_norm;
  if (!std::isfinite(r.grad_norm)) {
    grads_.fill_zero();
    grads_.advance(GradBufferState::kZeroed, "step skipped: non-finite grad norm");
    return r;
  }
  r.clip_scale = clip_coefficient(r.grad_norm, max_norm);
  ++steps_;
  const AdamWStepScalars decayed = adamw_param_scalars(cfg_.adamw, steps_, true, r.clip_scale);
  const AdamWStepScalars undecayed = adamw_param_scalars(cfg_.adamw, steps_, false, r.clip_scale);
  float* master = static_cast<float*>(master_.get());
  float* m = static_cast<float*>(exp_avg_->get());
  float* v = static_cast<float*>(exp_avg_sq_->get());
  // With the BF16 gather, AdamW writes the BF16 image of what it updates in the same pass (stage()
  // then has nothing left to cast for it).
  uint8_t* image = cfg_.gather == GatherMode::kBf16
                       ? static_cast<uint8_t*>(bf16_class_->buffer->get())
                       : nullptr;
  // ... and the per-expert amax of the NVFP4 params' image, which their quantizer then skips.
  float* amax = image && amax_count_ > 0 ? static_cast<float*>(amax_->get()) : nullptr;
  if (amax) be_->fill_zero(amax, amax_->size());
  for (const ShardPiece& piece : pieces_) {  // one adamw launch per parameter piece
    const int64_t at = piece.offset - sh.begin;
    AdamWArgs a;
    a.scalars = params_[piece.param].weight_decay ? decayed : undecayed;
    a.param = one_segment(master + at, piece.count);
    a.exp_avg = one_segment(m + at, piece.count);
    a.exp_avg_sq = one_segment(v + at, piece.count);
    a.grad = one_segment(grads + piece.offset, piece.count);
    if (image && params_[piece.param].form != WeightForm::kFp32)
      a.bf16 = one_segment(
          reinterpret_cast<uint16_t*>(image + class_position(*bf16_class_, piece.offset)),
          piece.count);
    if (amax && amax_offset_[piece.param] >= 0) {
      const GroupedParam& gp = *params_[piece.param].param;
      a.amax = amax + amax_offset_[piece.param];
      a.amax_span = gp.n() * gp.k();
      a.amax_first = piece.begin;
    }
    check_op(ops::adamw(*be_, a), "adamw");
  }
  if (amax && comm_->size() > 1) comm_->all_reduce(amax, amax, amax_count_, ReduceOp::kMax);
  stage(image != nullptr);
  image_amax_current_ = amax != nullptr;
  grads_.advance(GradBufferState::kParamsStaged, "step: update staged for the gather");
  r.applied = true;
  return r;
}

double DistOptimizer::shard_grad_norm() {
  shard_squares_into_norm();
  comm_->all_reduce(static_cast<double*>(norm_.get()), static_cast<double*>(norm_.get()), 1,
                    ReduceOp::kSum);
  return std::sqrt(norm_value());
}

double DistOptimizer::single_rank_grad_norm() const {
  std::vector<const GroupedStorage*> grads;
  for (const DistParam& d : params_) grads.push_back(&d.param->main_grad());
  return global_grad_norm(*be_, grads);
}

void DistOptimizer::stage_bf16_image(uint8_t* image) {
  const FlatRange sh = shard();
  const float* master = static_cast<const float*>(master_.get());
  for (const ShardPiece& piece : pieces_) {  // one cast per parameter piece
    if (params_[piece.param].form == WeightForm::kFp32) continue;
    auto* dst = reinterpret_cast<uint16_t*>(image + class_position(*bf16_class_, piece.offset));
    check_op(ops::cast_f32_to_bf16(*be_, one_segment(master + (piece.offset - sh.begin), piece.count),
                                   one_segment(dst, piece.count)),
             "master shard to bf16");
  }
}

void DistOptimizer::cast_shard_to_bf16(uint16_t* dst) {
  const int64_t n = shard().size();
  if (n == 0) return;
  check_op(
      ops::cast_f32_to_bf16(*be_, one_segment<const float>(static_cast<const float*>(master_.get()), n),
                            one_segment(dst, n)),
      "master shard to bf16");
}

std::vector<std::pair<int64_t, int64_t>> DistOptimizer::bf16_ratio() const {
  std::vector<std::pair<int64_t, int64_t>> ratio;
  for (const DistParam& d : params_)
    ratio.push_back(d.form == WeightForm::kFp32 ? std::pair<int64_t, int64_t>{0, 1}
                                                : std::pair<int64_t, int64_t>{2, 1});
  return ratio;
}

void DistOptimizer::stage(bool image_written) {
  const FlatRange sh = shard();
  image_amax_current_ = false;  // apply() sets it after the stage that its AdamW pass wrote
  switch (cfg_.gather) {
    case GatherMode::kBf16:
      if (!image_written) stage_bf16_image(static_cast<uint8_t*>(bf16_class_->buffer->get()));
      break;
    case GatherMode::kReuseGradBuffer:
      // The shard's F32 gradients were consumed by AdamW; element x's BF16 lands at or below
      // byte 2x.
      stage_bf16_image(reinterpret_cast<uint8_t*>(grads_.bf16_image()));
      break;
    case GatherMode::kLowp: {
      const auto* rows = static_cast<const uint16_t*>(shard_bf16_->get());
      cast_shard_to_bf16(static_cast<uint16_t*>(shard_bf16_->get()));
      float* amax = amax_count_ > 0 ? static_cast<float*>(amax_->get()) : nullptr;
      if (amax_count_ > 0) {  // NVFP4: every rank's rows are scaled with the expert's amax
        be_->fill_zero(amax, amax_->size());
        for (const ShardPiece& piece : pieces_) {
          const GroupedParam& gp = *params_[piece.param].param;
          if (amax_offset_[piece.param] < 0) continue;
          gp.rows_amax(rows + (piece.offset - sh.begin), piece.begin / gp.k(),
                       (piece.begin + piece.count) / gp.k(), amax + amax_offset_[piece.param]);
        }
        comm_->all_reduce(amax, amax, amax_count_, ReduceOp::kMax);
      }
      for (const ShardPiece& piece : pieces_) {
        if (params_[piece.param].form == WeightForm::kFp32) continue;  // made from the replica
        const GroupedParam& gp = *params_[piece.param].param;
        std::vector<void*> images;
        for (GatherClass& cls : lowp_)
          if (cls.offset[piece.param] >= 0)
            images.push_back(static_cast<uint8_t*>(cls.buffer->get()) + cls.offset[piece.param]);
        gp.quantize_rows(
            rows + (piece.offset - sh.begin), piece.begin / gp.k(),
            (piece.begin + piece.count) / gp.k(),
            amax_offset_[piece.param] >= 0 ? amax + amax_offset_[piece.param] : nullptr, images);
      }
      break;
    }
  }
  if (fp32_) {  // the replicas' shard pieces, as they are
    const float* master = static_cast<const float*>(master_.get());
    for (const ShardPiece& piece : pieces_)
      if (fp32_->offset[piece.param] >= 0)
        be_->copy(static_cast<uint8_t*>(fp32_->buffer->get()) + fp32_->offset[piece.param] +
                      piece.begin * static_cast<int64_t>(sizeof(float)),
                  master + (piece.offset - sh.begin), piece.count * sizeof(float),
                  Backend::CopyKind::kDeviceToDevice);
  }
  for (DistParam& d : params_) d.param->mark_primary_awaiting_gather();
}

void DistOptimizer::gather_params() {
  grads_.advance(GradBufferState::kParamsGathered, "parameter all-gather");
  const FlatRange sh = shard();
  if (fp32_) {
    uint8_t* buf = static_cast<uint8_t*>(fp32_->buffer->get());
    comm_->all_gatherv(buf + class_position(*fp32_, sh.begin), buf, fp32_->counts);
  }
  for (int p = 0; p < plan_.params(); ++p)
    if (params_[p].form == WeightForm::kFp32) {
      params_[p].param->write_fp32_replica(replica_source(p));  // its own views: no copy
      params_[p].param->write_primary_from_replica();
    }
  if (cfg_.gather == GatherMode::kLowp) {
    for (GatherClass& cls : lowp_) {
      uint8_t* buf = static_cast<uint8_t*>(cls.buffer->get());
      comm_->all_gatherv(buf + class_position(cls, sh.begin), buf, cls.counts);
    }
    const float* amax = amax_count_ > 0 ? static_cast<const float*>(amax_->get()) : nullptr;
    for (int p = 0; p < plan_.params(); ++p) {
      if (params_[p].form == WeightForm::kFp32) continue;
      std::vector<const void*> images;
      for (const GatherClass& cls : lowp_)
        if (cls.offset[p] >= 0)
          images.push_back(static_cast<const uint8_t*>(cls.buffer->get()) + cls.offset[p]);
      params_[p].param->write_primary_from_packed(
          images, amax_offset_[p] >= 0 ? amax + amax_offset_[p] : nullptr);
    }
  } else {
    uint8_t* image = cfg_.gather == GatherMode::kBf16
                         ? static_cast<uint8_t*>(bf16_class_->buffer->get())
                         : reinterpret_cast<uint8_t*>(grads_.bf16_image());
    comm_->all_gatherv(image + class_position(*bf16_class_, sh.begin), image, bf16_class_->counts);
    const float* amax = image_amax_current_ ? static_cast<const float*>(amax_->get()) : nullptr;
    for (int p = 0; p < plan_.params(); ++p)
      if (params_[p].form != WeightForm::kFp32)
        params_[p].param->write_primary_from_bf16(
            bf16_views(image, p), amax && amax_offset_[p] >= 0 ? amax + amax_offset_[p] : nullptr);
  }
}

const float* DistOptimizer::replica_source(int p) const {
  if (fp32_) return reinterpret_cast<const float*>(
      static_cast<const uint8_t*>(fp32_->buffer->get()) + fp32_->offset[p]);
  return static_cast<const float*>(master_.get()) + plan_.slot(p).offset;  // one rank: shard = all
}

std::vector<void*> DistOptimizer::slot_views(const GatherClass& cls, const uint8_t* base, int p,
                                             size_t elem_bytes) const {
  const GroupedParam& gp = *params_[p].param;
  const size_t per_expert = static_cast<size_t>(gp.n() * gp.k()) * elem_bytes;
  uint8_t* first = const_cast<uint8_t*>(base) + cls.offset[p];
  std::vector<void*> views;
  for (int64_t e = 0; e < gp.experts(); ++e) views.push_back(first + e * per_expert);
  return views;
}

GroupedStorage DistOptimizer::bf16_views(const uint8_t* image, int p) const {
  const GroupedParam& gp = *params_[p].param;
  return GroupedStorage::view(*be_, gp.layout(), slot_views(*bf16_class_, image, p, 2),
                              gp.n() * gp.k() * sizeof(uint16_t));
}

DistOptimizer::GatherClass DistOptimizer::make_class(
    const std::vector<std::pair<int64_t, int64_t>>& ratio, bool allocate, int64_t align) {
  GatherClass cls;
  static_cast<GatherSlots&>(cls) = gather_slots(plan_, ratio, align);
  for (int r = 0; r < plan_.world_size(); ++r)
    cls.counts.push_back(class_position(cls, plan_.shard(r).end) -
                         class_position(cls, plan_.shard(r).begin));
  if (allocate) {
    cls.buffer.emplace(*be_, cls.bytes);
    be_->fill_zero(cls.buffer->get(), cls.bytes);  // alignment gaps travel too: keep them defined
  }
  return cls;
}

void DistOptimizer::build_lowp_layout() {
  const int count = plan_.params();
  size_t classes = 0;
  for (int p = 0; p < count; ++p)
    if (params_[p].form != WeightForm::kFp32)  // only its replica travels
      classes = std::max(classes, params_[p].param->packed_components().size());
  for (size_t c = 0; c < classes; ++c) {  // component position c of every param
    std::vector<std::pair<int64_t, int64_t>> ratio(count, {0, 1});
    for (int p = 0; p < count; ++p) {
      if (params_[p].form == WeightForm::kFp32) continue;
      const std::vector<PackedComponent> comps = params_[p].param->packed_components();
      if (c < comps.size()) ratio[p] = {comps[c].bytes_num, comps[c].bytes_den};
    }
    lowp_.push_back(make_class(ratio, true, kGatherImageAlign));
    traffic_.all_gather_bytes += lowp_.back().bytes;
  }
  build_amax_layout();
  shard_bf16_.emplace(*be_, shard().size() * sizeof(uint16_t));
}

void DistOptimizer::build_amax_layout() {
  amax_offset_.assign(plan_.params(), -1);
  for (int p = 0; p < plan_.params(); ++p) {
    if (params_[p].form == WeightForm::kFp32 || !params_[p].param->needs_global_amax()) continue;
    amax_offset_[p] = amax_count_;
    amax_count_ += params_[p].param->experts();
  }
  if (amax_count_ > 0) amax_.emplace(*be_, amax_count_ * sizeof(float));
  traffic_.all_reduce_bytes = amax_count_ * static_cast<int64_t>(sizeof(float));
}

int64_t DistOptimizer::class_position(const GatherClass& cls, int64_t flat) const {
  for (int p : plan_.buffer_order()) {
    if (cls.offset[p] < 0) continue;  // no bytes in this class
    const ParamSlot& s = plan_.slot(p);
    if (flat <= s.offset) return cls.offset[p];
    if (flat < s.offset + s.numel)
      return cls.offset[p] + (flat - s.offset) * cls.num[p] / cls.den[p];
  }
  return cls.bytes;
}

// ---- state ----------------------------------------------------------------------------------

void DistOptimizer::check_between_steps(const char* what) const {
  PACKMOE_CHECK(grads_.state() == GradBufferState::kZeroed ||
                    grads_.state() == GradBufferState::kStale ||
                    grads_.state() == GradBufferState::kParamsStaged,
                what << " in the middle of a step (grad buffer "
                     << grad_buffer_state_name(grads_.state())
                     << "): the gradients accumulated so far are not part of the state; finish "
                        "the step first");
}

std::vector<float> DistOptimizer::master_shard() const {
  std::vector<float> out(shard().size());
  if (!out.empty())
    be_->copy(out.data(), master_.get(), master_.size(), Backend::CopyKind::kDeviceToHost);
  return out;
}

OptimizerShard DistOptimizer::shard_state() const {
  check_between_steps("shard_state");
  OptimizerShard s;
  s.world_size = comm_->size();
  s.rank = comm_->rank();
  s.steps = steps_;
  s.params = plan_.geometries();
  s.pieces = pieces_;
  const int64_t n = shard().size();
  std::vector<float> all[3];
  const DeviceBuffer* src[3] = {&master_, &*exp_avg_, &*exp_avg_sq_};
  std::vector<float>* dst[3] = {&s.master, &s.exp_avg, &s.exp_avg_sq};
  for (int i = 0; i < 3; ++i) {
    all[i].resize(n);
    if (n)
      be_->copy(all[i].data(), src[i]->get(), n * sizeof(float), Backend::CopyKind::kDeviceToHost);
    for (const ShardPiece& piece : pieces_) {
      const float* from = all[i].data() + (piece.offset - shard().begin);
      dst[i]->insert(dst[i]->end(), from, from + piece.count);
    }
  }
  return s;
}

FullOptimizerState DistOptimizer::gather_state() {
  check_between_steps("gather_state");
  FullOptimizerState full;
  full.steps = steps_;
  full.params = plan_.geometries();
  const FlatRange sh = shard();
  std::vector<int64_t> bytes = plan_.shard_sizes();
  for (int64_t& b : bytes) b *= static_cast<int64_t>(sizeof(float));
  DeviceBuffer flat(*be_, plan_.total() * sizeof(float));  // (total) F32
  float* f = static_cast<float*>(flat.get());
  std::vector<std::vector<float>>* out[3] = {&full.master, &full.exp_avg, &full.exp_avg_sq};
  const DeviceBuffer* src[3] = {&master_, &*exp_avg_, &*exp_avg_sq_};
  for (int i = 0; i < 3; ++i) {
    if (sh.size())
      be_->copy(f + sh.begin, src[i]->get(), src[i]->size(), Backend::CopyKind::kDeviceToDevice);
    comm_->all_gatherv(f + sh.begin, f, bytes);
    std::vector<float> host(plan_.total());
    be_->copy(host.data(), f, flat.size(), Backend::CopyKind::kDeviceToHost);
    for (int p = 0; p < plan_.params(); ++p) {
      const ParamSlot& s = plan_.slot(p);
      out[i]->emplace_back(host.begin() + s.offset, host.begin() + s.offset + s.numel);
    }
  }
  return full;
}

Status DistOptimizer::load_state(const FullOptimizerState& state) {
  check_between_steps("load_state");
  if (state.params != plan_.geometries())
    return Status::error(
        "optimizer state: its parameters (shapes or quantization blocks) differ "
        "from this model's");
  for (const auto* v : {&state.master, &state.exp_avg, &state.exp_avg_sq}) {
    if (v->size() != state.params.size())
      return Status::error("optimizer state: one tensor per parameter expected");
    for (size_t p = 0; p < v->size(); ++p)
      if (static_cast<int64_t>((*v)[p].size()) != state.params[p].numel())
        return Status::error("optimizer state: parameter " + std::to_string(p) + " has " +
                             std::to_string((*v)[p].size()) + " elements");
  }
  if (state.steps < 0) return Status::error("optimizer state: negative step count");
  const int64_t begin = shard().begin;
  DeviceBuffer* dst[3] = {&master_, &*exp_avg_, &*exp_avg_sq_};
  const std::vector<std::vector<float>>* src[3] = {&state.master, &state.exp_avg,
                                                   &state.exp_avg_sq};
  for (int i = 0; i < 3; ++i)
    for (const ShardPiece& piece : pieces_)
      be_->copy(static_cast<float*>(dst[i]->get()) + (piece.offset - begin),
                (*src[i])[piece.param].data() + piece.begin, piece.count * sizeof(float),
                Backend::CopyKind::kHostToDevice);
  steps_ = state.steps;
  stage();
  grads_.advance(GradBufferState::kParamsStaged, "load_state: loaded masters staged");
  return Status::ok();
}

}  // namespace packmoe
