// Training curves as a self-contained SVG (no scripts, fonts or external files): panel 1 is loss
// vs step (train and eval), panel 2 grad norm vs step (train). One <polyline> per non-empty series
// with one point per finite value, so a NaN loss leaves a gap in the count, never a wrong point.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "train/metrics.h"

namespace packmoe::train {

// "Nice" tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi] with about
// `target` intervals; the first tick is <= lo and the last >= hi, so they also give the axis range.
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

// The SVG text. An error when no record has a finite loss (nothing to plot).
Result<std::string> render_metrics_svg(const std::vector<MetricsRecord>& records,
                                       const std::string& title);

// read_metrics(metrics_path) -> render -> write svg_path atomically.
Status plot_metrics_file(const std::string& metrics_path, const std::string& svg_path);

}  // namespace packmoe::train
