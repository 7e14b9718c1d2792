// Training-state files (see state_file.h). The tensors go through io/safetensors, so the file is a
// plain safetensors file any reader opens; the format marker only guards against reading, say, HF
// weights where optimizer state is expected.
#include "io/state_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "backend/backend.h"
#include "core/json_limits.h"
#include "io/atomic_file.h"
#include "io/read_file.h"
#include "io/safetensors.h"

namespace packmoe::io {
namespace {

using Json = nlohmann::json;

constexpr const char* kStateFormat = "packmoe-state";
constexpr const char* kStateVersion = "1";

std::string quoted(const std::string& name) { return Json(name).dump(); }

}  // namespace

Status write_state_tensors(const std::string& path, const StateTensors& tensors) {
  SafetensorsWriter writer;
  writer.set_metadata("format", kStateFormat);
  writer.set_metadata("version", kStateVersion);
  for (const auto& [name, t] : tensors) {
    if (t.device() != Device::kCPU) {
      return Status::error(path + ": cannot write tensor " + quoted(name) +
                           ": it is not in host memory");
    }
    writer.add(name, dtype_to_safetensors(t.dtype()), t.shape(),
               std::span<const uint8_t>(static_cast<const uint8_t*>(t.data()), t.nbytes()));
  }
  return writer.write(path);
}

Result<StateTensors> read_state_tensors(const std::string& path,
                                        std::span<const StateTensorSpec> expected) {
  Result<SafetensorsFile> read = SafetensorsFile::read(path);
  if (!read) return read.status();
  const SafetensorsFile& file = read.value();
  auto format = file.metadata().find("format");
  if (format == file.metadata().end() || format->second != kStateFormat) {
    return Status::error(path + ": not a packmoe state file (__metadata__ \"format\" is not \"" +
                         kStateFormat + "\")");
  }
  auto version = file.metadata().find("version");
  if (version == file.metadata().end() || version->second != kStateVersion) {
    return Status::error(path + ": unsupported packmoe state file version (this build reads " +
                         kStateVersion + ")");
  }
  std::set<std::string, std::less<>> names;
  for (const StateTensorSpec& s : expected) names.insert(s.name);
  for (const SafetensorsEntry& e : file.entries()) {
    if (!names.count(e.name)) return Status::error(path + ": unexpected tensor " + quoted(e.name));
  }
  StateTensors out;
  for (const StateTensorSpec& s : expected) {
    const SafetensorsEntry* e = file.find(s.name);
    if (!e) return Status::error(path + ": missing tensor " + quoted(s.name));
    Result<DType> dtype = dtype_from_safetensors(e->dtype);
    if (!dtype || dtype.value() != s.dtype) {
      return Status::error(path + ": tensor " + quoted(s.name) + " has dtype " + e->dtype +
                           ", expected " + std::string(dtype_to_safetensors(s.dtype)));
    }
    if (Shape(e->shape.begin(), e->shape.end()) != s.shape) {
      return Status::error(path + ": tensor " + quoted(s.name) + " has shape " +
                           shape_string(Shape(e->shape.begin(), e->shape.end())) + ", expected " +
                           shape_string(s.shape));
    }
    Tensor t = Tensor::empty(cpu_backend(), s.dtype, s.shape);
    if (t.nbytes()) std::memcpy(t.data(), e->bytes.data(), t.nbytes());
    out.emplace(s.name, std::move(t));
  }
  return out;
}

Status check_finite(const std::map<std::string, Tensor>& tensors, const std::string& where,
                    const std::function<bool(const std::string&)>& non_negative) {
  for (const auto& [name, t] : tensors) {
    if (t.dtype() != DType::kF32) continue;
    const float* v = t.data_as<float>();
    const bool positive = non_negative && non_negative(name);
    const int64_t n = t.numel();
    // The first offending element, whatever the thread count (a checkpoint's tensors are large:
    // one thread would scan them at a fraction of the memory bandwidth).
    int64_t i = n;
#pragma omp parallel for schedule(static) reduction(min : i)
    for (int64_t j = 0; j < n; ++j)
      if (!std::isfinite(v[j]) || (positive && v[j] < 0)) i = std::min(i, j);
    if (i == n) continue;
    const char* what = std::isnan(v[i]) ? "NaN" : std::isinf(v[i]) ? "an infinity"
                                                                  : "a negative value";
    return Status::error(where + ": tensor " + quoted(name) + " holds " + what + " at element " +
                         std::to_string(i));
  }
  return Status::ok();
}

Status write_json_file(const std::string& path, const Json& doc) {
  const std::string text = doc.dump(2) + "\n";
  const std::span<const uint8_t> part(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  return write_file_atomic(path, std::span<const std::span<const uint8_t>>(&part, 1));
}

Result<Json> read_json_file(const std::string& path) {
  Result<std::string> text = read_regular_file(path, kMaxJsonFileBytes);
  if (!text) return text.status();
  return parse_json_text(text.value(), path);
}

}  // namespace packmoe::io
