// NVFP4 CPU reference quantize / dequantize (docs/formats.md, NVFP4). Every byte comes from the
// per-block functions of formats/nvfp4_math.h, which the CUDA kernels call too; SR bits follow
// the global block numbering documented in formats/nvfp4.h. Validation runs first and returns a
// Status before any memory is read or written.
#include "formats/nvfp4.h"

#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/philox.h"
#include "formats/mxfp8_math.h"  // amax_update
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

constexpr int kB = kNvfp4Block;
constexpr uint32_t kRowStream = 0;  // Philox stream of the rowwise copy's SR bits
constexpr uint32_t kColStream = 1;  // ... and of the columnwise copy's

Status error(const char* what, const std::string& msg) {
  return Status::error(std::string(what) + ": " + msg);
}

Status check_amax(const char* what, const char* name, bool on, const void* amax) {
  if (on && amax == nullptr) return error(what, std::string(name) + " is null");
  if (!on && amax != nullptr)
    return error(what, std::string(name) + " is given but its copy is not requested");
  return Status::ok();
}

// Group g as FP32 (rows, K): F32 input is used in place, BF16 widens exactly into `buf`.
const float* group_as_f32(const GroupedMatrices& in, int64_t g, std::vector<float>& buf) {
  if (in.dtype == DType::kF32) return static_cast<const float*>(in.data[g]);
  const int64_t n = in.rows[g] * in.cols;
  buf.resize(n);
  const uint16_t* src = static_cast<const uint16_t*>(in.data[g]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_f32(src[i]);
  return buf.data();
}

// NaN-ignoring amax of n values; max is order-independent, so threads cannot change it.
float amax_of(const float* x, int64_t n) {
  float amax = 0.0f;
#pragma omp parallel
  {
    float local = 0.0f;
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) local = amax_update(local, x[i]);
#pragma omp critical
    amax = amax_update(amax, local);
  }
  return amax;
}

// 16 codes -> 8 bytes, element 2j in the low nibble.
void pack16(const uint8_t codes[kB], uint8_t* dst) {
  for (int j = 0; j < kB / 2; ++j)
    dst[j] = static_cast<uint8_t>((codes[2 * j] & 0xF) | ((codes[2 * j + 1] & 0xF) << 4));
}

// Stochastic-rounding source of one copy: block b (global numbering) draws from
// philox_draw(seed, offset + b, stream).
struct SrStream {
  bool on = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint32_t stream = 0;
};

// One 16-element block: codes of xb at scale s_b, deterministic or SR.
void encode_block(const float* xb, uint8_t s_b, float s_dec, const SrStream& sr, uint64_t b,
                  uint8_t codes[kB]) {
  const float r = nvfp4_block_rcp(s_b, s_dec);
  if (sr.on) {
    const Philox4 draw = philox_draw(sr.seed, sr.offset + b, sr.stream);
    for (int j = 0; j < kB; ++j) codes[j] = nvfp4_encode_sr(xb[j], r, nvfp4_sr_byte(draw, j));
  } else {
    for (int j = 0; j < kB; ++j) codes[j] = nvfp4_encode(xb[j], r);
  }
}

// 1x16 blocks along the rows of x (rows, cols) with per-tensor amax: data (rows, cols/2),
// scale (rows, cols/16), and when bf16 is given the values without S_dec (rows, cols) BF16; data
// and scale null: the values only.
// Block (r, kb) has global number base + r*(cols/16) + kb.
void quantize_rows(const float* x, int64_t rows, int64_t cols, float amax, const SrStream& sr,
                   uint64_t base, uint8_t* data, uint8_t* scale, uint16_t* bf16) {
  const float s_enc = nvfp4_encode_scale(amax);
  const float s_dec = nvfp4_decode_scale(amax);
  const int64_t kblocks = cols / kB;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const float* xb = x + r * cols + kb * kB;
      float block_amax = 0.0f;
      for (int j = 0; j < kB; ++j) block_amax = amax_update(block_amax, xb[j]);
      const uint8_t s_b = nvfp4_block_scale(block_amax, s_enc);
      uint8_t codes[kB];
      encode_block(xb, s_b, s_dec, sr, base + static_cast<uint64_t>(r * kblocks + kb), codes);
      if (scale) scale[r * kblocks + kb] = s_b;
      if (data) pack16(codes, data + r * (cols / 2) + kb * (kB / 2));
      if (bf16)
        for (int j = 0; j < kB; ++j)
          bf16[r * cols + kb * kB + j] = f32_to_bf16(nvfp4_decode(codes[j], s_b, 1.0f));
    }
  }
}

