// Element type sizes and names.
#include "core/dtype.h"

#include "core/check.h"

namespace packmoe {

int dtype_bits(DType t) {
  switch (t) {
    case DType::kF32: return 32;
    case DType::kBF16: return 16;
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0:
    case DType::kU8: return 8;
    case DType::kE2M1: return 4;
    case DType::kI32: return 32;
    case DType::kI64: return 64;
  }
  PACKMOE_CHECK(false, "unknown dtype");
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kE8M0: return "e8m0";
    case DType::kE2M1: return "e2m1";
    case DType::kU8: return "u8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  PACKMOE_CHECK(false, "unknown dtype");
}

}  // namespace packmoe
