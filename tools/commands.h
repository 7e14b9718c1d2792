// Subcommands of the `packmoe` executable: flag registration and the run functions.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "backend/backend.h"
#include "core/status.h"

namespace packmoe::tools {

// "auto" picks CUDA when a GPU is usable, else the CPU.
Result<Backend*> backend_from_flag(const std::string& device);

struct DemoArgs {
  std::string device = "auto";
  std::string format = "all";
  int64_t experts = 8, rows = 256, cols = 512;
  uint64_t seed = 1;
};
void add_demo_command(CLI::App& app, DemoArgs& args);
Status run_demo(const DemoArgs& args);

struct QuantizeArgs {
  std::string device = "auto", format, element = "e4m3", in, out;
  bool two_d = false, quiet = false;
};
void add_quantize_command(CLI::App& app, QuantizeArgs& args);
Status run_quantize(const QuantizeArgs& args);

struct DequantizeArgs {
  std::string device = "auto", dtype = "f32", in, out;
  bool quiet = false;
};
void add_dequantize_command(CLI::App& app, DequantizeArgs& args);
Status run_dequantize(const DequantizeArgs& args);

struct PlotArgs {
  std::string metrics, out = "plot.svg";
  bool quiet = false;
};
void add_plot_command(CLI::App& app, PlotArgs& args);
Status run_plot(const PlotArgs& args);

}  // namespace packmoe::tools
