// Grouped operands: G row-major matrices that share their column count K. A packed (E, N, K)
// weight is G = E pointers at fixed offsets into one buffer; the discrete layout is E separate
// buffers. Quantizers take both through the same entry point and write the same bytes.
// Pointers address the memory of whichever backend runs the op.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace packmoe {

struct GroupedMatrices {
  DType dtype = DType::kBF16;     // kF32 or kBF16
  int64_t cols = 0;               // K
  std::vector<const void*> data;  // G pointers, group g is (rows[g], K)
  std::vector<int64_t> rows;      // G row counts; 0 is allowed

  int64_t groups() const { return static_cast<int64_t>(rows.size()); }
  int64_t total_rows() const;
};

// G pointers into one buffer, group g at byte offset g * bytes_per_group.
std::vector<void*> carve(void* base, int64_t groups, size_t bytes_per_group);
// Groups of uneven size laid one after another: pointer g at sum_{u<g} rows[u] * bytes_per_row.
std::vector<void*> carve_rows(void* base, const std::vector<int64_t>& rows, size_t bytes_per_row);

// Packed (E, N, K) as a grouped operand.
GroupedMatrices packed_groups(const void* base, DType dtype, int64_t experts, int64_t rows,
                              int64_t cols);

// A per-group output pointer list of one copy: G entries when the copy is requested (null only
// for groups with 0 rows), empty when it is not. `what` names the op, `name` the list.
Status validate_copy_pointers(const char* what, const char* name, bool requested,
                              const std::vector<void*>& ptrs, const std::vector<int64_t>& rows);

// Shared checks of the input: dtype, pointer count, non-empty, sizes. Names `what` in errors.
Status validate_grouped_input(const GroupedMatrices& in, const char* what);

}  // namespace packmoe
