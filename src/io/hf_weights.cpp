// HF Qwen3-MoE weight files (see hf_weights.h). Loading checks a whole file's names, dtypes and
// shapes before copying any of its bytes, and the result map is handed out only after the last
// file passed, so an error never leaves a caller with part of a model.
#include "io/hf_weights.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <unordered_map>

#include "backend/backend.h"
#include "core/codecs.h"
#include "io/safetensors.h"
#include "io/state_file.h"

namespace packmoe::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data are little-endian; hf_weights copies host floats as is");

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr std::string_view kGateUpSuffix = ".mlp.experts.gate_up_proj";
constexpr std::string_view kDownSuffix = ".mlp.experts.down_proj";
constexpr std::string_view kDenseGateUpSuffix = ".mlp.gate_up_proj";

// Names from files are untrusted: JSON quoting keeps an error message on one printable line.
std::string quoted(const std::string& name) { return Json(name).dump(); }

std::string safetensors_shape_text(const std::vector<int64_t>& shape) {
  return shape_string(Shape(shape.begin(), shape.end()));
}

// The tensors one safetensors file must hold, and where each one goes.
struct Expected {
  std::string file;                        // for errors
  std::vector<const HfTensorSpec*> specs;  // in hf_tensor_specs order
};

// Checks every name, dtype and shape of `file` against `expected` (and, for a shard, against the
// index's assignment in `shard_of`), then copies the values into `out`. Nothing is copied unless
// the whole file passed.
Status check_and_copy(const SafetensorsFile& file, const Expected& expected,
                      const std::unordered_map<std::string, std::string>* shard_of,
                      const std::unordered_map<std::string, const HfTensorSpec*>& all_specs,
                      ModelWeights& out) {
  const std::string& where = expected.file;
  std::set<std::string, std::less<>> here;
  for (const HfTensorSpec* s : expected.specs) here.insert(s->hf_name);

  std::vector<std::string> names;
  for (const SafetensorsEntry& e : file.entries()) names.push_back(e.name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    if (here.count(name)) continue;
    if (shard_of && all_specs.count(name)) {
      return Status::error(where + ": tensor " + quoted(name) + " belongs to shard " +
                           quoted(shard_of->at(name)) + " according to " + kHfIndexFile);
    }
    return Status::error(where + ": unexpected tensor " + quoted(name) +
                         ": this model config has no such tensor (a checkpoint of another model?)");
  }
  size_t missing = 0;
  const HfTensorSpec* first_missing = nullptr;
  for (const HfTensorSpec* s : expected.specs) {
    if (file.find(s->hf_name)) continue;
    if (!first_missing) first_missing = s;
    ++missing;
  }
  if (first_missing) {
    const std::string why =
        shard_of ? " (listed for this file in " + std::string(kHfIndexFile) + ")"
                 : " (" + std::to_string(missing) + " of " + std::to_string(expected.specs.size()) +
                       " expected tensors are missing)";
    return Status::error(where + ": missing tensor " + quoted(first_missing->hf_name) + why);
  }
  for (const HfTensorSpec* s : expected.specs) {
    const SafetensorsEntry& e = *file.find(s->hf_name);
    if (e.dtype != "F32" && e.dtype != "BF16") {
      return Status::error(where + ": tensor " + quoted(s->hf_name) + " has dtype " + e.dtype +
                           "; only F32 and BF16 are supported");
    }
    if (Shape(e.shape.begin(), e.shape.end()) != s->shape) {
      return Status::error(where + ": tensor " + quoted(s->hf_name) + " has shape " +
                           safetensors_shape_text(e.shape) + ", this model config expects " +
                           shape_string(s->shape) + " (a checkpoint of another model?)");
    }
  }
  for (const HfTensorSpec* s : expected.specs) {
    const SafetensorsEntry& e = *file.find(s->hf_name);
    float* dst = out.at(s->param).data_as<float>() + s->offset;
    const int64_t n = shape_numel(s->shape);
    if (e.dtype == "F32") {
      std::memcpy(dst, e.bytes.data(), static_cast<size_t>(n) * sizeof(float));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, e.bytes.data() + 2 * i, sizeof h);
        dst[i] = bf16_to_f32(h);
      }
    }
  }
  return Status::ok();
}

