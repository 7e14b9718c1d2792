// Trainer: one optimizer step = A micro-batches of forward + backward on every rank, the
// optimizer's reduce-scatter, grad norm, clip and AdamW; checkpoint snapshot / save / resume.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>

#include "dist/ep_token_dispatcher.h"
#include "dist/expert_layout.h"
#include "dist/single_rank_communicator.h"
#include "nn/decoder_layer.h"
#include "nn/moe_block.h"
#include "nn/recipe.h"
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

// NVFP4: every linear's gradient SR offset for micro-batch `index` of step `step` (the other
// recipes draw nothing; validate() and Trainer::create keep NVFP4 runs inside its range).
void set_sr_offset(Model& model, int64_t step, int64_t index) {
  if (model.precision().recipe.recipe == Recipe::kNvfp4)
    model.set_grad_sr_offset(nvfp4_grad_sr_offset(step, index));
}

// Targets of a micro-batch that the loss counts (not kIgnoredTarget).
int64_t target_count(const Batch& b) {
  return static_cast<int64_t>(b.targets.size()) -
         std::count(b.targets.begin(), b.targets.end(), kIgnoredTarget);
}

}  // namespace

std::vector<DistParam> optimizer_params(const Model& model) {
  std::vector<DistParam> params;
  for (const NamedParam& p : model.params())
    params.push_back(
        {p.param, p.weight_decay, p.reads_fp32 ? WeightForm::kFp32 : WeightForm::kPrimary});
  return params;
}

Result<ExpertLayout> check_job_layout(const ModelConfig& model, const TrainConfig& config,
                                      int64_t world) {
  if (config.precision.recipe.recipe == Recipe::kNvfp4 &&
      config.grad_accum_steps * world > (int64_t{1} << kSrIndexBits))
    return Status::error("NVFP4: grad_accum_steps x ranks = " +
                         std::to_string(config.grad_accum_steps * world) +
                         " micro-batches per step; its stochastic rounding numbers at most " +
                         std::to_string(int64_t{1} << kSrIndexBits));
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) moe_layers += model.is_moe_layer(i);
  return make_expert_layout(static_cast<int>(world), static_cast<int>(config.expert_parallel),
                            model.num_experts, moe_layers);
}

Result<std::unique_ptr<Trainer>> Trainer::create(Backend& backend, const ModelConfig& model,
                                                 const TrainConfig& config, TrainData data,
                                                 const ModelWeights* init,
                                                 const TrainerParallelism& parallel) {
  PACKMOE_RETURN_IF_ERROR(train::validate(model));
  PACKMOE_RETURN_IF_ERROR(validate(config, model));
  if (init) PACKMOE_RETURN_IF_ERROR(validate_model_weights(model, *init));
  if (parallel.comm && &parallel.comm->backend() != &backend)
    return Status::error("the communicator runs on another backend than the model");
  const int64_t world = parallel.comm ? parallel.comm->size() : 1;
  Result<ExpertLayout> layout = check_job_layout(model, config, world);
  if (!layout) return layout.status();
  ExpertSlice experts;
  if (config.expert_parallel > 1) {
    experts.first = layout.value().first_expert(parallel.comm->rank());
    experts.count = layout.value().local_experts();
  }
  for (StreamOptions* stream : {&data.train_stream, &data.validation_stream}) {
    stream->shuffle = config.shuffle;
    stream->seed = config.seed;
  }
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
  StartupTimes times;
  auto start = std::chrono::steady_clock::now();
  // Each phase ends with one synchronization, so its time is its own (device work included).
  auto phase_done = [&](double& seconds) {
    backend.synchronize();
    seconds = seconds_since(start);
    start = std::chrono::steady_clock::now();
  };
  std::unique_ptr<Model> m;
  if (init) {
    m = std::make_unique<Model>(backend, model, precision, *init, experts);
  } else {
    // The random init is made where the model lives (on CUDA: on the device, no host copy) and
    // freed once the layers hold their copies.
    const ModelWeights random = random_model_weights(backend, model, config.seed);
    phase_done(times.weights);
    m = std::make_unique<Model>(backend, model, precision, random, experts);
  }
  m->set_recompute(config.recompute);
  phase_done(times.model);
  std::unique_ptr<Trainer> t(new Trainer(std::move(m), config, std::move(sampler.value()),
                                         std::move(validation), parallel));
  phase_done(times.optimizer);
  t->startup_ = times;
  return t;
}