// 2D 16x16 tiles of x (rows, K): the rowwise copy (rows, K/2) + (rows, K/16) and its exact
// transpose (K, rows/2) + (K, rows/16); either may be null.
void quantize_tiles(const float* x, int64_t rows, int64_t k, float amax, uint8_t* row_data,
                    uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale) {
  const float s_enc = nvfp4_encode_scale(amax);
  const float s_dec = nvfp4_decode_scale(amax);
  const int64_t kblocks = k / kB;
  const int64_t rblocks = rows / kB;
#pragma omp parallel for schedule(static)
  for (int64_t rb = 0; rb < rblocks; ++rb) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const float* xt = x + rb * kB * k + kb * kB;
      float tile_amax = 0.0f;
      for (int i = 0; i < kB; ++i)
        for (int j = 0; j < kB; ++j) tile_amax = amax_update(tile_amax, xt[i * k + j]);
      const uint8_t s_b = nvfp4_block_scale(tile_amax, s_enc);
      uint8_t codes[kB][kB];  // [row in tile][col in tile]
      for (int i = 0; i < kB; ++i) encode_block(xt + i * k, s_b, s_dec, SrStream{}, 0, codes[i]);
      for (int i = 0; i < kB; ++i) {
        const int64_t r = rb * kB + i;
        if (row_data) pack16(codes[i], row_data + r * (k / 2) + kb * (kB / 2));
        if (row_scale) row_scale[r * kblocks + kb] = s_b;
      }
      for (int j = 0; j < kB; ++j) {
        const int64_t c = kb * kB + j;
        uint8_t col[kB];
        for (int i = 0; i < kB; ++i) col[i] = codes[i][j];
        if (col_data) pack16(col, col_data + c * (rows / 2) + rb * (kB / 2));
        if (col_scale) col_scale[c * rblocks + rb] = s_b;
      }
    }
  }
}

// The columnwise source (K, rows): x transposed, and with RHT each run of 16 consecutive rows of
// a column replaced by rht16 of it.
void columnwise_source(const float* x, int64_t rows, int64_t k, bool rht, float* t) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < k; ++c) {
    if (!rht) {
      for (int64_t r = 0; r < rows; ++r) t[c * rows + r] = x[r * k + c];
      continue;
    }
    for (int64_t rb = 0; rb < rows / kB; ++rb) {
      float in16[kB];
      for (int i = 0; i < kB; ++i) in16[i] = x[(rb * kB + i) * k + c];
      rht16(in16, t + c * rows + rb * kB);
    }
  }
}

}  // namespace

