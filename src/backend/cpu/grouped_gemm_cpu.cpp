// CPU reference of the grouped GEMM (backend/ops/gemm.h). Every operand is dequantized
// exactly to FP32 in its LOGICAL layout (X (m, K), dY (m, N), W (N, K)), whatever copy is stored,
// one token panel at a time, and multiplied with single-threaded OpenBLAS (FP32 accumulation) in
// fixed output tiles, OpenMP over the tiles: fprop / dgrad one sgemv per token row of a tile,
// wgrad one sgemm per tile. Invariant: a group's
// arithmetic depends only on (op, format, m_g, N, K) and its values, never on where its pointers
// live nor on the OpenMP / OpenBLAS thread counts, so packed (E, N, K) and per-expert buffers, and
// every thread setting, give the same bytes; and a token row's fprop / dgrad bits never depend on the
// other rows (batch invariance, tiled_sgemm). Token counts in "device" memory (host memory here)
// are checked and run as host counts on per-group pointers.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/codecs.h"
#include "formats/mxfp8_math.h"
#include "formats/nvfp4_math.h"

namespace packmoe {
namespace {

// Tokens per panel. The only reduction that crosses panels is wgrad's (over tokens); its order is
// fixed: panels in increasing token order, each sgemm adding its (N, K) product into one FP32
// accumulator (beta = 1 after the first), then alpha and main_grad are applied once per element.
// Whole blocks per panel, so no block straddles two panels.
constexpr int64_t kPanelRows = 256;
static_assert(kPanelRows % kMxfp8Block == 0 && kPanelRows % kNvfp4Block == 0,
              "a panel must hold whole MXFP8 and NVFP4 blocks along the tokens");

// Output tile of one sgemm call. A multi-threaded OpenBLAS call splits its output by the thread
// count and picks kernels by the split's size, so the bits would follow OPENBLAS_NUM_THREADS;
// fixed tiles, each computed whole (its full reduction) by one single-threaded call, make every
// element's arithmetic a function of the shapes alone, whichever OpenMP thread runs the tile.
constexpr int64_t kTileRows = 64;
constexpr int64_t kTileCols = 128;

// OpenBLAS runs single-threaded (the parallelism is ours), whatever OPENBLAS_NUM_THREADS or a
// caller set; checked at every GEMM so a later openblas_set_num_threads changes nothing.
void blas_single_threaded() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

// C (rows, cols) = alpha * op(A) (rows, red) . op(B) (red, cols) + beta * C, row-major, in fixed
// (kTileRows, kTileCols) tiles. A is stored (rows, red) or, trans_a, (red, rows); B (red, cols)
// or, trans_b, (cols, red).
// Batch invariance: OpenBLAS sgemm's rounding of a row depends on the call's shape and on the
// row's place in it (its micro-kernels treat rows at different offsets differently), so the same
// token could get other bits in a call of 3 rows than in one of 300. An untransposed A (fprop's X,
// dgrad's dY: one token per row) therefore runs row by row, one sgemv per (row, column tile): a
// row's result is a function of its own values, the weight and the shapes alone, whatever else
// shares the GEMM (the KV-cached decode of one token equals the whole sequence's forward,
// tests/unit/test_kv_cache.cpp). wgrad (transposed A, a reduction over tokens) stays one sgemm per
// tile.
void tiled_sgemm(bool trans_a, bool trans_b, int64_t rows, int64_t cols, int64_t red, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < row_tiles * col_tiles; ++t) {
    const int64_t i0 = (t / col_tiles) * kTileRows, j0 = (t % col_tiles) * kTileCols;
    const int64_t tr = std::min(kTileRows, rows - i0), tc = std::min(kTileCols, cols - j0);
    const float* bt = trans_b ? b + j0 * ldb : b + j0;
    if (!trans_a) {
      for (int64_t i = i0; i < i0 + tr; ++i) {
        float* out = c + i * ldc + j0;  // (tc)
        if (trans_b)  // out = B_tile (tc, red) . a_i
          cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(tc), static_cast<int>(red),
                      alpha, bt, static_cast<int>(ldb), a + i * lda, 1, beta, out, 1);
        else  // out = B_tile^T (tc, red) . a_i, B_tile stored (red, tc)
          cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<int>(red), static_cast<int>(tc),
                      alpha, bt, static_cast<int>(ldb), a + i * lda, 1, beta, out, 1);
      }
      continue;
    }
    cblas_sgemm(CblasRowMajor, CblasTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(tr), static_cast<int>(tc), static_cast<int>(red), alpha, a + i0,
                static_cast<int>(lda), bt, static_cast<int>(ldb), beta, c + i0 * ldc + j0,
                static_cast<int>(ldc));
  }
}

