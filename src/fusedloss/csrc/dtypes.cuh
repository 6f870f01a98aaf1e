// Storage types, the type the math is done in, and the conversions between
// them. Each conversion rounds once, to nearest even. Host code uses them too
// (beta and delta are rounded to the loss dtype before the launch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace fusedloss {

// fp32 math for every 16- and 32-bit pair; fp64 only when the data is fp64.
template <typename In, typename Tgt>
using opmath_t = std::conditional_t<std::is_same_v<In, double> || std::is_same_v<Tgt, double>,
                                    double, float>;

// torch.promote_types over the pairs the kernels take (fp64 comes only paired
// with fp64; mixed 16-bit pairs and pairs with fp32 promote to fp32).
template <typename A, typename B>
struct Promote { using type = float; };
template <typename A>
struct Promote<A, A> { using type = A; };

__host__ __device__ __forceinline__ float to_opmath(float x) { return x; }
__host__ __device__ __forceinline__ float to_opmath(__half x) { return __half2float(x); }
__host__ __device__ __forceinline__ float to_opmath(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ __forceinline__ double to_opmath(double x) { return x; }

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  __host__ __device__ __forceinline__ static float from(float x) { return x; }
  __host__ __device__ __forceinline__ static float from(double x) { return static_cast<float>(x); }
};
template <>
struct Convert<double> {
  __host__ __device__ __forceinline__ static double from(double x) { return x; }
};
template <>
struct Convert<__half> {
  __host__ __device__ __forceinline__ static __half from(float x) { return __float2half_rn(x); }
  __host__ __device__ __forceinline__ static __half from(double x) { return __double2half(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  __host__ __device__ __forceinline__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
  __host__ __device__ __forceinline__ static __nv_bfloat16 from(double x) { return __double2bfloat16(x); }
};

// x as PyTorch's fp16 kernels hold the difference input - target: rounded to
// fp16, where it can overflow to inf (they do the rest in fp32). For other loss
// dtypes x is kept; fusedloss rounds once, at the end.
template <typename LossDtype, typename T>
__host__ __device__ __forceinline__ T fp16_intermediate(T x) {
  if constexpr (std::is_same_v<LossDtype, __half>) {
    return to_opmath(Convert<__half>::from(x));
  } else {
    return x;
  }
}

}  // namespace fusedloss
