// safetensors reader and writer (the huggingface/safetensors format, rules in
// docs/formats.md). A SafetensorsFile that exists has passed every check of the
// reference reader: known dtypes, overflow-free shapes, sizes matching shape x dtype, tensors
// tiling the data buffer with no hole, overlap or trailing byte, unique names. The writer emits
// what the reference Rust writer emits (order, keys, padding) and replaces its target atomically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace packmoe::io {

// Larger headers are rejected, as the reference reader does (MAX_HEADER_SIZE).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One tensor of a file. `bytes` is little-endian, row-major, and points into the owning
// SafetensorsFile. NOTE: `bytes` is only as aligned as the file made it (the reference writer
// aligns each tensor to its element size, others may not): memcpy out, never reinterpret_cast.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // as in the file, e.g. "BF16", "F8_E4M3", "U8"
  std::vector<int64_t> shape;  // element counts; [] is a scalar, a 0 anywhere means empty
  std::span<const uint8_t> bytes;

  int64_t numel() const;  // product of shape (1 for a scalar); checked not to overflow on read
};

// A whole safetensors file held in memory. Move-only: entries point into the owned buffer.
class SafetensorsFile {
 public:
  // Reads and validates `path`; every error names the path.
  static Result<SafetensorsFile> read(const std::string& path);
  // Validates the bytes of a whole file; `what_for_errors` (usually the path) starts every error.
  static Result<SafetensorsFile> parse(std::vector<uint8_t> bytes,
                                       const std::string& what_for_errors);

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // In increasing data offset order (ties, which only empty tensors can have, by name).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr if absent
  // The "__metadata__" object (string -> string); empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }  // the path / what_for_errors
  uint64_t header_bytes() const { return header_bytes_; }  // N, the JSON length incl. padding

 private:
  SafetensorsFile() = default;

  std::vector<uint8_t> file_;  // the whole file; entries_[i].bytes point into it
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
  std::string source_;
  uint64_t header_bytes_ = 0;
};

// Collects tensors, then serializes them the way the reference writer (safetensors >= 0.6
// `serialize`) does: data sorted by dtype alignment descending then by name, laid out back to back
// so each tensor starts at a multiple of its element size; header keys "__metadata__" first (its
// keys sorted), then tensors in data order, each as {"dtype","shape","data_offsets"}; compact JSON
// padded with spaces to a multiple of 8 bytes. Arguments are checked by serialize()/write(), which
// return an error naming the offending tensor (unknown dtype, byte count not shape x dtype,
// negative dimension, duplicate name, the reserved name "__metadata__", invalid UTF-8).
class SafetensorsWriter {
 public:
  void add(std::string name, std::string_view dtype, std::vector<int64_t> shape,
           std::vector<uint8_t> bytes);
  void add(std::string name, std::string_view dtype, std::vector<int64_t> shape,
           std::span<const uint8_t> bytes);  // copies
  void set_metadata(std::string key, std::string value);  // a later value for a key wins
  size_t size() const { return tensors_.size(); }

  // The complete file in memory.
  Result<std::vector<uint8_t>> serialize() const;
  // Writes `path` atomically: a temporary file in the same directory, fsync, rename over `path`,
  // then (best effort) fsync of the directory. On any failure the temporary file is removed and
  // `path` is untouched. Files are created with mode 0666 & ~umask.
  Status write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  // Validates, then returns the padded header and the tensor order of the data buffer.
  Status prepare(const std::string& what, std::string* header, std::vector<size_t>* order) const;

  std::vector<Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// DType <-> safetensors dtype string. Every DType has a string (E2M1 is "F4", two elements per
// byte, element 2j in the low nibble), so dtype_to_safetensors cannot fail. The reverse fails for
// strings packmoe has no DType for (e.g. "F16", "BOOL") with "unsupported safetensors dtype F16";
// callers add the tensor and file names. NOTE: published NVFP4 checkpoints store packed E2M1 as
// "U8" with the last dimension halved; that maps to kU8 here and is reinterpreted by the caller.
std::string_view dtype_to_safetensors(DType t);
Result<DType> dtype_from_safetensors(std::string_view dtype);

// Bits per element of every dtype the reference library knows (BOOL, U8 ... F64, F8_*, F4, F6_*,
// C64); 0 for an unknown string.
size_t safetensors_dtype_bits(std::string_view dtype);

}  // namespace packmoe::io