// Where a stored matrix's block scales run.
enum class ScaleAxis {
  kNone,       // BF16
  kAlongCols,  // (rows, cols / B): MXFP8 rowwise, every NVFP4 copy
  kAlongRows,  // (rows / 32, cols): MXFP8 columnwise (data not transposed)
};

// One operand of one group as it is stored: a row-major (rows, cols) matrix that is either the
// logical matrix itself or, for NVFP4 columnwise copies, its transpose.
struct Stored {
  OperandFormat format = OperandFormat::kBF16;
  DType element = DType::kE4M3;
  const void* data = nullptr;
  const void* scale = nullptr;
  int64_t rows = 0;  // stored shape
  int64_t cols = 0;
  ScaleAxis axis = ScaleAxis::kNone;
  bool transposed = false;  // stored (rows, cols) = logical^T
};

// The operand of group g whose LOGICAL shape is (lrows, lcols). `reduce_rows`: the GEMM reduces
// over the logical rows (dgrad's W over N, wgrad's dY and X over tokens), so blocks run down the
// columns: MXFP8 keeps the shape with columnwise scales, NVFP4 stores the transpose (table in
// backend/ops/gemm.h).
// A copy kept as its values only (GemmOperand::values_only) is read as BF16 in the stored layout;
// a copy that has both is dequantized from its bytes (the same values by definition).
Stored stored_operand(const GemmOperand& o, size_t g, int64_t lrows, int64_t lcols,
                      bool reduce_rows) {
  Stored s;
  s.format = o.format;
  s.element = o.element;
  s.rows = lrows;
  s.cols = lcols;
  switch (o.format) {
    case OperandFormat::kBF16: s.axis = ScaleAxis::kNone; break;
    case OperandFormat::kMxfp8:
      s.axis = reduce_rows ? ScaleAxis::kAlongRows : ScaleAxis::kAlongCols;
      break;
    case OperandFormat::kNvfp4:
      s.axis = ScaleAxis::kAlongCols;
      if (reduce_rows) {
        s.transposed = true;
        s.rows = lcols;
        s.cols = lrows;
      }
      break;
  }
  if (o.values_only()) {
    s.format = OperandFormat::kBF16;
    s.axis = ScaleAxis::kNone;
    s.data = o.bf16[g];
  } else {
    s.data = o.data[g];
    s.scale = o.format == OperandFormat::kBF16 ? nullptr : o.scale[g];
  }
  return s;
}

