// Whole-file conversion between high-precision safetensors and MXFP8 / NVFP4 safetensors, in the
// layout of published low-precision checkpoints (docs/formats.md): every 2-D F32/BF16 tensor X
// becomes X (quantized elements), X_scale (compact block scales) and, for NVFP4, X_scale_2 (the
// per-tensor decode scale); every other tensor is copied unchanged. Outputs are written atomically.
#pragma once

#include <functional>
#include <string>

#include "backend/backend.h"
#include "core/status.h"

namespace packmoe::io {

enum class FileFormat { kMxfp8, kNvfp4 };

struct QuantizeFileOptions {
  FileFormat format = FileFormat::kMxfp8;
  bool two_d = false;               // MXFP8 32x32 / NVFP4 16x16 tiles (weights)
  DType element = DType::kE4M3;     // MXFP8 element type (kE4M3 or kE5M2)
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