Status validate_nvfp4(const GroupedMatrices& in, const Nvfp4Config& cfg, const Nvfp4Outputs& out) {
  const char* what = "quantize_nvfp4";
  PACKMOE_RETURN_IF_ERROR(validate_grouped_input(in, what));
  if (!cfg.rowwise && !cfg.columnwise)
    return error(what, "request at least one of the rowwise and columnwise copies");
  if (cfg.two_d && cfg.rht)
    return error(what, "2D 16x16 scaling (weights) cannot be combined with the RHT");
  if (cfg.amax != nullptr && cfg.rht)
    return error(what, "a given amax cannot be combined with the RHT (its amax is post-transform)");
  if (cfg.two_d && cfg.stochastic_rounding)
    return error(what, "2D 16x16 scaling (weights) cannot be combined with stochastic rounding");
  if (in.cols % kB != 0)
    return error(what, "K = " + std::to_string(in.cols) + " must be a multiple of 16");
  if (cfg.columnwise || cfg.two_d) {
    for (size_t g = 0; g < in.rows.size(); ++g)
      if (in.rows[g] % kB != 0)
        return error(what, "group " + std::to_string(g) + " has " + std::to_string(in.rows[g]) +
                               " rows, not a multiple of 16 (needed for columnwise or 2D blocks)");
  }
  const bool row_bytes = cfg.rowwise && !out.row_values_only();  // else kept as its values only
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(what, "row_data", row_bytes, out.row_data, in.rows));
  PACKMOE_RETURN_IF_ERROR(
      validate_copy_pointers(what, "row_scale", row_bytes, out.row_scale, in.rows));
  // With a given amax the amax outputs only echo it: they may be left null.
  if (!(cfg.amax && cfg.rowwise && out.row_amax == nullptr))
    PACKMOE_RETURN_IF_ERROR(check_amax(what, "row_amax", cfg.rowwise, out.row_amax));
  PACKMOE_RETURN_IF_ERROR(
      validate_copy_pointers(what, "col_data", cfg.columnwise, out.col_data, in.rows));
  PACKMOE_RETURN_IF_ERROR(
      validate_copy_pointers(what, "col_scale", cfg.columnwise, out.col_scale, in.rows));
  if (!(cfg.amax && cfg.columnwise && out.col_amax == nullptr))
    PACKMOE_RETURN_IF_ERROR(check_amax(what, "col_amax", cfg.columnwise, out.col_amax));
  if (!out.row_bf16.empty() && cfg.two_d)
    return error(what, "row_bf16 is for 1x16 rowwise copies, not 2D 16x16 tiles");
  PACKMOE_RETURN_IF_ERROR(validate_copy_pointers(what, "row_bf16",
                                                 cfg.rowwise && !out.row_bf16.empty(),
                                                 out.row_bf16, in.rows));
  return Status::ok();
}

Status validate_nvfp4_copy(const Nvfp4Copy& q, DType out_dtype, const std::vector<void*>& out) {
  const char* what = "dequantize_nvfp4";
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    return error(what, "output must be f32 or bf16, got " + std::string(dtype_name(out_dtype)));
  if (q.rows.empty()) return error(what, "no groups");
  if (q.cols <= 0 || q.cols % kB != 0)
    return error(
        what, "stored row length " + std::to_string(q.cols) + " must be a positive multiple of 16");
  int64_t total = 0;
  for (int64_t r : q.rows) {
    if (r < 0) return error(what, "negative row count");
    total += r;
  }
  if (total == 0) return error(what, "empty input (0 rows)");
  const size_t groups = q.rows.size();
  if (q.data.size() != groups || q.scale.size() != groups || out.size() != groups)
    return error(
        what, "data, scale and output need one pointer per group (" + std::to_string(groups) + ")");
  if (q.decode_scale == nullptr) return error(what, "decode_scale is null");
  for (size_t g = 0; g < groups; ++g)
    if (q.rows[g] > 0 && (q.data[g] == nullptr || q.scale[g] == nullptr || out[g] == nullptr))
      return error(what,
                   "group " + std::to_string(g) + " has a null data, scale or output pointer");
  return Status::ok();
}

