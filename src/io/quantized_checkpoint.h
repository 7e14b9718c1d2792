// Whole-file conversion between high-precision safetensors and MXFP8 / NVFP4 safetensors, in the
// layout of published low-precision checkpoints (docs/formats.md): every 2-D F32/BF16 tensor X
// becomes X (quantized elements), X_scale (compact block scales) and, for NVFP4, X_scale_2 (the
// per-tensor decode scale); every other tensor is copied unchanged. Outputs are written atomically.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"

namespace packmoe::io {

enum class FileFormat { kMxfp8, kNvfp4 };

struct QuantizeFileOptions {
  FileFormat format = FileFormat::kMxfp8;
  // MXFP8 32x32 / NVFP4 16x16 tiles (weights); a tensor whose rows are no multiple of the tile
  // falls back to 1-D blocks (1x32 / 1x16; its scale layout is the same), named in the metadata
  // key packmoe.block_1d and in `fallbacks`.
  bool two_d = false;
  DType element = DType::kE4M3;     // MXFP8 element type (kE4M3 or kE5M2)
  // Tensors (by name) copied unchanged although 2-D floating point; null: none.
  std::function<bool(const std::string&)> exclude;
  std::vector<std::string>* fallbacks = nullptr;  // when set: the tensors that fell back to 1-D
};

// Called once per tensor before it is converted: (index from 1, count, name).
using Progress = std::function<void(size_t, size_t, const std::string&)>;

Status quantize_file(const std::string& in_path, const std::string& out_path,
                     const QuantizeFileOptions& options, Backend& backend,
                     const Progress& progress = {});

// Inverse: every X with an X_scale (and X_scale_2 for NVFP4) is dequantized to `out_dtype`
// (kF32 or kBF16); other tensors are copied unchanged.
Status dequantize_file(const std::string& in_path, const std::string& out_path, DType out_dtype,
                       Backend& backend, const Progress& progress = {});

}  // namespace packmoe::io
