// The training loop behind `packmoe train`: steps a Trainer to config.steps, evaluating every
// eval_interval steps and after the last, writing one metrics.jsonl record per step and per
// evaluation, one Megatron-style log line per log_interval and, when asked (stdout is a terminal),
// a live progress bar, and a checkpoint every save_interval steps and after the last. Invariant:
// the loop only reads the Trainer's state; what it prints or writes (checkpoints included) never
// changes the numbers of the run.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "core/status.h"
#include "train/trainer.h"

namespace packmoe::train {

struct TrainLoopOptions {
  std::string metrics_path;   // JSONL (train/metrics.h); empty: no file
  bool progress_bar = false;  // redraw a bar on `out` after every step (for a terminal)
  std::FILE* out = stdout;    // log lines, eval lines, checkpoint lines
  // Checkpoints (Trainer::save_checkpoint) under save_dir, after the step's evaluation: every
  // save_interval steps (0: none on the way) and after the last step; empty save_dir: never.
  std::string save_dir;
  int64_t save_interval = 0;
  int keep_last = 2;
  bool save_primary = false;
  // TensorBoard event file (train/tensorboard.h) in this directory: the scalars of every step and
  // evaluation; empty: none.
  std::string tensorboard_dir;
};

struct TrainSummary {
  double first_loss = 0;                  // train loss of the first step run, first_step
  int64_t first_step = 0;
  double last_loss = 0;                   // mean train loss of the last log interval:
  int64_t last_interval_begin = 0;        //   steps [last_interval_begin, last_step]
  int64_t last_step = 0;
  std::optional<double> last_eval_loss;
  double seconds = 0;                     // wall time of the loop
};

// " validation loss at iteration      50 | lm loss value: 4.123456E+00 | lm loss PPL:
// 6.177000E+01 |" (Megatron's evaluate_and_print_results, iteration padded like the log line).
std::string format_eval_line(int64_t iteration, double loss);

// Runs the remaining steps (from trainer.step() to config.steps). A resumed trainer (step() > 0)
// appends to the metrics file after dropping its records of later steps (truncate_metrics_after).
// Errors: a failed step or eval (e.g. a non-finite loss), a metrics file or checkpoint that
// cannot be written.
Result<TrainSummary> run_training(Trainer& trainer, const TrainLoopOptions& options);

}  // namespace packmoe::train
