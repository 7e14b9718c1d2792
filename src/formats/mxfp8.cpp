// MXFP8 CPU reference quantize / dequantize (docs/formats.md, MXFP8). Every byte comes from the
// per-block functions of formats/mxfp8_math.h, which the CUDA kernels call too. Validation runs
// first and returns a Status before any memory is read or written.
#include "formats/mxfp8.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "formats/mxfp8_math.h"

namespace packmoe {
namespace {

constexpr int kB = kMxfp8Block;

Status error(const char* what, const std::string& msg) {
  return Status::error(std::string(what) + ": " + msg);
}

Status check_element(const char* what, DType element) {
  if (element != DType::kE4M3 && element != DType::kE5M2)
    return error(what,
                 "element type must be e4m3 or e5m2, got " + std::string(dtype_name(element)));
  return Status::ok();
}

// Row r of group g as FP32 (BF16 widens exactly). `tmp` holds K floats.
const float* load_row(const GroupedMatrices& in, int64_t g, int64_t r, float* tmp) {
  const int64_t k = in.cols;
  if (in.dtype == DType::kF32) return static_cast<const float*>(in.data[g]) + r * k;
  const uint16_t* src = static_cast<const uint16_t*>(in.data[g]) + r * k;
  for (int64_t c = 0; c < k; ++c) tmp[c] = bf16_to_f32(src[c]);
  return tmp;
}

// 32 rows (rb*32 .. rb*32+31) of group g as FP32 into `tile` (32, K).
void load_rows32(const GroupedMatrices& in, int64_t g, int64_t rb, float* tile) {
  const int64_t k = in.cols;
  for (int64_t i = 0; i < kB; ++i) {
    float* dst = tile + i * k;
    const float* src = load_row(in, g, rb * kB + i, dst);
    if (src != dst) std::memcpy(dst, src, k * sizeof(float));
  }
}

// Rowwise 1x32 blocks of one row: codes into scale (K/32), bytes into data (K).
void quantize_row(const float* x, int64_t k, DType element, uint8_t* data, uint8_t* scale) {
  for (int64_t kb = 0; kb < k / kB; ++kb) {
    const float* xb = x + kb * kB;
    float amax = 0.0f;
    for (int i = 0; i < kB; ++i) amax = amax_update(amax, xb[i]);
    const uint8_t code = mxfp8_scale_code(amax, element);
    const float q = e8m0_reciprocal(code);
    scale[kb] = code;
    for (int i = 0; i < kB; ++i) data[kb * kB + i] = mxfp8_encode(xb[i], q, element);
  }
}

// Columnwise 32x1 blocks of a (32, K) tile: codes into scale (K), bytes into data (32, K).
void quantize_cols(const float* tile, int64_t k, DType element, uint8_t* data, uint8_t* scale) {
  for (int64_t c = 0; c < k; ++c) {
    float amax = 0.0f;
    for (int i = 0; i < kB; ++i) amax = amax_update(amax, tile[i * k + c]);
    const uint8_t code = mxfp8_scale_code(amax, element);
    const float q = e8m0_reciprocal(code);
    scale[c] = code;
    for (int i = 0; i < kB; ++i) data[i * k + c] = mxfp8_encode(tile[i * k + c], q, element);
  }
}

// 2D: one code per 32x32 tile of a (32, K) row band. Writes the codes into both scale layouts
// and the (identical) bytes into both data copies that are requested.
void quantize_tiles(const float* tile, int64_t k, DType element, uint8_t* row_data,
                    uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale) {
  const int64_t kblocks = k / kB;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    float amax = 0.0f;
    for (int i = 0; i < kB; ++i)
      for (int j = 0; j < kB; ++j) amax = amax_update(amax, tile[i * k + kb * kB + j]);
    const uint8_t code = mxfp8_scale_code(amax, element);
    const float q = e8m0_reciprocal(code);
    for (int i = 0; i < kB; ++i) {
      if (row_scale) row_scale[i * kblocks + kb] = code;
      for (int j = 0; j < kB; ++j) {
        const int64_t idx = i * k + kb * kB + j;
        const uint8_t v = mxfp8_encode(tile[idx], q, element);
        if (row_data) row_data[idx] = v;
        if (col_data) col_data[idx] = v;
      }
    }
    if (col_scale)
      for (int j = 0; j < kB; ++j) col_scale[kb * kB + j] = code;
  }
}

}  // namespace