Result<std::unique_ptr<Trainer>> Trainer::resume(Backend& backend, const TrainerCheckpoint& c,
                                                 const TrainConfig& config, TrainData data,
                                                 const TrainerParallelism& parallel) {
  Result<std::unique_ptr<Trainer>> t =
      create(backend, c.model, config, std::move(data), &c.masters, parallel);
  if (!t) return t.status();
  const auto start = std::chrono::steady_clock::now();
  PACKMOE_RETURN_IF_ERROR(t.value()->load_checkpoint(c));
  backend.synchronize();
  t.value()->startup_.state = seconds_since(start);
  return t;
}

Trainer::Trainer(std::unique_ptr<Model> model, const TrainConfig& config,
                 BatchSampler train_sampler, std::vector<Batch> validation,
                 const TrainerParallelism& parallel)
    : own_comm_(parallel.comm ? nullptr : make_single_rank_communicator(model->backend())),
      comm_(parallel.comm ? parallel.comm : own_comm_.get()),
      model_(std::move(model)),
      config_(config),
      schedule_(lr_schedule(config)),
      train_sampler_(std::move(train_sampler)),
      validation_(std::move(validation)),
      loss_sums_(comm_->backend(), 2 * sizeof(double)) {
  DistOptimizerConfig dc;
  dc.adamw = adamw_config(config_);
  dc.gather = config_.gather_mode;
  dc.bucket_elems = parallel.bucket_elems;
  std::vector<bool> expert;
  for (const NamedParam& p : model_->params()) expert.push_back(p.expert);
  if (config_.expert_parallel > 1) {
    // make_expert_layout checked it in create(): EP divides the ranks and the experts.
    const ExpertLayout layout{comm_->size(), static_cast<int>(config_.expert_parallel),
                              model_->config().num_experts};
    ep_comm_ = comm_->split(layout.ep_group(comm_->rank()));
    edp_comm_ = comm_->split(layout.ep_rank(comm_->rank()));
    for (int64_t i = 0; i < model_->config().num_hidden_layers; ++i)
      if (MoEBlock* moe = model_->layer(i).moe())
        moe->set_token_dispatcher(
            std::make_unique<EpTokenDispatcher>(*ep_comm_, model_->config().num_experts,
                                                config_.dispatch_dtype));
  }
  optimizer_ = std::make_unique<ParallelOptimizer>(*comm_, ep_comm_.get(), edp_comm_.get(),
                                                   optimizer_params(*model_), expert, dc);
  // params() order is the optimizer's: each bucket's reduce-scatter starts in the step's last
  // backward as soon as the bucket's gradients are final.
  model_->set_grad_ready_hook(
      [opt = optimizer_.get()](size_t p) { opt->grad_ready(static_cast<int>(p)); });
}

TrainerCheckpoint Trainer::snapshot() const {
  TrainerCheckpoint c;
  c.step = step_;
  c.model = model_->config();
  c.config = config_;
  c.sampler = train_sampler_.state();
  c.train_sources = train_sampler_.shapes();
  const std::vector<NamedParam>& params = model_->params();
  const FullOptimizerState full = optimizer_->gather_state();
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
  // One rank keeps the single-process format (the moments in optimizer.safetensors); so does
  // expert parallelism, whose state is gathered whole (per-expert names, every layout resumes
  // it): rank 0 writes it all.
  c.world_size = sharded_save() ? comm_->size() : 1;
  if (sharded_save()) c.shard_plan = saved_shard_plan(optimizer().plan());
  return c;
}

