// Trainer: one optimizer step = A micro-batches of forward + backward, grad norm, clip, AdamW;
// checkpoint snapshot / save / resume.
#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>

#include "nn/recipe.h"
#include "optim/grad_clip.h"
#include "train/rank_agreement.h"

namespace packmoe::train {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

AdamWConfig adamw_config(const TrainConfig& c) {
  return AdamWConfig{static_cast<float>(c.lr), static_cast<float>(c.beta1),
                     static_cast<float>(c.beta2), static_cast<float>(c.eps),
                     static_cast<float>(c.weight_decay)};
}

// Host (E, N, K) F32 bytes -> a moment's storage (any memory, any layout).
void upload_moment(const Tensor& host, GroupedStorage& moment) {
  PACKMOE_CHECK(host.nbytes() == moment.groups() * moment.bytes_per_group(),
                "moment of " << host.nbytes() << " bytes for a storage of "
                             << moment.groups() * moment.bytes_per_group());
  GroupedStorage staged(cpu_backend(), Layout::kSingle, moment.groups(), moment.bytes_per_group());
  std::memcpy(staged.packed(), host.data(), host.nbytes());
  moment.copy_from(staged);
}

Tensor host_tensor(const std::vector<float>& values, const Shape& shape) {
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, shape);
  PACKMOE_CHECK(t.nbytes() == values.size() * sizeof(float),
                values.size() << " values for shape " << shape_string(shape));
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

std::vector<float> host_floats(const Tensor& t) {
  std::vector<float> out(t.nbytes() / sizeof(float));
  std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

Tensor download_f32(const GroupedStorage& s, const Shape& shape) {
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, shape);
  const std::vector<uint8_t> bytes = s.download();
  PACKMOE_CHECK(bytes.size() == t.nbytes(),
                "storage of " << bytes.size() << " bytes for shape " << shape_string(shape));
  std::memcpy(t.data(), bytes.data(), bytes.size());
  return t;
}

// NVFP4: every linear's gradient SR offset for micro-batch `index` of step `step` (the other
// recipes draw nothing; validate() and enable_data_parallel keep NVFP4 runs inside its range).
void set_sr_offset(Model& model, int64_t step, int64_t index) {
  if (model.precision().recipe.recipe == Recipe::kNvfp4)
    model.set_grad_sr_offset(nvfp4_grad_sr_offset(step, index));
}

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::create(Backend& backend, const ModelConfig& model,
                                                 const TrainConfig& config, TrainData data,
                                                 const ModelWeights* init) {
  PACKMOE_RETURN_IF_ERROR(train::validate(model));
  PACKMOE_RETURN_IF_ERROR(validate(config, model));
  if (init) PACKMOE_RETURN_IF_ERROR(validate_model_weights(model, *init));
  Result<BatchSampler> sampler =
      BatchSampler::create(std::move(data.train), model.vocab_size, config.micro_batch_size,
                           config.seq_len, data.train_stream);
  if (!sampler) return sampler.status();
  std::vector<Batch> validation;
  if (config.eval_interval > 0) {
    Result<std::vector<Batch>> fixed =
        fixed_batches(std::move(data.validation), model.vocab_size, config.micro_batch_size,
                      config.seq_len, config.eval_batches, data.validation_stream);
    if (!fixed) return fixed.status();
    validation = std::move(fixed.value());
  }
  ModelPrecision precision = config.precision;
  precision.recipe.sr_seed = config.seed;
  auto m = std::make_unique<Model>(backend, model, precision,
                                   init ? *init : random_model_weights(model, config.seed));
  return std::unique_ptr<Trainer>(new Trainer(std::move(m), config, std::move(sampler.value()),
                                              std::move(validation)));
}

Result<std::unique_ptr<Trainer>> Trainer::resume(Backend& backend, const TrainerCheckpoint& c,
                                                 const TrainConfig& config, TrainData data) {
  Result<std::unique_ptr<Trainer>> t =
      create(backend, c.model, config, std::move(data), &c.masters);
  if (!t) return t.status();
  PACKMOE_RETURN_IF_ERROR(t.value()->check_resumable(c));
  t.value()->restore_state(c);
  return t;
}

Trainer::Trainer(std::unique_ptr<Model> model, const TrainConfig& config,
                 BatchSampler train_sampler, std::vector<Batch> validation)
    : model_(std::move(model)),
      config_(config),
      schedule_(lr_schedule(config)),
      optimizer_(adamw_config(config)),
      train_sampler_(std::move(train_sampler)),
      validation_(std::move(validation)) {
  attach_optimizer();
}

void Trainer::attach_optimizer() {
  for (const NamedParam& p : model_->params()) {
    optimizer_.add(*p.param, p.weight_decay);
    grads_.push_back(&p.param->main_grad());
  }
}

TrainerCheckpoint Trainer::snapshot() const {
  TrainerCheckpoint c;
  c.step = step_;
  c.model = model_->config();
  c.config = config_;
  c.sampler = train_sampler_.next_row_position();
  c.train_stream_tokens = train_sampler_.stream_tokens();
  const std::vector<NamedParam>& params = model_->params();
  if (dist_) {
    const FullOptimizerState full = dist_->gather_state();
    PACKMOE_CHECK(full.master.size() == params.size(), "optimizer out of step with the model");
    const std::vector<ParamSpec> specs = model_param_specs(c.model);
    for (size_t i = 0; i < params.size(); ++i) {
      PACKMOE_CHECK(specs[i].name == params[i].name, "parameters out of model_param_specs order");
      c.masters.emplace(params[i].name, host_tensor(full.master[i], specs[i].shape));
      c.moments.emplace(exp_avg_name(params[i].name), host_tensor(full.exp_avg[i], specs[i].shape));
      c.moments.emplace(exp_avg_sq_name(params[i].name),
                        host_tensor(full.exp_avg_sq[i], specs[i].shape));
    }
    c.optimizer_steps = full.steps;
    c.world_size = comm_->size();
    c.shard_plan = saved_shard_plan(dist_->plan());
    return c;
  }
  c.masters = model_->master_weights();
  const std::vector<AdamW::ParamState>& states = optimizer_.states();
  PACKMOE_CHECK(params.size() == states.size(), "optimizer out of step with the model");
  for (size_t i = 0; i < params.size(); ++i) {
    const Shape& shape = c.masters.at(params[i].name).shape();
    c.moments.emplace(exp_avg_name(params[i].name), download_f32(states[i].exp_avg, shape));
    c.moments.emplace(exp_avg_sq_name(params[i].name), download_f32(states[i].exp_avg_sq, shape));
  }
  c.optimizer_steps = optimizer_.steps();
  return c;
}

Result<io::CheckpointWriter::Committed> Trainer::save_checkpoint(const std::string& root,
                                                                 int keep_last, bool save_primary) {
  if (dist_) return save_checkpoint_dist(root, keep_last, save_primary);
  Result<io::CheckpointWriter> writer = io::CheckpointWriter::begin(root, step_, keep_last);
  if (!writer) return writer.status();
  io::CheckpointWriter& w = writer.value();
  PACKMOE_RETURN_IF_ERROR(write_trainer_checkpoint(w.dir(), snapshot()));
  if (save_primary) PACKMOE_RETURN_IF_ERROR(write_primary_weights(w.path(kPrimaryFile), *model_));
  return w.commit();
}

Result<io::CheckpointWriter::Committed> Trainer::save_checkpoint_dist(const std::string& root,
                                                                      int keep_last,
                                                                      bool save_primary) {
  Communicator& comm = *comm_;
  const bool rank0 = comm.rank() == 0;
  // Every failure is agreed before the next collective, so no rank waits for one that gave up;
  // rank 0's writer removes the temporary directory on any error (after every rank stopped
  // writing into it).
  std::optional<io::CheckpointWriter> writer;
  Status status;
  if (rank0) {
    Result<io::CheckpointWriter> w = io::CheckpointWriter::begin(root, step_, keep_last);
    if (w)
      writer.emplace(std::move(w.value()));
    else
      status = w.status();
  }
  PACKMOE_RETURN_IF_ERROR(agree_on_status(comm, status));
  const std::string dir = broadcast_string(comm, rank0 ? writer->dir() : std::string(), 0);
  status = write_optimizer_shard(dir, dist_->shard_state());
  const TrainerCheckpoint c = snapshot();
  if (save_primary) dist_->prepare_forward();  // the primaries of the current masters
  if (rank0 && status.is_ok()) status = write_trainer_checkpoint(dir, c);
  if (rank0 && status.is_ok() && save_primary)
    status = write_primary_weights(writer->path(kPrimaryFile), *model_);
  PACKMOE_RETURN_IF_ERROR(agree_on_status(comm, status));
  std::optional<Result<io::CheckpointWriter::Committed>> committed;
  if (rank0) committed.emplace(writer->commit());
  PACKMOE_RETURN_IF_ERROR(agree_on_status(comm, committed ? committed->status() : Status::ok()));
  if (committed) return std::move(*committed);
  io::CheckpointWriter::Committed elsewhere;
  elsewhere.info.step = step_;
  elsewhere.info.dir = (std::filesystem::path(root) / io::checkpoint_dir_name(step_)).string();
  return elsewhere;
}

Status Trainer::check_resumable(const TrainerCheckpoint& c) const {
  const std::string where = c.dir.empty() ? std::string("the checkpoint") : c.dir;
  PACKMOE_RETURN_IF_ERROR(check_same_model(model_->config(), c.model, where + "/" + kConfigFile));
  if (c.train_stream_tokens != train_sampler_.stream_tokens())
    return Status::error(where + ": its training stream had " +
                         std::to_string(c.train_stream_tokens) + " tokens, this run's has " +
                         std::to_string(train_sampler_.stream_tokens()) +
                         ": resume on the data it was trained on");
  const Status position = train_sampler_.check_position(c.sampler);
  if (!position) return Status::error(where + ": " + position.message());
  return Status::ok();
}

void Trainer::restore_state(const TrainerCheckpoint& c) {
  const std::vector<NamedParam>& params = model_->params();
  if (dist_) {
    // The full state in this optimizer's parameter order and plan; load_state keeps this rank's
    // part and stages the masters for the next forward's gather.
    FullOptimizerState full;
    full.steps = c.optimizer_steps;
    full.params = dist_->plan().geometries();
    for (const NamedParam& p : params) {
      full.master.push_back(host_floats(c.masters.at(p.name)));
      full.exp_avg.push_back(host_floats(c.moments.at(exp_avg_name(p.name))));
      full.exp_avg_sq.push_back(host_floats(c.moments.at(exp_avg_sq_name(p.name))));
    }
    const Status loaded = dist_->load_state(full);
    PACKMOE_CHECK(loaded.is_ok(), "restore_state after check_resumable: " << loaded.message());
  } else {
    std::vector<AdamW::ParamState>& states = optimizer_.states();
    for (size_t i = 0; i < params.size(); ++i) {
      upload_moment(c.moments.at(exp_avg_name(params[i].name)), states[i].exp_avg);
      upload_moment(c.moments.at(exp_avg_sq_name(params[i].name)), states[i].exp_avg_sq);
    }
    optimizer_.set_steps(c.optimizer_steps);
  }
  const Status position = train_sampler_.set_position(c.sampler);
  PACKMOE_CHECK(position.is_ok(), "restore_state after check_resumable: " << position.message());
  step_ = c.step;
}

Status Trainer::load_checkpoint(const std::string& dir) {
  Result<TrainerCheckpoint> c = read_trainer_checkpoint(dir);
  Status read = c ? Status::ok() : c.status();
  if (dist_) read = agree_on_status(*comm_, read);
  PACKMOE_RETURN_IF_ERROR(read);
  return load_checkpoint(c.value());
}

Status Trainer::load_checkpoint(const TrainerCheckpoint& c) {
  Status resumable = check_resumable(c);
  if (dist_) resumable = agree_on_status(*comm_, resumable);
  PACKMOE_RETURN_IF_ERROR(resumable);
  // Every check passed, nothing below can fail.
  if (dist_) {
    restore_state(c);
    return Status::ok();
  }
  // The old model goes first, so that only one is ever in memory.
  Backend& backend = model_->backend();
  const ModelConfig model_config = model_->config();
  const ModelPrecision precision = model_->precision();
  grads_.clear();
  optimizer_ = AdamW(adamw_config(config_));
  model_.reset();
  model_ = std::make_unique<Model>(backend, model_config, precision, c.masters);
  attach_optimizer();
  restore_state(c);
  return Status::ok();
}

bool Trainer::on_cuda() const { return model_->backend().name().rfind("cuda", 0) == 0; }

Status Trainer::enable_data_parallel(Communicator& comm, GatherMode mode, int64_t bucket_elems) {
  if (dist_) return Status::error("data parallelism is already enabled");
  if (step_ != 0) return Status::error("data parallelism must be enabled before the first step");
  if (&comm.backend() != &model_->backend())
    return Status::error("the communicator runs on another backend than the model");
  if (model_->precision().recipe.recipe == Recipe::kNvfp4 &&
      config_.grad_accum_steps * comm.size() > (int64_t{1} << kSrIndexBits))
    return Status::error("NVFP4: grad_accum_steps x ranks = " +
                         std::to_string(config_.grad_accum_steps * comm.size()) +
                         " micro-batches per step; its stochastic rounding numbers at most " +
                         std::to_string(int64_t{1} << kSrIndexBits));
  // The layers that read their FP32 weight itself (every norm, the embedding table) get full
  // FP32 replicas; the rest is gathered in `mode`.
  std::vector<DistParam> params;
  for (const NamedParam& p : model_->params())
    params.push_back(
        {p.param, p.weight_decay, p.reads_fp32 ? WeightForm::kFp32 : WeightForm::kPrimary});
  grads_.clear();
  optimizer_ = AdamW(adamw_config(config_));  // its moments are dropped: DistOptimizer has its own
  DistOptimizerConfig dc;
  dc.adamw = adamw_config(config_);
  dc.gather = mode;
  dc.bucket_elems = bucket_elems;
  dist_ = std::make_unique<DistOptimizer>(comm, std::move(params), dc);
  comm_ = &comm;
  loss_sums_ = std::make_unique<DeviceBuffer>(comm.backend(), 2 * sizeof(double));
  // params() order is the DistOptimizer's: each bucket's reduce-scatter starts in the step's last
  // backward as soon as the bucket's gradients are final.
  model_->set_grad_ready_hook(
      [dist = dist_.get()](size_t p) { dist->grad_ready(static_cast<int>(p)); });
  return Status::ok();
}

Result<StepResult> Trainer::train_step_dist() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t A = config_.grad_accum_steps;
  const int world = comm_->size(), rank = comm_->rank();
  StepResult r;
  r.step = step_ + 1;
  double sums[2] = {0, 0};  // lm, aux loss over this rank's micro-batches
  for (int64_t micro = 0; micro < A; ++micro) {
    Batch batch;
    for (int w = 0; w < world; ++w) {  // micro-batch `rank` of every `world` consecutive ones
      Batch b = train_sampler_.next();
      if (w == rank) batch = std::move(b);
    }
    set_sr_offset(*model_, r.step, micro * world + rank);
    dist_->prepare_forward();
    Result<ForwardLosses> losses = model_->forward(batch);
    if (!losses) return losses.status();
    dist_->prepare_backward(/*last_of_step=*/micro == A - 1);
    model_->backward(dist_->loss_scale(A));
    sums[0] += losses.value().lm_loss;
    sums[1] += losses.value().aux_loss;
    r.tokens += batch.batch * batch.seq * world;
  }
  // Rank-ordered F64 sum (MPI; NCCL with 2 ranks is one rounding, the same): with A = 1 the bits
  // of one process accumulating every rank's loss. In the communicator's memory (NCCL: device).
  loss_sums_->upload({reinterpret_cast<const uint8_t*>(sums), sizeof sums});
  double* dev_sums = static_cast<double*>(loss_sums_->get());
  comm_->all_reduce(dev_sums, dev_sums, 2, ReduceOp::kSum);
  double global[2] = {0, 0};
  std::memcpy(global, loss_sums_->download().data(), sizeof global);
  const double n = static_cast<double>(A) * static_cast<double>(world);
  r.loss = global[0] / n;
  r.aux_loss = global[1] / n;
  r.lr = schedule_.at(r.step);
  dist_->set_lr(static_cast<float>(r.lr));
  const DistStepResult d = dist_->step(config_.grad_clip);
  r.grad_norm = d.grad_norm;
  if (!std::isfinite(r.loss) || !d.applied) {
    std::ostringstream e;
    e << "step " << r.step << ": non-finite loss " << r.loss << " or grad norm " << r.grad_norm
      << "; nothing was updated (try a lower lr)";
    return Status::error(e.str());
  }
  model_->backend().synchronize();
  step_ = r.step;
  r.seconds = seconds_since(start);
  return r;
}

