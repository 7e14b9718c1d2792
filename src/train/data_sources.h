// The data of a run from its --data / --valid-data value: one source ("fortunes", "text:PATH",
// "megatron:PREFIX", "llmc:SHARD") or a blend of several, separated by spaces or commas, each
// after a weight ("0.7 megatron:a 0.3 megatron:b") or none ("megatron:a megatron:b": each
// weighs its samples, a concatenation). Each source is split into a training and a validation
// side (io/data_split.h), so every source contributes to validation. Invariant: token files
// stay memory-mapped (read row by row by the sampler); text is read into memory.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "tokenize/tokenizer.h"
#include "train/batch_sampler.h"

namespace packmoe::train {

struct DataSpec {
  std::vector<std::string> sources;  // each "kind:PATH" or "fortunes"
  std::vector<double> weights;       // (sources) > 0, or empty
};

// Errors, naming `flag` and the value: empty, a weighted list not in pairs, a weight that is not
// positive, weights on some sources only.
Result<DataSpec> parse_data_spec(const std::string& value, const char* flag);

struct LoadedData {
  DataBlend train, validation;  // the same sources, weights and order on both sides
  std::string description;      // for the run's summary line
};

// Reads (maps) every source and splits each by `valid_fraction` (0: all of it trains, and the
// validation blend's sources are empty). Errors name the file; an unknown kind names the forms.
// With a tokenizer, text sources (text:, fortunes) are encoded with it, each document followed by
// its eos; token files are read as they are.
Result<LoadedData> load_data(const DataSpec& spec, const char* flag, double valid_fraction,
                             const tokenize::Tokenizer* tokenizer = nullptr);
Result<LoadedData> load_data(const std::string& value, const char* flag, double valid_fraction,
                             const tokenize::Tokenizer* tokenizer = nullptr);

}  // namespace packmoe::train