// Exact FP32 value of stored element (r, c). NVFP4 leaves out the per-tensor decode scale (it is
// alpha): e2m1 * e4m3 has at most 4 significant bits, so the product is exact.
inline float stored_value(const Stored& s, int64_t r, int64_t c) {
  switch (s.format) {
    case OperandFormat::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(s.data)[r * s.cols + c]);
    case OperandFormat::kMxfp8: {
      const uint8_t* scale = static_cast<const uint8_t*>(s.scale);
      const uint8_t code = s.axis == ScaleAxis::kAlongRows
                               ? scale[(r / kMxfp8Block) * s.cols + c]
                               : scale[r * (s.cols / kMxfp8Block) + c / kMxfp8Block];
      return mxfp8_decode(static_cast<const uint8_t*>(s.data)[r * s.cols + c], code, s.element);
    }
    case OperandFormat::kNvfp4: {
      const uint8_t byte = static_cast<const uint8_t*>(s.data)[r * (s.cols / 2) + c / 2];
      const uint8_t code = (c & 1) ? (byte >> 4) : (byte & 0xF);  // element 2j in the low nibble
      const uint8_t s_b =
          static_cast<const uint8_t*>(s.scale)[r * (s.cols / kNvfp4Block) + c / kNvfp4Block];
      return nvfp4_decode(code, s_b, 1.0f);
    }
  }
  return 0.0f;
}

// Logical rows [r0, r1) of the operand, dequantized into dst (r1 - r0, logical cols).
void dequantize_rows(const Stored& s, int64_t r0, int64_t r1, float* dst) {
  if (!s.transposed) {
    const int64_t cols = s.cols;
#pragma omp parallel for schedule(static)
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[(r - r0) * cols + c] = stored_value(s, r, c);
  } else {
    // Logical (i, j) is stored (j, i): walk stored rows so the reads are contiguous.
    const int64_t lcols = s.rows;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < lcols; ++j)
      for (int64_t i = r0; i < r1; ++i) dst[(i - r0) * lcols + j] = stored_value(s, j, i);
  }
}

// BF16 output: each FP32 result rounded once (RNE).
void round_to_bf16(const float* src, int64_t n, uint16_t* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// Sizes must fit BLAS's 32-bit int.
Status check_cpu_limits(const GroupedGemmArgs& a) {
  if (a.n > INT_MAX || a.k > INT_MAX)
    return Status::error("grouped_gemm: N = " + std::to_string(a.n) + " and K = " +
                         std::to_string(a.k) + " must fit in a 32-bit int for BLAS");
  return Status::ok();
}

}  // namespace

