// Training curves as a self-contained SVG (no scripts, fonts or external files): panel 1 is loss
// vs step (train and eval), panel 2 grad norm vs step (train), panel 3 the learning rate; one or
// more runs overlaid, each in its own colour. One <polyline class="series"> per non-empty series
// with one point per finite value, so a NaN loss leaves a gap in the count, never a wrong point;
// with smoothing the raw train curves stay behind as faint <polyline class="raw">.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "train/metrics.h"

namespace packmoe::train {

// "Nice" tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi] with about
// `target` intervals; the first tick is <= lo and the last >= hi, so they also give the axis range.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

// One run's records; with several runs its name prefixes its series ("tiny: train loss").
struct PlotRun {
  std::string name;
  std::vector<MetricsRecord> records;
};

struct PlotOptions {
  std::string title;
  // EMA weight w in [0, 1) on the train loss and grad norm, as TensorBoard's smoothing slider:
  // s_0 = 0, s_i = w s_(i-1) + (1 - w) x_i over the finite points in step order, drawn debiased
  // as s_i / (1 - w^i). 0: no smoothing.
  double smoothing = 0;
};

// The SVG text. An error when no run has a finite loss (nothing to plot) or smoothing is outside
// [0, 1).
Result<std::string> render_metrics_svg(const std::vector<PlotRun>& runs, const PlotOptions& options);
// One unnamed run, no smoothing.
Result<std::string> render_metrics_svg(const std::vector<MetricsRecord>& records,
                                       const std::string& title);

// The run name of a metrics file: its directory's name ("runs/tiny/metrics.jsonl" -> "tiny"), or
// the file's stem when it has no directory.
std::string run_name_of(const std::string& metrics_path);

// read_metrics of each path -> render -> write svg_path atomically. names: one per path, or empty
// (run_name_of each); an empty title becomes "packmoe: " + the names.
Status plot_metrics_files(const std::vector<std::string>& metrics_paths,
                          std::vector<std::string> names, PlotOptions options,
                          const std::string& svg_path);
// One run (the trainer's loss.svg).
Status plot_metrics_file(const std::string& metrics_path, const std::string& svg_path);

}  // namespace packmoe::train
