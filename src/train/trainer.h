// Trainer: the Model, its optimizer (DistOptimizer: ZeRO-1 AdamW over a Communicator, one rank
// for a process that trains alone), the LR schedule, global grad-norm clipping and the data
// samplers, stepped one optimizer step at a time. Invariants: a run is a pure function of
// (ModelConfig, TrainConfig, data) - same seed, same bits, for any thread count and either layout;
// 1..N ranks run the same code (N ranks are bitwise one process with N micro-batches while no step
// is clipped, docs/dist.md); evaluate() changes no training state (train -> eval -> train is
// bitwise train-only); a checkpoint holds the whole state (masters, moments, step, data position),
// so save -> resume -> train is bitwise train-only in either layout; a failed load changes nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "dist/communicator.h"
#include "dist/dist_optimizer.h"
#include "dist/expert_layout.h"
#include "dist/parallel_optimizer.h"
#include "io/checkpoint_dir.h"
#include "io/token_data.h"
#include "nn/model.h"
#include "train/batch_sampler.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"
#include "train/model_config.h"
#include "train/throughput.h"
#include "train/train_config.h"

namespace packmoe::train {

// Data for a run: the sources read by BatchSampler (train/batch_sampler.h). The streams' document
// masks apply; their shuffle and seed are the TrainConfig's (shuffle, seed).
struct TrainData {
  DataBlend train;
  DataBlend validation;  // unused when eval_interval = 0
  StreamOptions train_stream;
  StreamOptions validation_stream;
};

struct StepResult {
  int64_t step = 0;       // optimizer steps done, this one included
  double loss = 0;        // mean lm loss over every target of the step's micro-batches
  double aux_loss = 0;    // mean load-balancing loss (Hugging Face's over all MoE layers, no coef)
  double grad_norm = 0;   // global norm of the accumulated gradient, before clipping
  double lr = 0;          // the lr of this step
  int64_t tokens = 0;     // A x B x S
  double seconds = 0;     // wall time of the step, the device synchronized at its end
};

// Where the trainer's optimizer runs: over `comm` (every rank of a data-parallel job, in
// comm.backend()'s memory), or, when null, over a one-rank communicator of the trainer's own.
struct TrainerParallelism {
  Communicator* comm = nullptr;
  int64_t bucket_elems = DistOptimizerConfig{}.bucket_elems;  // the reduce-scatter unit
};

// Seconds of each phase of Trainer::create / resume, the device synchronized at the end of each
// (what `packmoe train` prints at start-up).
// The optimizer's parameters of a model: every parameter in params() order, its weight decay, and
// a full FP32 replica (WeightForm::kFp32) for those whose layers read their FP32 weight itself
// (every norm, the embedding table).
std::vector<DistParam> optimizer_params(const Model& model);

// The checks of a job's layout that Trainer::create makes before it builds anything, one error
// line each: NVFP4's micro-batches per step (grad_accum_steps x world) within what its stochastic
// rounding numbers, and the expert-parallel layout of config.expert_parallel over `world` ranks
// (make_expert_layout, dist/expert_layout.h).
Result<ExpertLayout> check_job_layout(const ModelConfig& model, const TrainConfig& config,
                                      int64_t world);

struct StartupTimes {
  double weights = 0;    // random_model_weights in the backend's memory (0 with given weights)
  double model = 0;      // the layers: primary weights from the init (each param keeps it)
  double optimizer = 0;  // grad buffer, master shard and moments, the staged gather
  double state = 0;      // resume: the checkpoint's masters, moments and data position
};

struct EvalResult {
  double loss = 0;  // mean lm loss over every target of the fixed validation batches
  int64_t tokens = 0;
  double seconds = 0;
};

class Trainer {
 public:
  // Builds the model from `init` (e.g. HF weights; its masters are these exact values) or, when
  // null, random_model_weights(backend, model, config.seed) (in the backend's memory); the optimizer over model.params() (weight
  // decay per NamedParam; parameters whose NamedParam::reads_fp32 is set keep FP32 replicas; the
  // rest travel in config.gather_mode), the train sampler at position 0 and the fixed validation
  // set (eval_batches batches, when eval_interval > 0). With N ranks, rank r trains on micro-batch
  // r of every N consecutive sampler batches (global batch = N x B x A); the model's grad-ready
  // hook starts each gradient bucket's reduce-scatter during the step's last backward.
  // Collective. Errors: a bad config, init weights that do not fit the model, a token >=
  // vocab_size, too little data, a communicator on another backend, NVFP4 with more micro-batches
  // per step than its stochastic rounding numbers.
  static Result<std::unique_ptr<Trainer>> create(Backend& backend, const ModelConfig& model,
                                                 const TrainConfig& config, TrainData data,
                                                 const ModelWeights* init = nullptr,
                                                 const TrainerParallelism& parallel = {});
  // A trainer that continues `checkpoint` (read_trainer_checkpoint, saved by any number of ranks)
  // under `config`, which may differ from the checkpoint's: the layout, recipe and primary weight
  // freely (the masters, AdamW moments, step and data position carry over as they are), the
  // schedule and steps too. The data must be the sources the checkpoint's sampler state counts
  // (the same shapes: tokens and samples per epoch). Collective; every rank returns the same
  // status.
  static Result<std::unique_ptr<Trainer>> resume(Backend& backend,
                                                 const TrainerCheckpoint& checkpoint,
                                                 const TrainConfig& config, TrainData data,
                                                 const TrainerParallelism& parallel = {});

