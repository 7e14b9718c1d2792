// Logging, evaluation cadence, metrics records and progress bar around Trainer::train_step.
#include "train/train_loop.h"

#include <chrono>
#include <cmath>
#include <optional>

#include "train/metrics.h"

namespace packmoe::train {
namespace {

void print_line(const TrainLoopOptions& o, const std::string& line) {
  // With a bar on screen, clear it first so the line replaces it (the bar is redrawn later).
  std::fprintf(o.out, "%s%s\n", o.progress_bar ? "\r\033[K" : "", line.c_str());
  std::fflush(o.out);
}

}  // namespace

std::string format_eval_line(int64_t iteration, double loss) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                " validation loss at iteration %8lld | lm loss value: %.6E | lm loss PPL: %.6E |",
                static_cast<long long>(iteration), loss, std::exp(std::min(loss, 20.0)));
  return buf;
}

Result<TrainSummary> run_training(Trainer& trainer, const TrainLoopOptions& o) {
  const TrainConfig& c = trainer.config();
  std::optional<MetricsWriter> metrics;
  if (!o.metrics_path.empty()) {
    if (trainer.step() > 0)
      PACKMOE_RETURN_IF_ERROR(truncate_metrics_after(o.metrics_path, trainer.step()));
    Result<MetricsWriter> w = MetricsWriter::open(o.metrics_path, /*append=*/trainer.step() > 0);
    if (!w) return w.status();
    metrics.emplace(std::move(w.value()));
  }
  // tokens/s is the job's (every rank's tokens); TFLOP/s and MFU are per GPU.
  const double gpu_flops_per_token = trainer.flops_per_token() / trainer.world_size();
  const bool cuda = trainer.on_cuda();
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const int64_t first_step = trainer.step();

  TrainSummary summary;
  // Sums over the current log interval (Megatron averages the losses it prints).
  double interval_loss = 0, interval_aux = 0, interval_seconds = 0;
  int64_t interval_steps = 0, interval_tokens = 0;
  double train_seconds = 0;  // step time only, for the ETA
  while (trainer.step() < c.steps) {
    Result<StepResult> step = trainer.train_step();
    if (!step) return step.status();
    const StepResult& s = step.value();
    if (s.step == first_step + 1) summary.first_loss = s.loss;
    summary.last_loss = s.loss;
    train_seconds += s.seconds;

    MetricsRecord rec;
    rec.step = s.step;
    rec.split = Split::kTrain;
    rec.loss = s.loss;
    rec.lr = s.lr;
    rec.grad_norm = s.grad_norm;
    rec.tokens_per_s = static_cast<double>(s.tokens) / s.seconds;
    if (cuda) {
      rec.tflops = gpu_flops_per_token * rec.tokens_per_s / 1e12;
      rec.mfu = gpu_flops_per_token * rec.tokens_per_s / kH200PeakFlops;
    }
    rec.elapsed_s = elapsed();
    if (metrics) PACKMOE_RETURN_IF_ERROR(metrics->write(rec));

    interval_loss += s.loss;
    interval_aux += s.aux_loss;
    interval_seconds += s.seconds;
    interval_tokens += s.tokens;
    ++interval_steps;
    if (s.step % c.log_interval == 0 || s.step == c.steps) {
      LogLine line;
      line.iteration = s.step;
      line.total_iterations = c.steps;
      line.consumed_samples = s.step * (s.tokens / c.seq_len);  // global: x ranks in data parallel
      line.ms_per_iteration = 1e3 * interval_seconds / static_cast<double>(interval_steps);
      const double tokens_per_s = static_cast<double>(interval_tokens) / interval_seconds;
      if (cuda) line.tflops_per_gpu = gpu_flops_per_token * tokens_per_s / 1e12;
      line.learning_rate = s.lr;
      line.lm_loss = interval_loss / static_cast<double>(interval_steps);
      line.load_balancing_loss = interval_aux / static_cast<double>(interval_steps);
      line.grad_norm = s.grad_norm;
      line.tokens_per_s = tokens_per_s;
      if (const auto mem = trainer.model().backend().memory_use())
        line.peak_memory_gb = static_cast<double>(mem->peak_reserved) / 1e9;
      line.eta_s = train_seconds / static_cast<double>(s.step - first_step) *
                   static_cast<double>(c.steps - s.step);
      std::string text = format_log_line(line);
      if (cuda) {
        char mfu[64];
        std::snprintf(mfu, sizeof mfu, " MFU: %.1f%% |",
                      100.0 * tokens_per_s * gpu_flops_per_token / kH200PeakFlops);
        text += mfu;
      }
      print_line(o, text);
      interval_loss = interval_aux = interval_seconds = 0;
      interval_steps = interval_tokens = 0;
    }

    if (c.eval_interval > 0 && (s.step % c.eval_interval == 0 || s.step == c.steps)) {
      Result<EvalResult> eval = trainer.evaluate();
      if (!eval) return eval.status();
      summary.last_eval_loss = eval.value().loss;
      MetricsRecord er;
      er.step = s.step;
      er.split = Split::kEval;
      er.loss = eval.value().loss;
      er.lr = s.lr;
      er.tokens_per_s = static_cast<double>(eval.value().tokens) / eval.value().seconds;
      er.elapsed_s = elapsed();
      if (metrics) PACKMOE_RETURN_IF_ERROR(metrics->write(er));
      print_line(o, format_eval_line(s.step, eval.value().loss));
    }

    const bool save_now = o.save_interval > 0 && s.step % o.save_interval == 0;
    if (!o.save_dir.empty() && (save_now || s.step == c.steps)) {
      const auto save_start = std::chrono::steady_clock::now();
      Result<io::CheckpointWriter::Committed> saved =
          trainer.save_checkpoint(o.save_dir, o.keep_last, o.save_primary);
      if (!saved) return saved.status();
      char text[64];
      std::snprintf(
          text, sizeof text, " in %.2f s",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - save_start).count());
      print_line(o, " saved checkpoint " + saved.value().info.dir + text);
      for (const std::string& w : saved.value().warnings) print_line(o, " warning: " + w);
    }

    if (o.progress_bar) {
      std::fprintf(o.out, "\r\033[K%s", progress_bar(s.step, c.steps, elapsed()).c_str());
      if (s.step == c.steps) std::fputc('\n', o.out);
      std::fflush(o.out);
    }
  }
  summary.seconds = elapsed();
  return summary;
}

}  // namespace packmoe::train