Result<StepResult> Trainer::train_step() {
  if (dist_) return train_step_dist();
  const auto start = std::chrono::steady_clock::now();
  const int64_t A = config_.grad_accum_steps;
  const float loss_scale = 1.0f / static_cast<float>(A);
  StepResult r;
  r.step = step_ + 1;
  model_->zero_grad();
  double loss_sum = 0, aux_sum = 0;
  for (int64_t micro = 0; micro < A; ++micro) {
    const Batch batch = train_sampler_.next();
    set_sr_offset(*model_, r.step, micro);
    Result<ForwardLosses> losses = model_->forward(batch);
    if (!losses) return losses.status();
    model_->backward(loss_scale);
    loss_sum += losses.value().lm_loss;
    aux_sum += losses.value().aux_loss;
    r.tokens += batch.batch * batch.seq;
  }
  r.loss = loss_sum / static_cast<double>(A);
  r.aux_loss = aux_sum / static_cast<double>(A);
  r.grad_norm = global_grad_norm(model_->backend(), grads_);
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
    std::ostringstream e;
    e << "step " << r.step << ": non-finite loss " << r.loss << " or grad norm " << r.grad_norm
      << "; nothing was updated (try a lower lr)";
    return Status::error(e.str());
  }
  r.lr = schedule_.at(r.step);
  optimizer_.set_lr(static_cast<float>(r.lr));
  optimizer_.step(clip_coefficient(r.grad_norm, config_.grad_clip));
  model_->backend().synchronize();
  step_ = r.step;
  r.seconds = seconds_since(start);
  return r;
}

Result<EvalResult> Trainer::evaluate() {
  PACKMOE_CHECK(!validation_.empty(), "evaluate() without a validation set (eval_interval = 0)");
  const auto start = std::chrono::steady_clock::now();
  if (dist_) dist_->prepare_forward();  // every rank holds all weights: each evaluates it all
  EvalResult r;
  double loss_sum = 0;
  for (const Batch& batch : validation_) {
    Result<ForwardLosses> losses = model_->forward(batch);
    if (!losses) return losses.status();
    loss_sum += losses.value().lm_loss;
    r.tokens += batch.batch * batch.seq;
  }
  r.loss = loss_sum / static_cast<double>(validation_.size());
  r.seconds = seconds_since(start);
  return r;
}

}  // namespace packmoe::train