Result<io::CheckpointWriter::Committed> Trainer::save_checkpoint(const std::string& root,
                                                                 int keep_last, bool save_primary) {
  if (save_primary && optimizer_->expert_parallel())
    return Status::error("primary weights of an expert-parallel run: each rank holds only its "
                         "experts'");
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
  if (sharded_save()) status = write_optimizer_shard(dir, optimizer().shard_state());
  const TrainerCheckpoint c = snapshot();
  if (save_primary) optimizer_->prepare_forward();  // the primaries of the current masters
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
  const std::vector<SourceShape> here = train_sampler_.shapes();
  if (c.train_sources.size() != here.size())
    return Status::error(where + ": it was trained on " + std::to_string(c.train_sources.size()) +
                         " data source(s), this run has " + std::to_string(here.size()) +
                         ": resume on the data it was trained on");
  for (size_t d = 0; d < here.size(); ++d)
    if (!(c.train_sources[d] == here[d]))
      return Status::error(where + ": its training source " + std::to_string(d) + " had " +
                           std::to_string(c.train_sources[d].tokens) + " tokens (" +
                           std::to_string(c.train_sources[d].windows) + " samples), this run's has " +
                           std::to_string(here[d].tokens) + " (" + std::to_string(here[d].windows) +
                           "): resume on the data (and --valid-fraction, --seq-len) it was trained on");
  const Status position = train_sampler_.check_state(c.sampler);
  if (!position) return Status::error(where + ": " + position.message());
  return Status::ok();
}

void Trainer::restore_state(const TrainerCheckpoint& c) {
  // The full state in this optimizer's parameter order and plan; load_state keeps this rank's
  // part and stages the masters for the next forward's gather.
  FullOptimizerState full;
  full.steps = c.optimizer_steps;
  full.params = optimizer_->geometries();
  for (const NamedParam& p : model_->params()) {
    full.master.push_back(host_floats(c.masters.at(p.name)));
    full.exp_avg.push_back(host_floats(c.moments.at(exp_avg_name(p.name))));
    full.exp_avg_sq.push_back(host_floats(c.moments.at(exp_avg_sq_name(p.name))));
  }
  const Status loaded = optimizer_->load_state(full);
  PACKMOE_CHECK(loaded.is_ok(), "restore_state after check_resumable: " << loaded.message());
  const Status position = train_sampler_.set_state(c.sampler);
  PACKMOE_CHECK(position.is_ok(), "restore_state after check_resumable: " << position.message());
  step_ = c.step;
}

Status Trainer::load_checkpoint(const std::string& dir) {
  Result<TrainerCheckpoint> c = read_trainer_checkpoint(dir);
  PACKMOE_RETURN_IF_ERROR(agree_on_status(*comm_, c ? Status::ok() : c.status()));
  return load_checkpoint(c.value());
}

Status Trainer::load_checkpoint(const TrainerCheckpoint& c) {
  PACKMOE_RETURN_IF_ERROR(agree_on_status(*comm_, check_resumable(c)));
  restore_state(c);  // every check passed, nothing here can fail
  return Status::ok();
}

bool Trainer::on_cuda() const { return model_->backend().name().rfind("cuda", 0) == 0; }

