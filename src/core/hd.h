// Host/device function qualifiers, so scalar code (codecs, Philox) is ONE source shared by the
// CPU reference and the CUDA kernels. Without nvcc the macro is empty and no CUDA header is seen.
#pragma once

#if defined(__CUDACC__)
#define PACKMOE_HD __host__ __device__ __forceinline__
#else
#define PACKMOE_HD inline
#endif

// Unrolls a fixed-count loop over a register array in device code (the host compiler ignores it).
#if defined(__CUDA_ARCH__)
#define PACKMOE_UNROLL _Pragma("unroll")
#else
#define PACKMOE_UNROLL
#endif
