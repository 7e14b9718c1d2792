// Trainer: the Model, AdamW on its FP32 masters, the LR schedule, global grad-norm clipping and the
// data samplers, stepped one optimizer step at a time. Invariants: a run is a pure function of
// (ModelConfig, TrainConfig, data) - same seed, same bits, for any thread count and either layout;
// evaluate() changes no training state (train -> eval -> train is bitwise train-only); a
// checkpoint holds the whole state (masters, moments, step, data position, SR offsets), so save ->
// resume -> train is bitwise train-only in either layout; a failed load changes nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "dist/communicator.h"
#include "dist/dist_optimizer.h"
#include "io/checkpoint_dir.h"
#include "io/token_data.h"
#include "nn/model.h"
#include "optim/adamw.h"
#include "train/batch_sampler.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"
#include "train/model_config.h"
#include "train/throughput.h"
#include "train/train_config.h"

namespace packmoe::train {

// Data for a run. The token streams are built by BatchSampler (train/batch_sampler.h).
struct TrainData {
  io::TokenDataset train;
  io::TokenDataset validation;  // unused when eval_interval = 0
  StreamOptions train_stream;   // the byte corpus separates documents with '\n'
  StreamOptions validation_stream;
};

struct StepResult {
  int64_t step = 0;       // optimizer steps done, this one included
  double loss = 0;        // mean lm loss over the micro-batches
  double aux_loss = 0;    // mean load-balancing loss (sum over MoE layers, without the coef)
  double grad_norm = 0;   // global norm of the accumulated gradient, before clipping
  double lr = 0;          // the lr of this step
  int64_t tokens = 0;     // A x B x S
  double seconds = 0;     // wall time of the step, the device synchronized at its end
};

struct EvalResult {
  double loss = 0;  // mean lm loss over the fixed validation batches (each has B x S targets)
  int64_t tokens = 0;
  double seconds = 0;
};

class Trainer {
 public:
  // Builds the model from `init` (e.g. HF weights; its masters are these exact values) or, when
  // null, random_model_weights(model, config.seed); AdamW over model.params() (weight decay per
  // NamedParam), the train sampler at position 0 and the fixed validation set (eval_batches
  // batches, when eval_interval > 0). Errors: a bad config, init weights that do not fit the
  // model, a token >= vocab_size, too little data.
  static Result<std::unique_ptr<Trainer>> create(Backend& backend, const ModelConfig& model,
                                                 const TrainConfig& config, TrainData data,
                                                 const ModelWeights* init = nullptr);
  // A trainer that continues `checkpoint` (read_trainer_checkpoint) under `config`, which may
  // differ from the checkpoint's: the layout, recipe and primary weight freely (the masters, AdamW
  // moments, step, data position and SR offsets carry over as they are), the schedule and steps
  // too. The data must be the stream the checkpoint indexes (same token count) and the position a
  // window start for config.seq_len.
  static Result<std::unique_ptr<Trainer>> resume(Backend& backend,
                                                 const TrainerCheckpoint& checkpoint,
                                                 const TrainConfig& config, TrainData data);

  // Writes a checkpoint of the current state as ROOT/step-<step()> through io::CheckpointWriter
  // (temporary directory, CRC marker, rename, keep the newest keep_last); save_primary adds
  // primary.safetensors. Only between steps. On error no step-* directory changed. With data
  // parallelism it is collective: rank 0 makes the temporary directory, every rank writes its
  // optimizer shard file into it, rank 0 the other files; rank 0 commits only when every rank
  // succeeded, and every rank returns the same status (other ranks: info.dir and step only).
  Result<io::CheckpointWriter::Committed> save_checkpoint(const std::string& root, int keep_last,
                                                          bool save_primary = false);
  // The state a checkpoint holds, copied to the host. With data parallelism it is collective
  // (the full masters and moments are gathered onto every rank, with every rank's SR offsets) and
  // carries the shard plan.
  TrainerCheckpoint snapshot() const;
  // Replaces this trainer's state by a checkpoint directory's, keeping this trainer's config
  // (layout, recipe, schedule). Every file is read and checked first (read_trainer_checkpoint,
  // plus: the same model as this one, the same data stream, a valid position); on any error this
  // trainer is untouched. Any world size loads any checkpoint; with data parallelism it is
  // collective, every rank reads and checks, and all return the same status.
  Status load_checkpoint(const std::string& dir);
  // The same from a checkpoint already read (e.g. by every rank of `packmoe train --resume`).
  // Without data parallelism the model is rebuilt from the stored masters; with it, the
  // DistOptimizer takes this rank's part of the masters and moments (re-split by this job's
  // plan) and the next forward gathers the weights. NVFP4 stochastic rounding needs nothing
  // restored: each micro-batch's offset follows from the step (nvfp4_grad_sr_offset).
  Status load_checkpoint(const TrainerCheckpoint& checkpoint);