Status quantize_nvfp4_cpu(const GroupedMatrices& in, const Nvfp4Config& cfg,
                          const Nvfp4Outputs& out) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4(in, cfg, out));
  const int64_t k = in.cols;
  float* row_amax = static_cast<float*>(out.row_amax);
  float* col_amax = static_cast<float*>(out.col_amax);
  std::vector<float> buf;  // BF16 input widened to FP32, (rows_g, K)
  std::vector<float> t;    // columnwise source, (K, rows_g)
  uint64_t base = 0;       // global number of the group's first block, same for both copies
  for (int64_t g = 0; g < in.groups(); ++g) {
    const int64_t rows = in.rows[g];
    if (rows == 0) {  // amax of nothing is 0: the slot is still written, deterministically
      const float given = cfg.amax ? cfg.amax[g] : 0.0f;
      if (row_amax) row_amax[g] = given;
      if (col_amax) col_amax[g] = given;
      continue;
    }
    const float* x = group_as_f32(in, g, buf);
    const float amax = cfg.amax ? cfg.amax[g] : amax_of(x, rows * k);
    if (row_amax) row_amax[g] = amax;
    // Null for a rowwise copy kept as its values only.
    uint8_t* row_data = out.row_data.empty() ? nullptr : static_cast<uint8_t*>(out.row_data[g]);
    uint8_t* row_scale = out.row_scale.empty() ? nullptr : static_cast<uint8_t*>(out.row_scale[g]);
    uint8_t* col_data = cfg.columnwise ? static_cast<uint8_t*>(out.col_data[g]) : nullptr;
    uint8_t* col_scale = cfg.columnwise ? static_cast<uint8_t*>(out.col_scale[g]) : nullptr;

    if (cfg.two_d) {
      quantize_tiles(x, rows, k, amax, row_data, row_scale, col_data, col_scale);
      if (col_amax) col_amax[g] = amax;
    } else {
      if (cfg.rowwise) {
        const SrStream sr{cfg.stochastic_rounding, cfg.seed, cfg.offset, kRowStream};
        uint16_t* bf16 = out.row_bf16.empty() ? nullptr : static_cast<uint16_t*>(out.row_bf16[g]);
        quantize_rows(x, rows, k, amax, sr, base, row_data, row_scale, bf16);
      }
      if (cfg.columnwise) {
        t.resize(rows * k);
        columnwise_source(x, rows, k, cfg.rht, t.data());
        // Without RHT the values are the input's, so the amax is too; with RHT it is the amax
        // of all transformed values of the group (TE's post-RHT amax).
        const float c_amax = cfg.rht ? amax_of(t.data(), rows * k) : amax;
        if (col_amax) col_amax[g] = c_amax;
        const SrStream sr{cfg.stochastic_rounding, cfg.seed, cfg.offset, kColStream};
        quantize_rows(t.data(), k, rows, c_amax, sr, base, col_data, col_scale, nullptr);
      }
    }
    base += static_cast<uint64_t>(rows * (k / kB));
  }
  return Status::ok();
}

Status validate_nvfp4_amax(const GroupedMatrices& in, const float* amax) {
  const char* what = "nvfp4_amax";
  PACKMOE_RETURN_IF_ERROR(validate_grouped_input(in, what));
  if (in.cols % kB != 0)
    return error(what, "K = " + std::to_string(in.cols) + " must be a multiple of 16");
  if (amax == nullptr) return error(what, "amax is null");
  return Status::ok();
}

Status nvfp4_amax_cpu(const GroupedMatrices& in, float* amax) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4_amax(in, amax));
  std::vector<float> buf;
  for (int64_t g = 0; g < in.groups(); ++g)
    amax[g] = in.rows[g] == 0 ? 0.0f : amax_of(group_as_f32(in, g, buf), in.rows[g] * in.cols);
  return Status::ok();
}

Status dequantize_nvfp4_cpu(const Nvfp4Copy& q, DType out_dtype, const std::vector<void*>& out) {
  PACKMOE_RETURN_IF_ERROR(validate_nvfp4_copy(q, out_dtype, out));
  const int64_t cols = q.cols;
  const float* decode_scale = static_cast<const float*>(q.decode_scale);  // (G,)
  for (size_t g = 0; g < q.rows.size(); ++g) {
    const int64_t rows = q.rows[g];
    if (rows == 0) continue;
    const float s_dec = decode_scale[g];
    const uint8_t* data = static_cast<const uint8_t*>(q.data[g]);
    const uint8_t* scale = static_cast<const uint8_t*>(q.scale[g]);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = data[r * (cols / 2) + c / 2];
        const uint8_t code = (c & 1) ? (byte >> 4) : (byte & 0xF);
        const float x = nvfp4_decode(code, scale[r * (cols / kB) + c / kB], s_dec);
        if (out_dtype == DType::kF32)
          static_cast<float*>(out[g])[r * cols + c] = x;
        else
          static_cast<uint16_t*>(out[g])[r * cols + c] = f32_to_bf16(x);
      }
    }
  }
  return Status::ok();
}

}  // namespace packmoe
