// Whole-file quantize / dequantize of safetensors checkpoints through any backend.
#include "io/quantized_checkpoint.h"

#include <cstring>
#include <set>

#include "backend/device_buffer.h"
#include "formats/nvfp4_math.h"
#include "core/checked_math.h"
#include "core/json_limits.h"
#include "io/safetensors.h"

namespace packmoe::io {
namespace {

bool is_float_dtype(const std::string& d) {
  return d == "F32" || d == "BF16" || d == "F16" || d == "F64";
}

// Tensor names come from the file: printed with control bytes escaped.
std::string where(const std::string& path, const std::string& tensor) {
  return path + ": tensor '" + printable_text(tensor) + "': ";
}

Status quantize_tensor(const SafetensorsEntry& e, const std::string& path,
                       const QuantizeFileOptions& opt, Backend& backend, SafetensorsWriter& out) {
  if (e.dtype != "F32" && e.dtype != "BF16")
    return Status::error(where(path, e.name) + "dtype " + e.dtype +
                         " is not supported (packmoe quantizes F32 and BF16)");
  const int64_t rows = e.shape[0], cols = e.shape[1];
  GroupedMatrices in;
  in.dtype = e.dtype == "F32" ? DType::kF32 : DType::kBF16;
  in.cols = cols;
  in.rows = {rows};
  DeviceBuffer src(backend, e.bytes.size());
  src.upload(e.bytes);
  in.data = {src.get()};

  auto failed = [&](const Status& s) {
    return Status::error(where(path, e.name) + "shape (" + std::to_string(rows) + ", " +
                         std::to_string(cols) + "): " + s.message());
  };
  if (opt.format == FileFormat::kMxfp8) {
    Mxfp8Config cfg;
    cfg.element = opt.element;
    cfg.two_d = opt.two_d;
    DeviceBuffer data(backend, rows * cols);
    DeviceBuffer scale(backend, cols % kMxfp8Block ? 0 : rows * (cols / kMxfp8Block));
    Mxfp8Outputs o;
    o.row_data = {data.get()};
    o.row_scale = {scale.get()};
    Status s = ops::quantize_mxfp8(backend, in, cfg, o);
    if (!s) return failed(s);
    out.add(e.name, opt.element == DType::kE4M3 ? "F8_E4M3" : "F8_E5M2", {rows, cols},
            data.download());
    out.add(e.name + "_scale", "F8_E8M0", {rows, cols / kMxfp8Block}, scale.download());
    return Status::ok();
  }
  Nvfp4Config cfg;
  cfg.two_d = opt.two_d;
  DeviceBuffer data(backend, rows * cols / 2);
  DeviceBuffer scale(backend, cols % kNvfp4Block ? 0 : rows * (cols / kNvfp4Block));
  DeviceBuffer amax(backend, sizeof(float));
  Nvfp4Outputs o;
  o.row_data = {data.get()};
  o.row_scale = {scale.get()};
  o.row_amax = amax.get();
  Status s = ops::quantize_nvfp4(backend, in, cfg, o);
  if (!s) return failed(s);
  float amax_host;
  std::vector<uint8_t> amax_bytes = amax.download();
  std::memcpy(&amax_host, amax_bytes.data(), sizeof(float));
  float decode = nvfp4_decode_scale(amax_host);
  std::vector<uint8_t> decode_bytes(sizeof(float));
  std::memcpy(decode_bytes.data(), &decode, sizeof(float));
  out.add(e.name, "U8", {rows, cols / 2}, data.download());
  out.add(e.name + "_scale", "F8_E4M3", {rows, cols / kNvfp4Block}, scale.download());
  out.add(e.name + "_scale_2", "F32", {}, std::move(decode_bytes));
  return Status::ok();
}

bool shape_is(const SafetensorsEntry& e, std::vector<int64_t> shape) { return e.shape == shape; }

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

Status dequantize_tensor(const SafetensorsEntry& x, const SafetensorsFile& file, DType out_dtype,
                         Backend& backend, SafetensorsWriter& out) {
  const std::string& path = file.source();
  const SafetensorsEntry* scale = file.find(x.name + "_scale");
  const SafetensorsEntry* scale_2 = file.find(x.name + "_scale_2");
  if (x.shape.size() != 2)
    return Status::error(where(path, x.name) + "quantized tensors are 2-D, got shape " +
                         shape_text(x.shape));
  const int64_t rows = x.shape[0];
  const int64_t out_elem = out_dtype == DType::kF32 ? 4 : 2;
  // A zero-row tensor holds no bytes whatever its width, so its sizes are checked here, not by
  // the file's length: the logical width (NVFP4: two values a byte) and the output must fit.
  const bool nvfp4 = x.dtype == "U8";
  const std::optional<int64_t> logical_cols = checked_mul(x.shape[1], nvfp4 ? 2 : 1);
  PACKMOE_RETURN_IF_ERROR(check_fits(
      logical_cols ? checked_product({rows, *logical_cols, out_elem}) : std::nullopt,
      host_memory_bytes(),
      where(path, x.name) + "the dequantized " + shape_text(x.shape) + " " + x.dtype + " tensor"));
  const std::string out_name = out_dtype == DType::kF32 ? "F32" : "BF16";
  DeviceBuffer data(backend, x.bytes.size());
  data.upload(x.bytes);
  DeviceBuffer sc(backend, scale->bytes.size());
  sc.upload(scale->bytes);

  if (x.dtype == "F8_E4M3" || x.dtype == "F8_E5M2") {
    const int64_t cols = x.shape[1];
    if (scale->dtype != "F8_E8M0" || cols % kMxfp8Block ||
        !shape_is(*scale, {rows, cols / kMxfp8Block}))
      return Status::error(where(path, x.name) + "MXFP8 data " + shape_text(x.shape) +
                           " needs an F8_E8M0 scale of shape [" + std::to_string(rows) + ", " +
                           std::to_string(cols / kMxfp8Block) + "], got " + scale->dtype + " " +
                           shape_text(scale->shape));
    Mxfp8Copy q;
    q.element = x.dtype == "F8_E4M3" ? DType::kE4M3 : DType::kE5M2;
    q.cols = cols;
    q.rows = {rows};
    q.data = {data.get()};
    q.scale = {sc.get()};
    DeviceBuffer result(backend, rows * cols * out_elem);
    Status s = ops::dequantize_mxfp8(backend, q, out_dtype, {result.get()});
    if (!s) return Status::error(where(path, x.name) + s.message());
    out.add(x.name, out_name, {rows, cols}, result.download());
    return Status::ok();
  }
  if (x.dtype == "U8") {
    const int64_t cols = *logical_cols;  // two E2M1 values per byte
    if (scale->dtype != "F8_E4M3" || cols % kNvfp4Block ||
        !shape_is(*scale, {rows, cols / kNvfp4Block}))
      return Status::error(where(path, x.name) + "NVFP4 data " + shape_text(x.shape) +
                           " needs an F8_E4M3 scale of shape [" + std::to_string(rows) + ", " +
                           std::to_string(cols / kNvfp4Block) + "], got " + scale->dtype + " " +
                           shape_text(scale->shape));
    if (!scale_2 || scale_2->dtype != "F32" || scale_2->numel() != 1)
      return Status::error(where(path, x.name) + "NVFP4 data needs a scalar F32 '" + x.name +
                           "_scale_2' (the per-tensor decode scale)");
    DeviceBuffer sc2(backend, sizeof(float));
    sc2.upload(scale_2->bytes);
    Nvfp4Copy q;
    q.cols = cols;
    q.rows = {rows};
    q.data = {data.get()};
    q.scale = {sc.get()};
    q.decode_scale = sc2.get();
    DeviceBuffer result(backend, rows * cols * out_elem);
    Status s = ops::dequantize_nvfp4(backend, q, out_dtype, {result.get()});
    if (!s) return Status::error(where(path, x.name) + s.message());
    out.add(x.name, out_name, {rows, cols}, result.download());
    return Status::ok();
  }
  return Status::error(where(path, x.name) + "has a '_scale' companion but dtype " + x.dtype +
                       " (expected F8_E4M3 / F8_E5M2 for MXFP8 or U8 for NVFP4)");
}

}  // namespace

Status quantize_file(const std::string& in_path, const std::string& out_path,
                     const QuantizeFileOptions& options, Backend& backend,
                     const Progress& progress) {
  if (options.element != DType::kE4M3 && options.element != DType::kE5M2)
    return Status::error("the MXFP8 element type must be e4m3 or e5m2");
  Result<SafetensorsFile> file = SafetensorsFile::read(in_path);
  if (!file) return file.status();
  const auto& entries = file.value().entries();
  std::set<std::string> names;
  for (const auto& e : entries) names.insert(e.name);
  // A quantized file (ours or any X with X_scale) is not quantized again, in either format: its
  // bytes are no floats, so it would be copied through and labelled with the new format.
  if (auto it = file.value().metadata().find("packmoe.format"); it != file.value().metadata().end())
    return Status::error(in_path + ": the file is quantized already (packmoe.format = " +
                         printable_text(it->second, true) + "); dequantize it first");
  size_t quantizable = 0;
  for (const auto& e : entries) {
    if (names.count(e.name + "_scale"))
      return Status::error(where(in_path, e.name) + "has a '_scale' companion: the file is " +
                           "quantized already; dequantize it first");
    quantizable += e.shape.size() == 2 && is_float_dtype(e.dtype) &&
                   !(options.exclude && options.exclude(e.name));
  }
  if (quantizable == 0)
    return Status::error(in_path + ": no 2-D floating-point tensor to quantize" +
                         (options.exclude ? " (outside the excluded ones)" : ""));

  SafetensorsWriter out;
  std::vector<std::string> fallback;  // 2-D requested, 1-D blocks taken
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    if (progress) progress(i + 1, entries.size(), e.name);
    bool quantize = e.shape.size() == 2 && is_float_dtype(e.dtype) &&
                    !(options.exclude && options.exclude(e.name));
    if (!quantize) {
      out.add(e.name, e.dtype, e.shape, e.bytes);
      continue;
    }
    for (const char* suffix : {"_scale", "_scale_2"})
      if (names.count(e.name + suffix))
        return Status::error(where(in_path, e.name) + "the input already has a tensor named '" +
                             printable_text(e.name + suffix) + "'; is it quantized already?");
    // 2-D tiles need whole tiles of rows; such a tensor takes 1-D blocks (same scale layout).
    const int64_t tile = options.format == FileFormat::kMxfp8 ? kMxfp8Block : kNvfp4Block;
    QuantizeFileOptions tensor_options = options;
    if (options.two_d && e.shape[0] % tile != 0) {
      tensor_options.two_d = false;
      fallback.push_back(e.name);
    }
    PACKMOE_RETURN_IF_ERROR(quantize_tensor(e, in_path, tensor_options, backend, out));
  }
  if (options.fallbacks) *options.fallbacks = fallback;
  if (!fallback.empty()) {
    std::string list;
    for (const std::string& n : fallback) list += (list.empty() ? "" : ",") + n;
    out.set_metadata("packmoe.block_1d", list);
  }
  for (const auto& [k, v] : file.value().metadata()) out.set_metadata(k, v);
  bool mx = options.format == FileFormat::kMxfp8;
  out.set_metadata("packmoe.format", mx ? "mxfp8" : "nvfp4");
  out.set_metadata("packmoe.block", mx ? (options.two_d ? "32x32" : "1x32")
                                       : (options.two_d ? "16x16" : "1x16"));
  return out.write(out_path);
}

