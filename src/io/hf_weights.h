// Model weights <-> Hugging Face Qwen3-MoE safetensors (docs/checkpoints.md, docs/formats.md).
// On disk experts are per expert and gate / up apart (what Qwen3MoeForCausalLM.from_pretrained
// reads); in memory they are packed. Each HF tensor is ONE contiguous element range of one
// ModelWeights tensor, so the map is a list of (HF name, shape, packed name, element offset) and
// never reorders bytes. Invariant: a load either returns weights that pass validate_model_weights
// or an error; never part.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "nn/model.h"
#include "nn/model_config.h"

namespace packmoe::io {

// File names of an HF model directory.
inline constexpr const char* kHfWeightsFile = "model.safetensors";
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

// One tensor of the HF checkpoint and where its elements live in ModelWeights.
struct HfTensorSpec {
  std::string hf_name;  // e.g. "model.layers.0.mlp.experts.3.up_proj.weight"
  Shape shape;          // on disk, e.g. (F, H)
  std::string param;    // ModelWeights key, e.g. "model.layers.0.mlp.experts.gate_up_proj"
  int64_t offset = 0;   // first element inside `param` (row-major); numel = shape_numel(shape)
};

// How expert weights are named on disk. Hub checkpoints and from_pretrained use kPerExpert;
// kFused is transformers 5's in-memory layout (the same as packmoe's), shipped by some newer
// checkpoints: "model.layers.N.mlp.experts.gate_up_proj" (E, 2F, H) and ".experts.down_proj"
// (E, H, F), without ".weight".
enum class HfExpertLayout { kPerExpert, kFused };

// Every HF tensor of the config, in model_param_specs order with each packed tensor expanded
// (prefix "model.layers.N.mlp."):
//   experts.J.gate_proj.weight (F, H) = experts.gate_up_proj[J] rows [0, F)     for J < E
//   experts.J.up_proj.weight   (F, H) = experts.gate_up_proj[J] rows [F, 2F)
//   experts.J.down_proj.weight (H, F) = experts.down_proj[J]
//   gate_proj.weight (I, H) / up_proj.weight (I, H) = gate_up_proj rows [0, I) / [I, 2I)  (dense)
// Every other parameter (router "mlp.gate.weight" and dense "mlp.down_proj.weight" included)
// keeps its name; there is no lm_head.weight when the embeddings are tied. kFused keeps the two
// packed expert tensors whole instead.
std::vector<HfTensorSpec> hf_tensor_specs(const ModelConfig& config,
                                          HfExpertLayout experts = HfExpertLayout::kPerExpert);

// Writes `weights` (validated against the config first) as ONE safetensors file at `path`
// (normally DIR/model.safetensors) with the HF names, metadata {"format": "pt"}, in `dtype`:
// kF32 (the exact bits) or kBF16 (f32_to_bf16: round to nearest even). Atomic: on any error the
// file at `path` is untouched.
Status save_hf_weights(const std::string& path, const ModelConfig& config,
                       const ModelWeights& weights, DType dtype,
                       HfExpertLayout experts = HfExpertLayout::kPerExpert);

// Reads HF weights from `path`: a .safetensors file, or a directory holding model.safetensors or
// (sharded) model.safetensors.index.json with its shards. F32 is taken as is, BF16 widened exactly.
// Each packed expert tensor may be stored either way (fused when its own name is on disk).
// Every tensor name, shape and dtype is checked against hf_tensor_specs(config); a missing,
// unexpected, misshapen or unsupported-dtype tensor (so also a checkpoint of another model) is one
// error line naming the tensor and the file.
Result<ModelWeights> load_hf_weights(const std::string& path, const ModelConfig& config);

}  // namespace packmoe::io
