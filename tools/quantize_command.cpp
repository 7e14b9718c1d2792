// `packmoe quantize` and `packmoe dequantize`: safetensors conversion (io/quantized_checkpoint).
#include <cstdio>

#include "io/quantized_checkpoint.h"
#include "core/json_limits.h"
#include "tools/commands.h"

namespace packmoe::tools {

Result<Backend*> backend_from_flag(const std::string& device) {
  if (device == "cpu") return get_backend(Device::kCPU);
  if (device == "cuda") return get_backend(Device::kCUDA);
  if (device == "auto") {
    Result<Backend*> cuda = get_backend(Device::kCUDA);
    return cuda ? cuda : get_backend(Device::kCPU);
  }
  return Status::error("--device must be auto, cpu or cuda (got '" + device + "')");
}

namespace {
io::Progress progress_printer(bool quiet) {
  if (quiet) return {};
  return [](size_t i, size_t n, const std::string& name) {  // a name from the file: escaped
    std::fprintf(stderr, "[%zu/%zu] %s\n", i, n, printable_text(name).c_str());
  };
}
}  // namespace

void add_quantize_command(CLI::App& app, QuantizeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantize every 2-D F32/BF16 tensor X of a safetensors file to MXFP8 or NVFP4.\n"
      "Writes X (MXFP8: F8_E4M3/F8_E5M2; NVFP4: U8, two E2M1 per byte, low nibble first),\n"
      "X_scale (MXFP8: F8_E8M0 per 32 along the last dim; NVFP4: F8_E4M3 per 16; compact\n"
      "[rows, K/block]) and for NVFP4 X_scale_2 (F32 scalar, per-tensor decode scale ~amax/2688).\n"
      "Other tensors are copied unchanged. The output is written atomically. See docs/formats.md.");
  cmd->add_option("--format", args.format, "mxfp8 or nvfp4")
      ->required()
      ->check(CLI::IsMember({"mxfp8", "nvfp4"}));
  cmd->add_flag("--2d", args.two_d, "2-D blocks for weights: 32x32 (MXFP8) or 16x16 (NVFP4)");
  cmd->add_option("--element", args.element, "MXFP8 element type: e4m3 (default) or e5m2")
      ->check(CLI::IsMember({"e4m3", "e5m2"}));
  cmd->add_option("--in", args.in, "input .safetensors")->required();
  cmd->add_option("--out", args.out, "output .safetensors")->required();
  cmd->add_option("--device", args.device, "auto (default: CUDA if a GPU is usable), cpu or cuda");
  cmd->add_flag("--quiet", args.quiet, "no per-tensor progress lines");
}

Status run_quantize(const QuantizeArgs& args) {
  Result<Backend*> backend = backend_from_flag(args.device);
  if (!backend) return backend.status();
  io::QuantizeFileOptions opt;
  opt.format = args.format == "mxfp8" ? io::FileFormat::kMxfp8 : io::FileFormat::kNvfp4;
  opt.two_d = args.two_d;
  opt.element = args.element == "e5m2" ? DType::kE5M2 : DType::kE4M3;
  if (opt.format == io::FileFormat::kNvfp4 && args.element != "e4m3")
    return Status::error("--element applies to mxfp8 only (NVFP4 elements are E2M1)");
  PACKMOE_RETURN_IF_ERROR(
      io::quantize_file(args.in, args.out, opt, *backend.value(), progress_printer(args.quiet)));
  if (!args.quiet) std::fprintf(stderr, "wrote %s\n", args.out.c_str());
  return Status::ok();
}

void add_dequantize_command(CLI::App& app, DequantizeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "dequantize",
      "Dequantize every X that has an X_scale (MXFP8, or NVFP4 with X_scale_2) back to F32 or\n"
      "BF16; other tensors are copied unchanged. The output is written atomically.");
  cmd->add_option("--in", args.in, "input .safetensors (as written by `packmoe quantize`)")
      ->required();
  cmd->add_option("--out", args.out, "output .safetensors")->required();
  cmd->add_option("--dtype", args.dtype, "output dtype: f32 (default) or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--device", args.device, "auto (default), cpu or cuda");
  cmd->add_flag("--quiet", args.quiet, "no per-tensor progress lines");
}

Status run_dequantize(const DequantizeArgs& args) {
  Result<Backend*> backend = backend_from_flag(args.device);
  if (!backend) return backend.status();
  DType out = args.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  PACKMOE_RETURN_IF_ERROR(io::dequantize_file(args.in, args.out, out, *backend.value(),
                                              progress_printer(args.quiet)));
  if (!args.quiet) std::fprintf(stderr, "wrote %s\n", args.out.c_str());
  return Status::ok();
}

}  // namespace packmoe::tools