Status dequantize_file(const std::string& in_path, const std::string& out_path, DType out_dtype,
                       Backend& backend, const Progress& progress) {
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    return Status::error("dequantize writes f32 or bf16");
  Result<SafetensorsFile> file = SafetensorsFile::read(in_path);
  if (!file) return file.status();
  const SafetensorsFile& f = file.value();

  // Companions of a quantized X are consumed with X; a companion without its X is an error.
  auto base_of = [&](const std::string& name) -> std::string {
    for (const char* suffix : {"_scale_2", "_scale"}) {
      size_t n = std::strlen(suffix);
      if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) {
        std::string base = name.substr(0, name.size() - n);
        if (f.find(base + "_scale")) return base;
      }
    }
    return "";
  };
  SafetensorsWriter out;
  size_t quantized = 0;
  for (size_t i = 0; i < f.entries().size(); ++i) {
    const SafetensorsEntry& e = f.entries()[i];
    if (progress) progress(i + 1, f.entries().size(), e.name);
    std::string base = base_of(e.name);
    if (!base.empty()) {
      if (!f.find(base))
        return Status::error(where(in_path, e.name) + "is a scale without its data tensor '" +
                             printable_text(base) + "'");
      continue;
    }
    if (!f.find(e.name + "_scale")) {
      out.add(e.name, e.dtype, e.shape, e.bytes);
      continue;
    }
    PACKMOE_RETURN_IF_ERROR(dequantize_tensor(e, f, out_dtype, backend, out));
    ++quantized;
  }
  for (const auto& [k, v] : f.metadata())
    if (k.rfind("packmoe.", 0) != 0) out.set_metadata(k, v);
  if (quantized == 0)
    return Status::error(in_path + ": no quantized tensor (X with X_scale) found");
  return out.write(out_path);
}

}  // namespace packmoe::io
