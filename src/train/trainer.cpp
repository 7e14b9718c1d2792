// Trainer: one optimizer step = A micro-batches of forward + backward, grad norm, clip, AdamW.
#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <sstream>

#include "optim/grad_clip.h"

namespace packmoe::train {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::create(Backend& backend, const ModelConfig& model,
                                                 const TrainConfig& config, TrainData data) {
  PACKMOE_RETURN_IF_ERROR(train::validate(model));
  PACKMOE_RETURN_IF_ERROR(validate(config, model));
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
                                   random_model_weights(model, config.seed));
  return std::unique_ptr<Trainer>(new Trainer(std::move(m), config, std::move(sampler.value()),
                                              std::move(validation)));
}

Trainer::Trainer(std::unique_ptr<Model> model, const TrainConfig& config,
                 BatchSampler train_sampler, std::vector<Batch> validation)
    : model_(std::move(model)),
      config_(config),
      schedule_(lr_schedule(config)),
      optimizer_(AdamWConfig{static_cast<float>(config.lr), static_cast<float>(config.beta1),
                             static_cast<float>(config.beta2), static_cast<float>(config.eps),
                             static_cast<float>(config.weight_decay)}),
      train_sampler_(std::move(train_sampler)),
      validation_(std::move(validation)) {
  for (const NamedParam& p : model_->params()) {
    optimizer_.add(*p.param, p.weight_decay);
    grads_.push_back(&p.param->main_grad());
  }
}

bool Trainer::on_cuda() const { return model_->backend().name().rfind("cuda", 0) == 0; }

Result<StepResult> Trainer::train_step() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t A = config_.grad_accum_steps;
  const float loss_scale = 1.0f / static_cast<float>(A);
  StepResult r;
  r.step = step_ + 1;
  model_->zero_grad();
  double loss_sum = 0, aux_sum = 0;
  for (int64_t micro = 0; micro < A; ++micro) {
    const Batch batch = train_sampler_.next();
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