  // zero_grad; A x (forward + backward(1 / A)); global grad norm; clip coefficient; lr of step
  // step() + 1; AdamW step (re-quantizes every packed primary weight, one launch per param).
  // A non-finite loss or grad norm is an error and nothing is updated.
  Result<StepResult> train_step();
  // Mean lm loss over the fixed validation batches: forwards only, no gradient, no optimizer,
  // no sampler change. eval_interval = 0 (no validation set): a programmer error.
  Result<EvalResult> evaluate();

  // Data parallelism (docs/dist.md part 2): from now on the ZeRO-1 DistOptimizer over `comm`
  // replaces AdamW; rank r trains on micro-batch r of every comm.size() consecutive sampler
  // batches (global batch = size x B x A), and train_step reports the global mean loss and grad
  // norm on every rank. N ranks are bitwise one process with grad_accum_steps x N while no step
  // is clipped (MPI, and NCCL with 2 ranks; but the embedding, docs/dist.md). Parameters whose
  // NamedParam::reads_fp32 is set travel as FP32 replicas; the model's grad-ready hook starts each
  // gradient bucket's reduce-scatter during the step's last backward. Only before the first step;
  // collective.
  // bucket_elems: the reduce-scatter unit (DistOptimizerConfig).
  Status enable_data_parallel(Communicator& comm, GatherMode mode,
                              int64_t bucket_elems = DistOptimizerConfig{}.bucket_elems);
  bool data_parallel() const { return dist_ != nullptr; }
  int world_size() const { return comm_ ? comm_->size() : 1; }  // GPUs (or CPU ranks) training
  DistOptimizer* dist_optimizer() { return dist_.get(); }

  int64_t step() const { return step_; }
  const TrainConfig& config() const { return config_; }
  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  AdamW& optimizer() { return optimizer_; }
  BatchSampler& train_sampler() { return train_sampler_; }
  bool on_cuda() const;  // throughput reports TFLOP/s and MFU only there
  double flops_per_token() const { return model_flops_per_token(model_->config(), config_.seq_len); }

 private:
  Trainer(std::unique_ptr<Model> model, const TrainConfig& config, BatchSampler train_sampler,
          std::vector<Batch> validation);
  void attach_optimizer();  // AdamW and grads_ over model_->params()
  // Errors unless `c` can continue here: the same model, the same training stream, a position
  // that is a window start of it.
  Status check_resumable(const TrainerCheckpoint& c) const;
  // Moments, AdamW step count, SR offsets, sampler position and step from a checked checkpoint
  // whose masters the model was built from (with data parallelism: the masters too).
  void restore_state(const TrainerCheckpoint& c);
  // save_checkpoint with data parallelism (collective).
  Result<io::CheckpointWriter::Committed> save_checkpoint_dist(const std::string& root,
                                                               int keep_last, bool save_primary);

  std::unique_ptr<Model> model_;
  TrainConfig config_;
  LrSchedule schedule_;
  AdamW optimizer_;
  BatchSampler train_sampler_;
  std::vector<Batch> validation_;  // (eval_batches) fixed micro-batches
  std::vector<const GroupedStorage*> grads_;  // every main_grad, in params() order
  int64_t step_ = 0;
  Communicator* comm_ = nullptr;
  std::unique_ptr<DistOptimizer> dist_;
  std::unique_ptr<DeviceBuffer> loss_sums_;  // (2) F64 in comm_'s memory: the loss all-reduce
  Result<StepResult> train_step_dist();
};

}  // namespace packmoe::train
