// Where `packmoe generate` takes its model and tokenizer from: a training checkpoint (a directory
// or a save root: its newest complete checkpoint) or a Hugging Face directory (an export-hf
// output). Invariant: find_model_source reads only the small files (config.json, the tokenizer,
// trainer_state.json), so the prompt can be checked against the model before load_weights
// allocates anything; both read with the readers train --resume / --init-from-hf and export-hf
// use (train/checkpoint.h, io/hf_weights.h).
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "generate/text_codec.h"
#include "nn/model.h"

namespace packmoe::generate {

struct ModelSource {
  bool checkpoint = false;  // a packmoe checkpoint (else a Hugging Face directory)
  std::string dir;          // the checkpoint directory found, or the HF directory
  ModelConfig config;
  std::string tokenizer;    // the tokenizer files loaded, or "" (byte tokens)
  TextCodec codec;
  std::vector<std::string> warnings;  // config.json keys packmoe does not know, for stderr
};

// PATH: a checkpoint directory (it holds complete.json), a save root, or a directory with
// config.json and model.safetensors[.index.json]. The tokenizer: `tokenizer_flag` when given, else
// the checkpoint's recorded one (an error when it is gone) or the HF directory's own files, else
// byte tokens (vocab_size must be 256).
Result<ModelSource> find_model_source(const std::string& path, const std::string& tokenizer_flag);

// The F32 weights: a checkpoint verified whole (sizes, CRC-32C) first; every tensor checked
// (names, shapes, dtypes) and finite.
Result<ModelWeights> load_weights(const ModelSource& source);

}  // namespace packmoe::generate
