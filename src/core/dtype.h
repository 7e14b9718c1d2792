// Element types. E2M1 is 4 bits: two elements per byte, element 2j in the LOW nibble. A tensor's
// shape always counts elements, so bytes = numel * bits / 8 (numel of an E2M1 tensor is even).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace packmoe {

enum class DType : uint8_t {
  kF32,
  kBF16,
  kE4M3,  // FP8 s.eeee.mmm, bias 7, max 448, no Inf, NaN = s.1111.111
  kE5M2,  // FP8 s.eeeee.mm, bias 15, max 57344, IEEE-like Inf/NaN
  kE8M0,  // power-of-two scale 2^(code-127), code 255 = NaN
  kE2M1,  // FP4 s.ee.m, {0, .5, 1, 1.5, 2, 3, 4, 6}
  kU8,
  kI32,
  kI64,
};

int dtype_bits(DType t);
std::string_view dtype_name(DType t);
inline size_t dtype_bytes_for(DType t, size_t numel) { return numel * dtype_bits(t) / 8; }

}  // namespace packmoe
