// Training metrics: a JSONL file (one JSON object per line, flushed per line so a crash loses at
// most the line being written), its reader, the Megatron-style log line and a progress-bar string.
// The formatters are pure functions of their inputs, so tests pin their exact text; whether stdout
// is a terminal is the caller's decision.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace packmoe::train {

enum class Split { kTrain, kEval };
const char* split_name(Split split);  // "train" / "eval"

// One line of metrics.jsonl. Non-finite numbers (a NaN loss) are written as JSON null and read
// back as NaN, since JSON has no NaN.
struct MetricsRecord {
  int64_t step = 0;
  Split split = Split::kTrain;
  double loss = 0;
  double lr = 0;
  std::optional<double> grad_norm;  // train records; eval has no backward pass
  double tokens_per_s = 0;
  std::optional<double> tflops;  // per GPU
  std::optional<double> mfu;     // fraction of peak, 0..1
  double elapsed_s = 0;          // since the start of the run
};

std::string metrics_record_to_json_line(const MetricsRecord& record);  // no trailing newline

class MetricsWriter {
 public:
  // append = true continues a resumed run's file; false truncates.
  static Result<MetricsWriter> open(const std::string& path, bool append);
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();

  Status write(const MetricsRecord& record);  // one line, flushed

 private:
  MetricsWriter(std::FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  std::FILE* file_ = nullptr;
  std::string path_;
};

// For a resumed run: removes from `path` the records of steps after `step` (the run repeats
// those steps) and a torn last line that does not parse (a crash mid-write; one that parses gets
// its missing newline), rewriting the file atomically when anything changes. A missing file is
// fine; any other bad line is an error.
Status truncate_metrics_after(const std::string& path, int64_t step);

// Blank lines are skipped; any other bad line is an error "PATH:LINE: ...".
Result<std::vector<MetricsRecord>> read_metrics(const std::string& path);
Result<MetricsRecord> parse_metrics_line(const std::string& line);

// Inputs of one Megatron-style log line (megatron/training/training.py `training_log`).
struct LogLine {
  int64_t iteration = 0, total_iterations = 0;
  int64_t consumed_samples = 0;
  double ms_per_iteration = 0;           // averaged over the log interval
  std::optional<double> tflops_per_gpu;  // "throughput per GPU (TFLOP/s/GPU)" when known
  double learning_rate = 0;
  double lm_loss = 0;
  std::optional<double> load_balancing_loss;
  std::optional<double> grad_norm;
  double tokens_per_s = 0;
  std::optional<double> peak_memory_gb;  // the device memory's high-water mark, when known
  std::optional<double> eta_s;  // remaining time, when the caller has an estimate
};

// " iteration      10/     100 | consumed samples:          640 | elapsed time per iteration
// (ms): 812.3 | learning rate: 3.000000E-04 | lm loss: 5.123456E+00 | grad norm: 1.234 |
// tokens/s: 12345 | peak memory (GB): 61.2 | ETA 0:01:23 |" on one line, Megatron's field formats ({:8d}, {:12d}, {:.1f},
// {:.6E}, MoE losses {:.2f}, grad norm {:.3f}); tokens/s, peak memory and ETA are packmoe
// additions.
std::string format_log_line(const LogLine& line);

// "M:SS" under an hour, "H:MM:SS" above; negative or non-finite gives "?".
std::string format_duration(double seconds);

// "[=========>                    ]  30/100  30% 0:12<0:28 2.50 it/s": `width` cells of bar,
// '=' for done, '>' at the head; the ETA is "?" until one step has finished.
std::string progress_bar(int64_t step, int64_t total, double elapsed_s, int width = 30);

// Replaces `path` with `contents` atomically (io::write_file_atomic: temporary file in the same
// directory, fsync, rename). For the text files of train/: config.json and plots.
Status write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace packmoe::train