  // Writes a checkpoint of the current state as ROOT/step-<step()> through io::CheckpointWriter
  // (temporary directory, CRC marker, rename, keep the newest keep_last); save_primary adds
  // primary.safetensors. Only between steps. On error no step-* directory changed. Collective:
  // rank 0 makes the temporary directory and writes the files, with N > 1 ranks every rank its
  // optimizer shard file (one rank: the moments in optimizer.safetensors); rank 0 commits only
  // when every rank succeeded, and every rank returns the same status (other ranks: info.dir and
  // step only).
  Result<io::CheckpointWriter::Committed> save_checkpoint(const std::string& root, int keep_last,
                                                          bool save_primary = false);
  // The state a checkpoint holds, copied to the host: the full masters and moments (gathered onto
  // every rank), and with N > 1 ranks the shard plan. Collective.
  TrainerCheckpoint snapshot() const;
  // Replaces this trainer's state by a checkpoint directory's, keeping this trainer's config
  // (layout, recipe, schedule). Every file is read and checked first (read_trainer_checkpoint,
  // plus: the same model as this one, the same data stream, a valid position); on any error this
  // trainer is untouched. Any world size loads any checkpoint. Collective: every rank reads and
  // checks, and all return the same status.
  Status load_checkpoint(const std::string& dir);
  // The same from a checkpoint already read (e.g. by every rank of `packmoe train --resume`): the
  // optimizer takes this rank's part of the masters and moments (re-split by this job's plan) and
  // the next forward gathers the weights. NVFP4 stochastic rounding needs nothing restored: each
  // micro-batch's offset follows from the step (nvfp4_grad_sr_offset).
  Status load_checkpoint(const TrainerCheckpoint& checkpoint);

  // A x (forward + backward) into the grad buffer, micro-batch m's lm loss scaled by n_m / N (its
  // targets over the step's, all ranks: the mean over every target), its aux loss by
  // 1 / (A x ranks); the global mean loss and grad
  // norm (the same on every rank); clip coefficient; lr of step step() + 1; the optimizer step
  // (the weights reach the model at the next forward). A non-finite loss or grad norm is an
  // error and nothing is updated (the trainer is then not to be stepped again). Collective.
  Result<StepResult> train_step();
  // Mean lm loss over the fixed validation batches: forwards only, no gradient, no optimizer
  // update, no sampler change; every rank evaluates them all. eval_interval = 0 (no validation
  // set): a programmer error. Collective (the parameter gather of the last step).
  Result<EvalResult> evaluate();

  int world_size() const { return comm_->size(); }  // GPUs (or CPU ranks) training
  // Every parameter's optimizer, or under expert parallelism the dense parameters' (the experts'
  // is parallel_optimizer().experts()).
  DistOptimizer& optimizer() { return optimizer_->all_ranks(); }
  const DistOptimizer& optimizer() const { return optimizer_->all_ranks(); }
  ParallelOptimizer& parallel_optimizer() { return *optimizer_; }

  int64_t step() const { return step_; }
  const TrainConfig& config() const { return config_; }
  Model& model() { return *model_; }
  const Model& model() const { return *model_; }
  BatchSampler& train_sampler() { return train_sampler_; }
  // Validation micro-batches per evaluation: eval_batches, or fewer when the validation data
  // holds fewer distinct rows (fixed_batches).
  int64_t eval_batches() const { return static_cast<int64_t>(validation_.size()); }
  bool on_cuda() const;  // throughput reports TFLOP/s and MFU only there
  double flops_per_token() const { return model_flops_per_token(model_->config(), config_.seq_len); }
  const StartupTimes& startup_times() const { return startup_; }

 private:
  Trainer(std::unique_ptr<Model> model, const TrainConfig& config, BatchSampler train_sampler,
          std::vector<Batch> validation, const TrainerParallelism& parallel);
  // Errors unless `c` can continue here: the same model, the same training sources, a sampler
  // state of them.
  Status check_resumable(const TrainerCheckpoint& c) const;
  // Masters, moments, optimizer step count, sampler position and step from a checked checkpoint.
  void restore_state(const TrainerCheckpoint& c);
  // Each rank writes its optimizer shard file (data parallelism over 2+ ranks); otherwise rank 0
  // writes the whole state in the single-process format.
  bool sharded_save() const { return comm_->size() > 1 && !optimizer_->expert_parallel(); }

  std::unique_ptr<Communicator> own_comm_;  // one process: its one-rank communicator
  Communicator* comm_;
  std::unique_ptr<Model> model_;
  TrainConfig config_;
  LrSchedule schedule_;
  BatchSampler train_sampler_;
  std::vector<Batch> validation_;  // (eval_batches) fixed micro-batches
  // Expert parallelism (config.expert_parallel > 1): the EP group's and the expert-data-parallel
  // group's communicators (split from comm_), null otherwise.
  std::unique_ptr<Communicator> ep_comm_, edp_comm_;
  std::unique_ptr<ParallelOptimizer> optimizer_;
  DeviceBuffer loss_sums_;  // (2) F64 in comm_'s memory: the loss all-reduce
  int64_t step_ = 0;
  StartupTimes startup_;
};

}  // namespace packmoe::train
