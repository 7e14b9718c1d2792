// The grouped GEMM's operand preparation on CUDA (grouped_gemm_operands.cu): per group, every
// operand becomes a 16-byte aligned row-major BF16 matrix that any implementation reads. MXFP8 and
// NVFP4 copies are dequantized EXACTLY (one fast launch per operand over all groups, or the jobs go
// to the sm_90a kernel's converter warps); misaligned BF16 values are staged into aligned scratch.
// Invariant: the values are f32_to_bf16 of mxfp8_decode, or of nvfp4_decode with S_dec = 1,
// whichever kernel writes them (docs/gemm.md, "Exactness of the BF16 operands").
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/grouped_gemm_dequant_job.h"
#include "backend/ops/gemm.h"
#include "core/status.h"

namespace packmoe::gemm_cuda {

inline constexpr uint32_t kAlignmentBytes = 16;  // what every implementation reads in place
inline constexpr size_t kScratchAlign = 256;     // every scratch matrix starts here
inline constexpr size_t kGrowQuantum = size_t{2} << 20;
static_assert(kScratchAlign % kAlignmentBytes == 0, "scratch matrices are aligned operands");

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
inline bool aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % kAlignmentBytes) == 0;
}

// A device buffer that only grows; growing waits for queued work that may still read the old one.
class GrowBuffer {
 public:
  void* get(CudaBackend& be, size_t bytes) {
    if (bytes > bytes_) {
      be.synchronize();
      if (ptr_) PACKMOE_CUDA_CHECK(cudaFree(ptr_));
      bytes_ = (bytes + kGrowQuantum - 1) / kGrowQuantum * kGrowQuantum;
      PACKMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
      grown_ = true;
    }
    return ptr_;
  }
  // True once after each growth (the caller re-initialises the contents).
  bool take_grown() { return std::exchange(grown_, false); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool grown_ = false;
};

// The stored copy an operand of `op` reads (table in backend/ops/gemm.h), as the row-major
// BF16 (rows, cols) matrix it dequantizes to. `transposed`: the NVFP4 columnwise copies, stored
// as the transpose of the logical matrix.
struct Stored {
  int64_t rows = 0, cols = 0;
  bool columnwise = false;  // MXFP8 columnwise scales
  bool transposed = false;
};

Stored stored_of(GemmOp op, OperandFormat f, bool is_lhs, int64_t m, int64_t n, int64_t k);

// One operand after preparation: per group a 16-byte aligned row-major BF16 matrix.
struct Prepared {
  std::vector<const void*> ptr;
  std::vector<Stored> shape;
};

// The per-backend buffers of operand preparation (used under the dispatcher's lock).
struct OperandScratch {
  GrowBuffer scratch;  // dequantized / staged operands and staged outputs
  GrowBuffer ones;     // (G,) 1.0f: NVFP4 decode scales for dequantizing e2m1 * e4m3 only
};

// Fills `dst` (scratch, 256-byte aligned per group at `offset`) with the BF16 form of operand `o`
// and points `out` at it: one dequantize launch for a quantized operand, per-group async copies
// for BF16 values (GemmOperand::bf16 of a quantized one included) with a misaligned pointer,
// nothing for aligned BF16 values. With `in_gemm` a quantized operand that the fast kernels can
// read is not dequantized here: its jobs go to *in_gemm for the sm_90a kernel's converter (same
// values, same scratch).
Status prepare(CudaBackend& be, OperandScratch& st, const GemmOperand& o,
               const std::vector<Stored>& shape, const std::vector<bool>& active, uint8_t* dst,
               const std::vector<size_t>& offset, Prepared& out,
               std::vector<gemm_convert::DequantJob>* in_gemm);

// One job per group of quantized operand `o` (inactive groups: no elements), BF16 out at `out`,
// begins in tiles of the fast dequantize; returns the tile count.
uint64_t dequant_jobs(const GemmOperand& o, const std::vector<Stored>& shape,
                      const std::vector<bool>& active, const std::vector<uint8_t*>& out,
                      std::vector<gemm_convert::DequantJob>& jobs);

// The persistent grid of the fast dequantize of `tiles` tiles of `kind`, and its launch on
// be.stream() over a job table in device memory (`count` jobs).
unsigned dequantize_grid(gemm_convert::DequantKind kind, uint64_t tiles);
void launch_dequantize(CudaBackend& be, gemm_convert::DequantKind kind,
                       const gemm_convert::DequantJob* table, int count, uint32_t tiles,
                       unsigned grid);

// The wgrad outputs of empty groups become +0, one launch on `s` for all of them: outs[g]
// (device table of `groups` pointers, 16-byte aligned) gets `vecs` zero 16-byte words when
// m == null (the host chose the empty groups) or m[g] == 0 (device token counts, (groups,) I64).
void launch_zero_groups(cudaStream_t s, const int64_t* m, void* const* outs, int groups,
                        int64_t vecs);

}  // namespace packmoe::gemm_cuda
