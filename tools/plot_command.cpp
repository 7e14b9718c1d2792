// `packmoe plot`: training curves from a metrics.jsonl (as the trainer writes it) to an SVG file.
// The SVG is written atomically, so a failed run never leaves a partial plot behind.
#include <cstdio>

#include "tools/commands.h"
#include "train/plot.h"

namespace packmoe::tools {

void add_plot_command(CLI::App& app, PlotArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "plot",
      "Plot training curves from a metrics JSONL file (one JSON object per line with step,\n"
      "split \"train\"|\"eval\", loss, lr, grad_norm, tokens_per_s, elapsed_s) as one\n"
      "self-contained SVG: top panel loss vs step (train line, eval line with markers), bottom\n"
      "panel train grad norm vs step. Non-finite values (NaN loss) are skipped. The SVG is\n"
      "written atomically.");
  cmd->add_option("metrics", args.metrics, "metrics .jsonl file written by training")->required();
  cmd->add_option("--out", args.out, "output SVG file (default: plot.svg)");
  cmd->add_flag("--quiet", args.quiet, "no 'wrote ...' line");
}

Status run_plot(const PlotArgs& args) {
  PACKMOE_RETURN_IF_ERROR(train::plot_metrics_file(args.metrics, args.out));
  if (!args.quiet) std::fprintf(stderr, "wrote %s\n", args.out.c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