Result<Json> read_index(const std::string& path) {
  Result<Json> read = read_json_file(path);
  if (!read) return read.status();
  const Json& index = read.value();
  if (!index.is_object()) return Status::error(path + ": not a JSON object");
  auto it = index.find("weight_map");
  if (it == index.end() || !it->is_object()) {
    return Status::error(path + ": no \"weight_map\" object");
  }
  for (const auto& [name, file] : it->items()) {
    if (!file.is_string()) {
      return Status::error(path + ": weight_map entry " + quoted(name) + " is not a file name");
    }
    const std::string f = file.get<std::string>();
    // Shards are siblings of the index: a path elsewhere is refused rather than followed.
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos) {
      return Status::error(path + ": weight_map entry " + quoted(name) + " names " + quoted(f) +
                           ", which is not a file name in the same directory");
    }
  }
  return *it;
}

// hf_tensor_specs where fused(packed expert name) picks, per packed tensor, the fused layout.
std::vector<HfTensorSpec> specs_with(const ModelConfig& config,
                                     const std::function<bool(const std::string&)>& fused) {
  std::vector<HfTensorSpec> out;
  for (const ParamSpec& p : model_param_specs(config)) {
    const bool experts = p.name.ends_with(kGateUpSuffix) || p.name.ends_with(kDownSuffix);
    if (experts && fused(p.name)) {
      out.push_back({p.name, p.shape, p.name, 0});
    } else if (p.name.ends_with(kGateUpSuffix)) {
      const std::string prefix =
          p.name.substr(0, p.name.size() - std::string_view("gate_up_proj").size());
      const int64_t E = p.shape.at(0), F = p.shape.at(1) / 2, H = p.shape.at(2);  // (E, 2F, H)
      for (int64_t j = 0; j < E; ++j) {
        const std::string expert = prefix + std::to_string(j) + ".";
        out.push_back({expert + "gate_proj.weight", {F, H}, p.name, j * 2 * F * H});
        out.push_back({expert + "up_proj.weight", {F, H}, p.name, j * 2 * F * H + F * H});
      }
    } else if (p.name.ends_with(kDownSuffix)) {
      const std::string prefix =
          p.name.substr(0, p.name.size() - std::string_view("down_proj").size());
      const int64_t E = p.shape.at(0), H = p.shape.at(1), F = p.shape.at(2);  // (E, H, F)
      for (int64_t j = 0; j < E; ++j) {
        out.push_back(
            {prefix + std::to_string(j) + ".down_proj.weight", {H, F}, p.name, j * H * F});
      }
    } else if (p.name.ends_with(kDenseGateUpSuffix)) {
      const std::string prefix =
          p.name.substr(0, p.name.size() - std::string_view("gate_up_proj").size());
      const int64_t I = p.shape.at(0) / 2, H = p.shape.at(1);  // (2I, H)
      out.push_back({prefix + "gate_proj.weight", {I, H}, p.name, 0});
      out.push_back({prefix + "up_proj.weight", {I, H}, p.name, I * H});
    } else {
      out.push_back({p.name, p.shape, p.name, 0});
    }
  }
  return out;
}

}  // namespace

std::vector<HfTensorSpec> hf_tensor_specs(const ModelConfig& config, HfExpertLayout experts) {
  return specs_with(config, [&](const std::string&) { return experts == HfExpertLayout::kFused; });
}

