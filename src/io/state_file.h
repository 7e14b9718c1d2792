// Generic training-state files inside a checkpoint directory: named host tensors of any DType in a
// safetensors file (metadata {"format": "packmoe-state", "version": "1"}) and JSON documents.
// Invariant: a read either returns exactly the expected tensors (names, dtypes, shapes) or one
// error line naming the file and the tensor; both writers replace their target atomically.
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace packmoe::io {

using StateTensors = std::map<std::string, Tensor>;  // host tensors by name

struct StateTensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
};

// Every tensor must be a CPU tensor; the error names the first that is not.
Status write_state_tensors(const std::string& path, const StateTensors& tensors);
// Reads `path` (written by write_state_tensors) into owning host tensors, checking that it holds
// exactly `expected`: a missing, unexpected, misshapen or other-dtype tensor is an error.
Result<StateTensors> read_state_tensors(const std::string& path,
                                        std::span<const StateTensorSpec> expected);

// Pretty-printed JSON with a final newline, written atomically.
Status write_json_file(const std::string& path, const nlohmann::json& doc);
// A regular file of at most kMaxJsonFileBytes, parsed with core/json_limits.h's limits; the
// error names the path ("cannot open", "not a regular file", "not valid JSON: ...").
Result<nlohmann::json> read_json_file(const std::string& path);

}  // namespace packmoe::io