Result<StepResult> Trainer::train_step() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t A = config_.grad_accum_steps;
  const int world = comm_->size(), rank = comm_->rank();
  StepResult r;
  r.step = step_ + 1;
  // Micro-batch `rank` of every `world` consecutive ones. Every rank draws all of the step's, so
  // each knows the step's targets (those not ignored) without a collective: the lm loss is the
  // mean over all of them, each micro-batch weighted by its share (SFT masks vary it).
  std::vector<Batch> batches;    // (A) this rank's
  std::vector<int64_t> targets;  // (A) their targets
  int64_t step_targets = 0;
  for (int64_t micro = 0; micro < A; ++micro)
    for (int w = 0; w < world; ++w) {
      Batch b = train_sampler_.next();
      const int64_t n = target_count(b);
      step_targets += n;
      if (w == rank) {
        batches.push_back(std::move(b));
        targets.push_back(n);
      }
    }
  if (step_targets == 0)
    return Status::error("step " + std::to_string(r.step) +
                         ": no row of the step has a target (every token's loss is masked)");
  std::vector<QueuedLosses> queued;  // this rank's micro-batches', read once after the last
  for (int64_t micro = 0; micro < A; ++micro) {
    const Batch& batch = batches[static_cast<size_t>(micro)];
    const double share = static_cast<double>(targets[static_cast<size_t>(micro)]);
    set_sr_offset(*model_, r.step, micro * world + rank);
    optimizer_->prepare_forward();
    // Before the forward: the training forward already adds the LM head's gradient.
    optimizer_->prepare_backward(/*last_of_step=*/micro == A - 1);
    Result<QueuedLosses> losses = model_->queue_forward(
        batch, static_cast<float>(share / static_cast<double>(step_targets)),
        optimizer_->loss_scale(A));
    if (!losses) return losses.status();
    queued.push_back(losses.value());
    model_->backward();
    r.tokens += batch.batch * batch.seq * world;
  }
  // lm loss x targets, aux loss over this rank's micro-batches, in micro-batch order
  double sums[2] = {0, 0};
  const std::vector<ForwardLosses> losses = read_losses(model_->backend(), queued);
  for (size_t i = 0; i < losses.size(); ++i) {
    sums[0] += static_cast<double>(losses[i].lm_loss) * static_cast<double>(targets[i]);
    sums[1] += losses[i].aux_loss;
  }
  // Rank-ordered F64 sum (MPI; NCCL with 2 ranks is one rounding, the same): with A = 1 the bits
  // of one process accumulating every rank's loss. In the communicator's memory (NCCL: device).
  loss_sums_.upload({reinterpret_cast<const uint8_t*>(sums), sizeof sums});
  double* dev_sums = static_cast<double*>(loss_sums_.get());
  comm_->all_reduce(dev_sums, dev_sums, 2, ReduceOp::kSum);
  double global[2] = {0, 0};
  std::memcpy(global, loss_sums_.download().data(), sizeof global);
  const double n = static_cast<double>(A) * static_cast<double>(world);
  r.loss = global[0] / static_cast<double>(step_targets);
  r.aux_loss = global[1] / n;
  r.lr = schedule_.at(r.step);
  // The global loss is the same on every rank, so all of them refuse the step together.
  DistStepResult d;
  if (std::isfinite(r.loss)) {
    optimizer_->set_lr(static_cast<float>(r.lr));
    d = optimizer_->step(config_.grad_clip);
    r.grad_norm = d.grad_norm;
  }
  if (!d.applied) {
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

Result<EvalResult> Trainer::evaluate() {
  PACKMOE_CHECK(!validation_.empty(), "evaluate() without a validation set (eval_interval = 0)");
  const auto start = std::chrono::steady_clock::now();
  optimizer_->prepare_forward();  // every rank holds all weights: each evaluates it all
  EvalResult r;
  std::vector<QueuedLosses> queued;  // read once, after the last batch
  for (const Batch& batch : validation_) {
    Result<QueuedLosses> losses = model_->queue_forward(batch, std::nullopt);
    if (!losses) return losses.status();
    queued.push_back(losses.value());
    r.tokens += batch.batch * batch.seq;
  }
  double loss_sum = 0;  // lm loss x targets: the mean over every target of the set
  int64_t targets = 0;
  for (const ForwardLosses& l : read_losses(model_->backend(), queued)) {
    loss_sum += static_cast<double>(l.lm_loss) * static_cast<double>(l.target_tokens);
    targets += l.target_tokens;
  }
  if (targets == 0)
    return Status::error("the validation batches have no target (every token's loss is masked)");
  r.loss = loss_sum / static_cast<double>(targets);
  r.seconds = seconds_since(start);
  return r;
}

}  // namespace packmoe::train