Status save_hf_weights(const std::string& path, const ModelConfig& config,
                       const ModelWeights& weights, DType dtype, HfExpertLayout experts) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Status::error(path + ": HF weights are written as F32 or BF16, not " +
                         std::string(dtype_name(dtype)));
  }
  Status valid = validate_model_weights(config, weights);
  if (!valid) return Status::error(path + ": cannot save: " + valid.message());
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");  // what transformers' save_pretrained writes
  for (const HfTensorSpec& s : hf_tensor_specs(config, experts)) {
    const float* src = weights.at(s.param).data_as<const float>() + s.offset;
    const size_t n = static_cast<size_t>(shape_numel(s.shape));
    std::vector<uint8_t> bytes(n * (dtype == DType::kF32 ? 4 : 2));
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data(), src, bytes.size());
    } else {
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(bytes.data() + 2 * i, &h, sizeof h);
      }
    }
    writer.add(s.hf_name, dtype_to_safetensors(dtype), s.shape, std::move(bytes));
  }
  return writer.write(path);
}

Result<ModelWeights> load_hf_weights(const std::string& path, const ModelConfig& config) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return Status::error(path + ": no such file or directory");
  std::string single;  // the one file of an unsharded checkpoint
  std::string index_path;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    if (fs::exists(dir / kHfIndexFile, ec)) {
      index_path = (dir / kHfIndexFile).string();
    } else if (fs::exists(dir / kHfWeightsFile, ec)) {
      single = (dir / kHfWeightsFile).string();
    } else {
      return Status::error(path + ": holds neither " + kHfWeightsFile + " nor " + kHfIndexFile);
    }
  } else {
    single = path;
  }

  // The names on disk: the single file's header or the index's weight_map.
  std::optional<SafetensorsFile> single_file;
  std::unordered_map<std::string, std::string> shard_of;  // name -> shard file name
  std::set<std::string> on_disk;
  if (!single.empty()) {
    Result<SafetensorsFile> file = SafetensorsFile::read(single);
    if (!file) return file.status();
    single_file.emplace(std::move(file).value());
    for (const SafetensorsEntry& e : single_file->entries()) on_disk.insert(e.name);
  } else {
    Result<Json> map = read_index(index_path);
    if (!map) return map.status();
    for (const auto& [name, file] : map.value().items()) {
      on_disk.insert(name);
      shard_of.emplace(name, file.get<std::string>());
    }
  }
  const std::vector<HfTensorSpec> specs =
      specs_with(config, [&](const std::string& packed) { return on_disk.count(packed) > 0; });
  std::unordered_map<std::string, const HfTensorSpec*> by_name;
  for (const HfTensorSpec& s : specs) by_name.emplace(s.hf_name, &s);

  // Which file must hold which tensors.
  std::vector<Expected> files;
  if (!single.empty()) {
    Expected all{single, {}};
    for (const HfTensorSpec& s : specs) all.specs.push_back(&s);
    files.push_back(std::move(all));
  } else {
    for (const std::string& name : on_disk) {
      if (!by_name.count(name)) {
        return Status::error(
            index_path + ": unexpected tensor " + quoted(name) +
            ": this model config has no such tensor (a checkpoint of another model?)");
      }
    }
    std::map<std::string, Expected> by_shard;
    for (const HfTensorSpec& s : specs) {
      auto it = shard_of.find(s.hf_name);
      if (it == shard_of.end()) {
        return Status::error(index_path + ": missing tensor " + quoted(s.hf_name) +
                             " (not in weight_map)");
      }
      Expected& e = by_shard[it->second];
      e.file = (fs::path(path) / it->second).string();
      e.specs.push_back(&s);
    }
    for (auto& [shard, e] : by_shard) files.push_back(std::move(e));
  }

  ModelWeights out;
  for (const ParamSpec& p : model_param_specs(config)) {
    out.emplace(p.name, Tensor::empty(cpu_backend(), DType::kF32, p.shape));
  }
  const auto* shards = index_path.empty() ? nullptr : &shard_of;
  for (const Expected& e : files) {
    if (single_file) {
      PACKMOE_RETURN_IF_ERROR(check_and_copy(*single_file, e, shards, by_name, out));
      continue;
    }
    Result<SafetensorsFile> file = SafetensorsFile::read(e.file);
    if (!file) return file.status();
    PACKMOE_RETURN_IF_ERROR(check_and_copy(file.value(), e, shards, by_name, out));
  }
  return out;
}

}  // namespace packmoe::io
