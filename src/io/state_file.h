// Generic training-state files inside a checkpoint directory: named host tensors of any DType in a
// safetensors file (metadata {"format": "packmoe-state", "version": "1"}) and JSON documents.
// Invariant: a read either returns exactly the expected tensors (names, dtypes, shapes) or one
// error line naming the file and the tensor; both writers replace their target atomically.
#pragma once

#include <functional>
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

// An error naming `where`, the tensor and the element unless every F32 value of `tensors` is
// finite (and >= 0 where non_negative(name) says so, e.g. AdamW's second moments): loaded
// masters and moments are checked before a run starts, not found steps later as a NaN loss.
// The readers above keep every bit as stored; this is the check a run applies to what they read.
Status check_finite(const std::map<std::string, Tensor>& tensors, const std::string& where,
                    const std::function<bool(const std::string&)>& non_negative = {});

// Pretty-printed JSON with a final newline, written atomically.
Status write_json_file(const std::string& path, const nlohmann::json& doc);
// A regular file of at most kMaxJsonFileBytes, parsed with core/json_limits.h's limits; the
// error names the path ("cannot open", "not a regular file", "not valid JSON: ...").
Result<nlohmann::json> read_json_file(const std::string& path);

}  // namespace packmoe::io
