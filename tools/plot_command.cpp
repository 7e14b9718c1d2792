// `packmoe plot`: training curves from metrics.jsonl files (as the trainer writes them), overlaid,
// to an SVG file.
// The SVG is written atomically, so a failed run never leaves a partial plot behind.
#include <cstdio>

#include "tools/commands.h"
#include "train/plot.h"

namespace packmoe::tools {

void add_plot_command(CLI::App& app, PlotArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "plot",
      "Plot training curves from one or more metrics JSONL files (one JSON object per line with\n"
      "step, split \"train\"|\"eval\", loss, lr, grad_norm, tokens_per_s, elapsed_s) as one\n"
      "self-contained SVG: loss vs step (train line, eval line with markers), train grad norm\n"
      "vs step and the learning rate, the runs overlaid in their own colours. Non-finite values\n"
      "(NaN loss) are skipped. The SVG is written atomically.");
  cmd->add_option("metrics", args.metrics, "metrics .jsonl files written by training")->required();
  cmd->add_option("--out", args.out, "output SVG file (default: plot.svg)");
  cmd->add_option("--name", args.names,
                  "run name, once per file in order (default: each file's directory name)");
  cmd->add_option("--title", args.title, "title (default: \"packmoe: \" and the run names)");
  cmd->add_option("--smooth", args.smooth,
                  "EMA weight in [0, 1) on the train loss and grad norm, as TensorBoard's smoothing "
                  "(debiased; the raw curves stay faint behind); default 0: none");
  cmd->add_flag("--quiet", args.quiet, "no 'wrote ...' line");
}

Status run_plot(const PlotArgs& args) {
  PACKMOE_RETURN_IF_ERROR(train::plot_metrics_files(
      args.metrics, args.names, train::PlotOptions{args.title, args.smooth}, args.out));
  if (!args.quiet) std::fprintf(stderr, "wrote %s\n", args.out.c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
