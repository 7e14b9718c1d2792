// The `packmoe` executable: subcommands `train` (the main job), `tokenize` (text to a Megatron
// .bin/.idx with a real tokenizer), `export-hf` (a checkpoint as a
// Hugging Face model directory), `eval` (a checkpoint's loss and perplexity), `demo` (packed
// quantization demo), `quantize` and `dequantize`
// (safetensors conversion), `plot` (training curves to SVG). Bad
// input, unknown flags included, prints one line starting with "packmoe: error:" and exits 1;
// --help on every subcommand explains the flags.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "packmoe: mixture-of-experts training with single grouped low-precision expert weights.\n"
      "Expert weights live in one packed (E, N, K) parameter stored in BF16, MXFP8 or NVFP4."};
  app.require_subcommand(1);
  packmoe::tools::DemoArgs demo;
  packmoe::tools::QuantizeArgs quantize;
  packmoe::tools::DequantizeArgs dequantize;
  packmoe::tools::add_demo_command(app, demo);
  packmoe::tools::add_quantize_command(app, quantize);
  packmoe::tools::add_dequantize_command(app, dequantize);
  packmoe::tools::PlotArgs plot;
  packmoe::tools::add_plot_command(app, plot);
  packmoe::tools::TrainArgs train;
  packmoe::tools::add_train_command(app, train);
  packmoe::tools::TokenizeArgs tokenize;
  packmoe::tools::add_tokenize_command(app, tokenize);
  packmoe::tools::ExportHfArgs export_hf;
  packmoe::tools::add_export_hf_command(app, export_hf);
  packmoe::tools::GenerateArgs generate;
  packmoe::tools::add_generate_command(app, generate);
  packmoe::tools::EvalArgs eval;
  packmoe::tools::add_eval_command(app, eval);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Under mpirun every rank parses the same command line: the error is printed once, by rank 0.
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr || std::string(rank) == "0")
      std::fprintf(stderr, "packmoe: error: %s (see --help)\n", e.what());
    return 1;
  }
  packmoe::Status status;
  if (app.got_subcommand("demo")) status = packmoe::tools::run_demo(demo);
  if (app.got_subcommand("quantize")) status = packmoe::tools::run_quantize(quantize);
  if (app.got_subcommand("dequantize")) status = packmoe::tools::run_dequantize(dequantize);
  if (app.got_subcommand("plot")) status = packmoe::tools::run_plot(plot);
  if (app.got_subcommand("train")) status = packmoe::tools::run_train(train);
  if (app.got_subcommand("tokenize")) status = packmoe::tools::run_tokenize(tokenize);
  if (app.got_subcommand("export-hf")) status = packmoe::tools::run_export_hf(export_hf);
  if (app.got_subcommand("generate")) status = packmoe::tools::run_generate(generate);
  if (app.got_subcommand("eval")) status = packmoe::tools::run_eval(eval);
  if (!status.is_ok()) {
    std::fprintf(stderr, "packmoe: error: %s\n", status.message().c_str());
    return 1;
  }
  return 0;
}