Status validate_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out) {
  const char* what = "quantize_mxfp8";
  PACKMOE_RETURN_IF_ERROR(validate_grouped_input(in, what));
  PACKMOE_RETURN_IF_ERROR(check_element(what, cfg.element));
  if (!cfg.rowwise && !cfg.columnwise)
    return error(what, "request at least one of the rowwise and columnwise copies");
  if ((cfg.rowwise || cfg.two_d) && in.cols % kB != 0)
    return error(what, "K = " + std::to_string(in.cols) +
                           " must be a multiple of 32 for rowwise or 2D blocks");
  if (cfg.columnwise || cfg.two_d) {
    for (size_t g = 0; g < in.rows.size(); ++g)
      if (in.rows[g] % kB != 0)
        return error(what, "group " + std::to_string(g) + " has " + std::to_string(in.rows[g]) +
                               " rows, not a multiple of 32 (needed for columnwise or 2D blocks)");
  }
  // A copy kept as its values only has neither data nor scale pointers.
  const bool row_bytes = cfg.rowwise && !out.row_values_only();
  const bool col_bytes = cfg.columnwise && !out.col_values_only();
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(what, "row_data", row_bytes, out.row_data, in.rows));
  PACKMOE_RETURN_IF_ERROR(
      validate_copy_pointers(what, "row_scale", row_bytes, out.row_scale, in.rows));
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(what, "col_data", col_bytes, out.col_data, in.rows));
  PACKMOE_RETURN_IF_ERROR(
      validate_copy_pointers(what, "col_scale", col_bytes, out.col_scale, in.rows));
  if (cfg.two_d && !(out.row_bf16.empty() && out.col_bf16.empty()))
    return error(what, "BF16 values are for 1D copies, not 2D 32x32 tiles");
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(
      what, "row_bf16", cfg.rowwise && !out.row_bf16.empty(), out.row_bf16, in.rows));
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(
      what, "col_bf16", cfg.columnwise && !out.col_bf16.empty(), out.col_bf16, in.rows));
  return Status::ok();
}

Status validate_mxfp8_copy(const Mxfp8Copy& q, DType out_dtype, const std::vector<void*>& out) {
  const char* what = "dequantize_mxfp8";
  PACKMOE_RETURN_IF_ERROR(check_element(what, q.element));
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    return error(what, "output must be f32 or bf16, got " + std::string(dtype_name(out_dtype)));
  if (q.rows.empty()) return error(what, "no groups");
  if (q.cols <= 0) return error(what, "K must be positive");
  int64_t total = 0;
  for (size_t g = 0; g < q.rows.size(); ++g) {
    if (q.rows[g] < 0) return error(what, "negative row count");
    total += q.rows[g];
  }
  if (total == 0) return error(what, "empty input (0 rows)");
  if (!q.columnwise && q.cols % kB != 0)
    return error(what,
                 "K = " + std::to_string(q.cols) + " must be a multiple of 32 (rowwise scales)");
  if (q.columnwise)
    for (size_t g = 0; g < q.rows.size(); ++g)
      if (q.rows[g] % kB != 0)
        return error(what, "group " + std::to_string(g) + " has " + std::to_string(q.rows[g]) +
                               " rows, not a multiple of 32 (columnwise scales)");
  const size_t groups = q.rows.size();
  if (q.data.size() != groups || q.scale.size() != groups || out.size() != groups)
    return error(
        what, "data, scale and output need one pointer per group (" + std::to_string(groups) + ")");
  for (size_t g = 0; g < groups; ++g)
    if (q.rows[g] > 0 && (q.data[g] == nullptr || q.scale[g] == nullptr || out[g] == nullptr))
      return error(what,
                   "group " + std::to_string(g) + " has a null data, scale or output pointer");
  return Status::ok();
}