Status grouped_gemm_cpu(const GroupedGemmArgs& args) {
  PACKMOE_RETURN_IF_ERROR(validate_token_source(args));
  if (args.m_device != nullptr) {
    // Device memory is host memory on this backend: read the counts, check them, and run the
    // host-`m` form with per-group pointers into the packed token buffers.
    PACKMOE_RETURN_IF_ERROR(validate_packed_tokens(args));
    const int64_t* md = static_cast<const int64_t*>(args.m_device);  // (G,)
    const std::vector<int64_t> m(md, md + args.groups);
    PACKMOE_RETURN_IF_ERROR(check_device_counts(args, m));
    return grouped_gemm_cpu(expand_packed_tokens(args, m));
  }
  const std::vector<int64_t>& m = args.m;  // (G,) tokens per group
  PACKMOE_RETURN_IF_ERROR(validate_grouped_gemm(args, m));
  PACKMOE_RETURN_IF_ERROR(check_cpu_limits(args));

  blas_single_threaded();
  const int64_t n = args.n, k = args.k;
  const bool nvfp4 = args.lhs.format == OperandFormat::kNvfp4;
  const float* dec_lhs = nvfp4 ? static_cast<const float*>(args.lhs.decode_scale) : nullptr;  // (G,)
  const float* dec_rhs = nvfp4 ? static_cast<const float*>(args.rhs.decode_scale) : nullptr;  // (G,)

  std::vector<float> w;        // (N, K) the group's weight (fprop, dgrad)
  std::vector<float> a_panel;  // (P, K) X or (P, N) dY
  std::vector<float> b_panel;  // (P, K) X (wgrad)
  std::vector<float> c_panel;  // (P, N) or (P, K): output panel before BF16 rounding
  std::vector<float> acc;      // (N, K) wgrad FP32 sum over token panels

  for (size_t g = 0; g < m.size(); ++g) {
    const int64_t mg = m[g];
    // NVFP4's per-tensor decode scales multiply the finished FP32 sum once, as a native
    // block-scaled GEMM's alpha does.
    const float alpha = nvfp4 ? dec_lhs[g] * dec_rhs[g] : 1.0f;

    if (args.op == GemmOp::kWgrad) {
      const int64_t nk = n * k;
      if (mg == 0) {  // an empty sum: zeros when overwriting, main_grad untouched when accumulating
        if (!args.accumulate)
          std::memset(args.out[g], 0, dtype_bytes_for(args.out_dtype, static_cast<size_t>(nk)));
        continue;
      }
      const Stored dy = stored_operand(args.lhs, g, mg, n, /*reduce_rows=*/true);  // (m_g, N)
      const Stored x = stored_operand(args.rhs, g, mg, k, /*reduce_rows=*/true);   // (m_g, K)
      acc.resize(nk);
      for (int64_t t0 = 0; t0 < mg; t0 += kPanelRows) {
        const int64_t t1 = std::min(mg, t0 + kPanelRows), p = t1 - t0;
        a_panel.resize(p * n);
        b_panel.resize(p * k);
        dequantize_rows(dy, t0, t1, a_panel.data());
        dequantize_rows(x, t0, t1, b_panel.data());
        // acc (N, K) (+)= dY_p^T (N, p) . X_p (p, K)
        tiled_sgemm(/*trans_a=*/true, /*trans_b=*/false, n, k, p, 1.0f, a_panel.data(), n,
                    b_panel.data(), k, t0 == 0 ? 0.0f : 1.0f, acc.data(), k);
      }
      if (args.out_dtype == DType::kF32) {
        float* out = static_cast<float*>(args.out[g]);  // (N, K)
        const bool accumulate = args.accumulate;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < nk; ++i) {
          const float v = alpha * acc[i];
          out[i] = accumulate ? out[i] + v : v;
        }
      } else {
        uint16_t* out = static_cast<uint16_t*>(args.out[g]);  // (N, K)
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < nk; ++i) out[i] = f32_to_bf16(alpha * acc[i]);
      }
      continue;
    }

    if (mg == 0) continue;  // fprop / dgrad write nothing for an empty group
    // fprop: Y (m_g, N) = X (m_g, K) . W^T;  dgrad: dX (m_g, K) = dY (m_g, N) . W (N, K).
    const bool fprop = args.op == GemmOp::kFprop;
    const int64_t red = fprop ? k : n;       // reduction length
    const int64_t out_cols = fprop ? n : k;  // output row length
    const Stored lhs = stored_operand(args.lhs, g, mg, red, /*reduce_rows=*/false);
    const Stored wq = stored_operand(args.rhs, g, n, k, /*reduce_rows=*/!fprop);  // W (N, K)
    w.resize(n * k);
    dequantize_rows(wq, 0, n, w.data());
    for (int64_t t0 = 0; t0 < mg; t0 += kPanelRows) {
      const int64_t t1 = std::min(mg, t0 + kPanelRows), p = t1 - t0;
      a_panel.resize(p * red);
      dequantize_rows(lhs, t0, t1, a_panel.data());
      // F32 output goes straight into `out` (beta = 0 never reads it); BF16 via an FP32 panel.
      float* c;
      if (args.out_dtype == DType::kF32) {
        c = static_cast<float*>(args.out[g]) + t0 * out_cols;
      } else {
        c_panel.resize(p * out_cols);
        c = c_panel.data();
      }
      tiled_sgemm(/*trans_a=*/false, /*trans_b=*/fprop, p, out_cols, red, alpha, a_panel.data(),
                  red, w.data(), k, 0.0f, c, out_cols);
      if (args.out_dtype == DType::kBF16)
        round_to_bf16(c, p * out_cols, static_cast<uint16_t*>(args.out[g]) + t0 * out_cols);
    }
  }
  return Status::ok();
}

}  // namespace packmoe
