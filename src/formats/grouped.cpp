// Grouped operand helpers.
#include "formats/grouped.h"

#include <string>

namespace packmoe {

int64_t GroupedMatrices::total_rows() const {
  int64_t n = 0;
  for (int64_t r : rows) n += r;
  return n;
}

std::vector<void*> carve(void* base, int64_t groups, size_t bytes_per_group) {
  std::vector<void*> out(groups);
  for (int64_t g = 0; g < groups; ++g) out[g] = static_cast<uint8_t*>(base) + g * bytes_per_group;
  return out;
}

std::vector<void*> carve_rows(void* base, const std::vector<int64_t>& rows, size_t bytes_per_row) {
  std::vector<void*> out(rows.size());
  size_t offset = 0;
  for (size_t g = 0; g < rows.size(); ++g) {
    out[g] = static_cast<uint8_t*>(base) + offset;
    offset += rows[g] * bytes_per_row;
  }
  return out;
}

GroupedMatrices packed_groups(const void* base, DType dtype, int64_t experts, int64_t rows,
                              int64_t cols) {
  GroupedMatrices g;
  g.dtype = dtype;
  g.cols = cols;
  g.rows.assign(experts, rows);
  size_t bytes = dtype_bytes_for(dtype, rows * cols);
  for (void* p : carve(const_cast<void*>(base), experts, bytes)) g.data.push_back(p);
  return g;
}

Status validate_grouped_input(const GroupedMatrices& in, const char* what) {
  if (in.dtype != DType::kF32 && in.dtype != DType::kBF16)
    return Status::error(std::string(what) + ": input must be f32 or bf16, got " +
                         std::string(dtype_name(in.dtype)));
  if (in.rows.empty()) return Status::error(std::string(what) + ": no groups");
  if (in.data.size() != in.rows.size())
    return Status::error(std::string(what) + ": " + std::to_string(in.data.size()) +
                         " pointers for " + std::to_string(in.rows.size()) + " groups");
  if (in.cols <= 0) return Status::error(std::string(what) + ": K must be positive");
  for (size_t g = 0; g < in.rows.size(); ++g) {
    if (in.rows[g] < 0) return Status::error(std::string(what) + ": negative row count");
    if (in.rows[g] > 0 && in.data[g] == nullptr)
      return Status::error(std::string(what) + ": group " + std::to_string(g) + " has no data");
  }
  if (in.total_rows() == 0) return Status::error(std::string(what) + ": empty input (0 rows)");
  return Status::ok();
}

Status validate_copy_pointers(const char* what, const char* name, bool requested,
                              const std::vector<void*>& ptrs, const std::vector<int64_t>& rows) {
  const std::string prefix = std::string(what) + ": " + name;
  if (!requested) {
    if (!ptrs.empty()) return Status::error(prefix + " is given but its copy is not requested");
    return Status::ok();
  }
  if (ptrs.size() != rows.size())
    return Status::error(prefix + " has " + std::to_string(ptrs.size()) + " pointers for " +
                         std::to_string(rows.size()) + " groups");
  for (size_t g = 0; g < rows.size(); ++g)
    if (rows[g] > 0 && ptrs[g] == nullptr)
      return Status::error(prefix + " of group " + std::to_string(g) + " is null");
  return Status::ok();
}

}  // namespace packmoe