Status quantize_mxfp8_cpu(const GroupedMatrices& in, const Mxfp8Config& cfg,
                          const Mxfp8Outputs& given) {
  PACKMOE_RETURN_IF_ERROR(validate_mxfp8(in, cfg, given));
  // A copy kept as its values only is quantized into host scratch, then its values are written.
  std::vector<std::vector<uint8_t>> scratch;
  Mxfp8Outputs out = given;
  auto fill = [&](std::vector<void*>& ptrs, int64_t divisor) {  // rows * K / divisor bytes
    for (int64_t rows : in.rows)
      ptrs.push_back(scratch.emplace_back(std::max<int64_t>(rows * in.cols / divisor, 1)).data());
  };
  if (cfg.rowwise && given.row_values_only()) {
    fill(out.row_data, 1);
    fill(out.row_scale, kB);  // (rows, K/32)
  }
  if (cfg.columnwise && given.col_values_only()) {
    fill(out.col_data, 1);
    fill(out.col_scale, kB);  // (rows/32, K)
  }
  const int64_t k = in.cols;
  const DType el = cfg.element;
  for (int64_t g = 0; g < in.groups(); ++g) {
    const int64_t rows = in.rows[g];
    if (rows == 0) continue;
    uint8_t* row_data = cfg.rowwise ? static_cast<uint8_t*>(out.row_data[g]) : nullptr;
    uint8_t* row_scale = cfg.rowwise ? static_cast<uint8_t*>(out.row_scale[g]) : nullptr;
    uint8_t* col_data = cfg.columnwise ? static_cast<uint8_t*>(out.col_data[g]) : nullptr;
    uint8_t* col_scale = cfg.columnwise ? static_cast<uint8_t*>(out.col_scale[g]) : nullptr;

    if (cfg.two_d) {
      // (rows/32) row bands of 32x32 tiles.
#pragma omp parallel
      {
        std::vector<float> tile(kB * k);  // (32, K)
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < rows / kB; ++rb) {
          load_rows32(in, g, rb, tile.data());
          const int64_t r0 = rb * kB;
          quantize_tiles(tile.data(), k, el, row_data ? row_data + r0 * k : nullptr,
                         row_scale ? row_scale + r0 * (k / kB) : nullptr,
                         col_data ? col_data + r0 * k : nullptr,
                         col_scale ? col_scale + rb * k : nullptr);
        }
      }
      continue;
    }
    if (cfg.rowwise) {
#pragma omp parallel
      {
        std::vector<float> tmp(k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
          quantize_row(load_row(in, g, r, tmp.data()), k, el, row_data + r * k,
                       row_scale + r * (k / kB));
      }
    }
    if (cfg.columnwise) {
#pragma omp parallel
      {
        std::vector<float> tile(kB * k);  // (32, K)
#pragma omp for schedule(static)
        for (int64_t rb = 0; rb < rows / kB; ++rb) {
          load_rows32(in, g, rb, tile.data());
          quantize_cols(tile.data(), k, el, col_data + rb * kB * k, col_scale + rb * k);
        }
      }
    }
  }
  // The BF16 values of the copies just written, by the dequantize's own definition.
  if (in.total_rows() == 0) return Status::ok();
  if (!out.row_bf16.empty())
    PACKMOE_RETURN_IF_ERROR(
        dequantize_mxfp8_cpu(mxfp8_copy_of(in, el, false, out), DType::kBF16, out.row_bf16));
  if (!out.col_bf16.empty())
    PACKMOE_RETURN_IF_ERROR(
        dequantize_mxfp8_cpu(mxfp8_copy_of(in, el, true, out), DType::kBF16, out.col_bf16));
  return Status::ok();
}

Mxfp8Copy mxfp8_copy_of(const GroupedMatrices& in, DType element, bool columnwise,
                        const Mxfp8Outputs& out) {
  const std::vector<void*>& data = columnwise ? out.col_data : out.row_data;
  const std::vector<void*>& scale = columnwise ? out.col_scale : out.row_scale;
  Mxfp8Copy q;
  q.element = element;
  q.columnwise = columnwise;
  q.cols = in.cols;
  q.rows = in.rows;
  q.data.assign(data.begin(), data.end());
  q.scale.assign(scale.begin(), scale.end());
  return q;
}

Status dequantize_mxfp8_cpu(const Mxfp8Copy& q, DType out_dtype, const std::vector<void*>& out) {
  PACKMOE_RETURN_IF_ERROR(validate_mxfp8_copy(q, out_dtype, out));
  const int64_t k = q.cols;
  for (size_t g = 0; g < q.rows.size(); ++g) {
    const int64_t rows = q.rows[g];
    if (rows == 0) continue;
    const uint8_t* data = static_cast<const uint8_t*>(q.data[g]);
    const uint8_t* scale = static_cast<const uint8_t*>(q.scale[g]);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        // rowwise scale (rows, K/32); columnwise scale (rows/32, K)
        const uint8_t code = q.columnwise ? scale[(r / kB) * k + c] : scale[r * (k / kB) + c / kB];
        const float x = mxfp8_decode(data[r * k + c], code, q.element);
        if (out_dtype == DType::kF32)
          static_cast<float*>(out[g])[r * k + c] = x;
        else
          static_cast<uint16_t*>(out[g])[r * k + c] = f32_to_bf16(x);
      }
    }
  }
  return Status::ok();
}

}  // namespace packmoe
