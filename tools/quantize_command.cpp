// `packmoe quantize` and `packmoe dequantize`: safetensors conversion (io/quantized_checkpoint).
// quantize leaves the tensors NVIDIA ModelOpt leaves in their dtype (embeddings, LM head, MoE
// router, norms) unless --exclude says otherwise.
#include <cstdio>
#include <algorithm>
#include <regex>

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
// ModelOpt's default exclusions on Hugging Face names: the embedding (embed_tokens, wte), the LM
// head (lm_head, output_layer), the MoE router (mlp.gate, router) and every norm (1-D anyway).
constexpr const char* kDefaultExclude =
    R"((^|\.)(embed_tokens|wte|lm_head|output_layer|gate|router|[A-Za-z0-9_]*norm)(\.|$))";

}  // namespace

void add_quantize_command(CLI::App& app, QuantizeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Quantize every 2-D F32/BF16 tensor X of a safetensors file to MXFP8 or NVFP4.\n"
      "Writes X (MXFP8: F8_E4M3/F8_E5M2; NVFP4: U8, two E2M1 per byte, low nibble first),\n"
      "X_scale (MXFP8: F8_E8M0 per 32 along the last dim; NVFP4: F8_E4M3 per 16; compact\n"
      "[rows, K/block]) and for NVFP4 X_scale_2 (F32 scalar, per-tensor decode scale ~amax/2688).\n"
      "Other tensors are copied unchanged, and so are, as in NVIDIA ModelOpt, the embeddings, the\n"
      "LM head, the MoE router and the norms (--exclude replaces that list). With --2d a tensor\n"
      "whose rows are no multiple of the tile takes 1-D blocks (listed in the metadata key\n"
      "packmoe.block_1d). The output is written atomically. See docs/formats.md.");
  cmd->add_option("--format", args.format, "mxfp8 or nvfp4")
      ->required()
      ->check(CLI::IsMember({"mxfp8", "nvfp4"}));
  cmd->add_flag("--2d", args.two_d, "2-D blocks for weights: 32x32 (MXFP8) or 16x16 (NVFP4)");
  cmd->add_option("--element", args.element, "MXFP8 element type: e4m3 (default) or e5m2")
      ->check(CLI::IsMember({"e4m3", "e5m2"}));
  cmd->add_option("--exclude", args.exclude,
                  std::string("keep tensors whose name matches this ECMAScript regex (searched "
                              "anywhere in the name; repeatable; \"\" excludes nothing) in their "
                              "dtype; given, it replaces the default ") +
                      kDefaultExclude)
      ->take_all();
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
  std::vector<std::regex> exclude;
  for (const std::string& r : args.exclude.empty() ? std::vector<std::string>{kDefaultExclude}
                                                   : args.exclude) {
    if (r.empty()) continue;
    try {
      exclude.emplace_back(r, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return Status::error("--exclude '" + r + "': not a regular expression (" + e.what() + ")");
    }
  }
  std::vector<std::string> excluded, fallbacks;
  opt.exclude = [&](const std::string& name) {
    for (const std::regex& r : exclude)
      if (std::regex_search(name, r)) {
        excluded.push_back(name);
        return true;
      }
    return false;
  };
  opt.fallbacks = &fallbacks;
  Status s = io::quantize_file(args.in, args.out, opt, *backend.value(), progress_printer(args.quiet));
  if (!s && s.message().find("not a multiple of") != std::string::npos)
    return Status::error(s.message() + "; keep such a tensor in its dtype with --exclude REGEX");
  PACKMOE_RETURN_IF_ERROR(s);
  if (!args.quiet) {
    // Each name is tested twice (counting, then converting): print each once.
    std::sort(excluded.begin(), excluded.end());
    excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());
    for (const std::string& n : excluded)
      std::fprintf(stderr, "kept in its dtype (--exclude): %s\n", printable_text(n).c_str());
    for (const std::string& n : fallbacks)
      std::fprintf(stderr, "1-D blocks (rows no multiple of the 2-D tile): %s\n",
                   printable_text(n).c_str());
    std::fprintf(stderr, "wrote %s\n", args.out.c_str());
  }
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
