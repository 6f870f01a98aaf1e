// The losses: the table that the host code and the kernel dispatch expand,
// and each loss as a function of d = input - target.
//
// A new elementwise loss is one row here, one struct below (and, for a param that may be
// a tensor, a TakesParamPerElement line), and its row in fusedloss/losses.py (the Python
// side of the same table).
#pragma once

// X(Name, "name", "param", domain): the struct Name##Loss below, called "name"
// from Python, the name of its parameter ("": none), and the parameter's domain
// (ParamDomain in launch.h): kPositive, > 0, or kUnitInterval, from 0 to 1.
#define FUSEDLOSS_FOR_EACH_LOSS(X)                          \
  X(Mse, "mse", "", kPositive)                              \
  X(L1, "l1", "", kPositive)                                \
  X(SmoothL1, "smooth_l1", "beta", kPositive)               \
  X(Huber, "huber", "delta", kPositive)                     \
  X(PseudoHuber, "pseudo_huber", "c", kPositive)            \
  X(LogCosh, "log_cosh", "", kPositive)                     \
  X(Quantile, "quantile", "quantiles", kUnitInterval)

#ifdef __CUDACC__

#include <type_traits>

// `value` and `grad` (d loss / d input) follow PyTorch's kernels branch for
// branch, so NaN and the region boundaries land where PyTorch puts them. `Out` is the dtype
// the result is stored in: the loss's, or the wider of the gradients'.
// kParamInLossDtype: the param is rounded into the dtype the loss is computed in, as
// PyTorch rounds beta and delta; fusedloss's own losses compute in at least float32 and
// take it there, as their formulas in losses.py do.
// kGradInOwnDtype: PyTorch's CUDA backward computes each gradient in that
// gradient's dtype, seeing the other operand and beta in it (Smooth L1). For the
// others fusedloss differentiates the loss as computed, in its dtype: PyTorch's
// MSE and Huber backward reject mixed dtypes, and L1's gradient is composed by
// autograd from the promoted difference.

namespace fusedloss {

// beta or delta, and its reciprocal: a division per element would make Smooth L1
// compute-bound on 16-bit data.
template <typename T>
struct LossParam {
  T value;
  T inverse;
};

struct MseLoss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = true;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T>) { return d * d; }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T>) { return d + d; }
};

struct L1Loss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = true;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T>) { return fabs(d); }
  // torch.sgn: 0 at d == 0 and for NaN.
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T>) { return T((d > T(0)) - (d < T(0))); }
};

// beta > 0: torch.nn.functional sends beta == 0 to L1, and so does fusedloss.
struct SmoothL1Loss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = true;
  static constexpr bool kParamInLossDtype = true;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T> beta) {
    const T z = fabs(d);
    return z < beta.value ? T(0.5) * z * z * beta.inverse : z - T(0.5) * beta.value;
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T> beta) {
    return d < -beta.value ? T(-1) : (d > beta.value ? T(1) : d * beta.inverse);
  }
};

// PyTorch's huber_loss returns the input's dtype, not the promoted one.
struct HuberLoss {
  static constexpr bool kOutputHasInputDtype = true;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = true;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T> delta) {
    const T z = fabs(d);
    return z < delta.value ? T(0.5) * z * z : delta.value * (z - T(0.5) * delta.value);
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T> delta) {
    return d < -delta.value ? -delta.value : (d > delta.value ? delta.value : d);
  }
};

// The smallest normal and the largest finite value (<limits> is not among the headers the
// KernelBench files' NVRTC has).
template <typename T>
struct NormalRange;
template <>
struct NormalRange<float> {
  static constexpr float kMin = 0x1p-126f, kMax = 0x1.fffffep127f;
};
template <>
struct NormalRange<double> {
  static constexpr double kMin = 0x1p-1022, kMax = 0x1.fffffffffffffp1023;
};

// The hardware's approximations, each within an ulp or two, subnormals flushed to 0.
__device__ __forceinline__ float approximate_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float approximate_reciprocal(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float approximate_rsqrt(float x) {
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Pseudo-Huber's parts: d / root, d / (root + c) and root - c, of root = sqrt(d^2 + c^2).
template <typename T>
struct PseudoHuberParts {
  T slope, near_ratio, far;
};

// The parts where d^2 + c^2 is outside the type's normal range (or NaN), of d and c scaled by a
// power of two, exactly: a huge d keeps its finite loss and its gradient 2c * sign(d), a tiny c
// its finite gradient. Out of line: inlined into the per-element loop, this path that data
// almost never takes slows the pass.
template <typename T>
__device__ __noinline__ PseudoHuberParts<T> pseudo_huber_scaled_parts(T d, T c) {
  constexpr T kShrink = std::is_same_v<T, float> ? T(0x1p-66) : T(0x1p-514);
  const bool big = fmax(fabs(d), c) > T(1);
  const T scaled_d = d * (big ? kShrink : T(1) / kShrink), scaled_c = c * (big ? kShrink : T(1) / kShrink);
  const T root = sqrt(fma(scaled_d, scaled_d, scaled_c * scaled_c));
  return {scaled_d / root, scaled_d / (root + scaled_c), (root - scaled_c) * (big ? T(1) / kShrink : kShrink)};
}

// Where every result is stored in 16 bits (`Out`), the hardware's approximate reciprocal square
// root and reciprocal: their few ulps vanish in the rounding to 16 bits, and IEEE's operations
// would make the 16-bit pass bound by its arithmetic. Elsewhere IEEE's (the approximate ones would
// double a float32 gradient's rounding error). The usual path is computed first and replaced
// where the square is out of range, so that the loss and its gradient share it.
template <typename Out, typename T>
__device__ __forceinline__ PseudoHuberParts<T> pseudo_huber_parts(T d, T c) {
  // One fused multiply-add, spelled out: left to the compiler, the forward's pass and
  // backward's could contract d * d + c * c differently and round their gradients apart.
  const T square = fma(d, d, c * c);
  PseudoHuberParts<T> parts;
  if constexpr (std::is_same_v<T, float> && sizeof(Out) == 2) {
    // square is normal here (else replaced below), and root + c is far below float's range
    const float inverse = approximate_rsqrt(square), root = square * inverse;
    parts = {d * inverse, d * approximate_reciprocal(root + c), root - c};
  } else {
    const T root = sqrt(square);
    parts = {d / root, d / (root + c), root - c};
  }
  if (__builtin_expect(!(square >= NormalRange<T>::kMin && square <= NormalRange<T>::kMax), 0)) {
    parts = pseudo_huber_scaled_parts(d, c);
  }
  return parts;
}

// A loss and its derivative at one d (value_and_grad).
template <typename T>
struct ValueAndGrad {
  T value, grad;
};

// Diffusers' scheduled Huber and Charbonnier: 2c(sqrt(d^2 + c^2) - c), c > 0.
// Within |d| <= c it is written 2c d (d / (sqrt(d^2 + c^2) + c)), the same value
// without the cancellation that loses small d's digits.
// value_and_grad gives both from one set of parts, with the bits value and grad give: a pass
// that computes both calls the out-of-range path once per element, not twice (each call
// makes the compiler recompute d and c^2 around it).
struct PseudoHuberLoss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = false;
  template <typename T>
  __device__ __forceinline__ static T value_of(T d, T c, const PseudoHuberParts<T>& parts) {
    const T twice_c = c + c;
    return fabs(d) <= c ? twice_c * (d * parts.near_ratio) : twice_c * parts.far;
  }
  template <typename T>
  __device__ __forceinline__ static T grad_of(T c, const PseudoHuberParts<T>& parts) {
    return (c + c) * parts.slope;  // |slope| <= 1
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T> c) {
    return value_of(d, c.value, pseudo_huber_parts<Out>(d, c.value));
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T> c) {
    return grad_of(c.value, pseudo_huber_parts<Out>(d, c.value));
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static ValueAndGrad<T> value_and_grad(T d, LossParam<T> c) {
    const PseudoHuberParts<T> parts = pseudo_huber_parts<Out>(d, c.value);
    return {value_of(d, c.value, parts), grad_of(c.value, parts)};
  }
};

// log(cosh(d)): about d^2 / 2 near 0, about |d| - log 2 far from it; its derivative is tanh(d).
// In double, up to |d| = 1 it is log1p(m^2 / (2 (1 + m))) with m = expm1(|d|), which keeps small
// d's digits, and beyond, |d| + log1p(exp(-2|d|)) - log 2, which cannot overflow. In float (every
// 16-bit and float32 loss) libm's log1p, expm1 and tanh would make the loss compute-bound, so
// both the loss and its derivative come from one e = exp(-2|d|) and short polynomials, each
// fitted to within 1e-8 on its interval (below float's rounding), with s = d^2:
// - the loss: s P(s) up to |d| = 1 (P fits log(cosh(d)) / d^2); beyond, (|d| - log 2) + e R(e)
//   (R fits log1p(e) / e, e <= exp(-2)), log 2 split in two so that its rounding does not show;
// - tanh: |d| + |d| s V(s) below |d| = 0.55 (1 + s V(s) fits tanh(d) / d); beyond,
//   (1 - e) / (1 + e), where e <= 1/3 leaves 1 - e its digits.
// Where every result is stored in 16 bits (`Out`), that arithmetic would still bound the
// 16-bit pass: there e comes from the approximate exp2, 1 / (1 + e) from the approximate
// reciprocal, and the polynomials are shorter, fitted to within 2e-6 (16-bit rounding is
// 2^-12 or coarser, so the result stays within the 1 ulp of float32's formula).
struct LogCoshLoss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = false;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T>) {
    const T z = fabs(d);
    if constexpr (std::is_same_v<T, float> && sizeof(Out) == 2) {
      const float s = z * z;
      const float e = approximate_exp2(z * -2.88539008177792681f);  // exp(-2z)
      float p = 0.0010440391f;
      p = fmaf(p, s, -0.0059106196f);
      p = fmaf(p, s, 0.021949606f);
      p = fmaf(p, s, -0.08330103f);
      p = fmaf(p, s, 0.49999937f);
      float r = 0.27698672f;
      r = fmaf(r, e, -0.49580434f);
      r = fmaf(r, e, 0.9999092f);
      const float far = fmaf(e, r, z - 0.693147182464599609375f);
      return z <= 1.0f ? s * p : far;
    } else if constexpr (std::is_same_v<T, float>) {
      const float s = z * z;
      const float e = expf(-2.0f * z);
      float p = 8.65710389916785e-05f;
      p = fmaf(p, s, -5.562258884310722e-04f);
      p = fmaf(p, s, 2.077347133308649e-03f);
      p = fmaf(p, s, -6.710438057780266e-03f);
      p = fmaf(p, s, 2.221657522022724e-02f);
      p = fmaf(p, s, -8.333299309015274e-02f);
      p = fmaf(p, s, 0.5f);
      float r = -0.11960987746715546f;
      r = fmaf(r, e, 0.1933414489030838f);
      r = fmaf(r, e, -0.24954941868782043f);
      r = fmaf(r, e, 0.3333193361759186f);
      r = fmaf(r, e, -0.49999985098838806f);
      r = fmaf(r, e, 1.0f);
      const float far = ((z - 0.693147182464599609375f) + 1.9046542999577808e-09f) + e * r;
      return z <= 1.0f ? s * p : far;  // a select, not a branch: both sides are a few instructions
    } else {
      if (z <= T(1)) {
        const T m = expm1(z);
        return log1p(m * m / (T(2) * (T(1) + m)));
      }
      return z + log1p(exp(T(-2) * z)) - T(0.693147180559945309417232121458176568);
    }
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T>) {
    if constexpr (std::is_same_v<T, float> && sizeof(Out) == 2) {
      const float z = fabsf(d);
      const float s = z * z;
      const float e = approximate_exp2(z * -2.88539008177792681f);  // the loss's own e
      float v = -0.043153174f;
      v = fmaf(v, s, 0.13154617f);
      v = fmaf(v, s, -0.33324727f);
      const float near = fmaf(z * s, v, z);
      const float far = (1.0f - e) * approximate_reciprocal(1.0f + e);
      return copysignf(z < 0.55f ? near : far, d);
    } else if constexpr (std::is_same_v<T, float>) {
      const float z = fabsf(d);
      const float s = z * z;
      const float e = expf(-2.0f * z);  // the loss's own e, when both are computed
      float v = -0.006235557608306408f;
      v = fmaf(v, s, 0.021039674058556557f);
      v = fmaf(v, s, -0.053842708468437195f);
      v = fmaf(v, s, 0.13332460820674896f);
      v = fmaf(v, s, -0.3333331048488617f);
      const float near = fmaf(z * s, v, z);
      const float far = __fdividef(1.0f - e, 1.0f + e);
      return copysignf(z < 0.55f ? near : far, d);
    } else {
      return tanh(d);
    }
  }
};

// The pinball loss of quantile q (0 <= q <= 1), torch.maximum((q - 1) * e, q * e) of
// e = target - input = -d: (1 - q) d above the target, -q d below. Both branches are
// computed and compared as torch.maximum compares them, so that NaN (0 * inf included) and
// the gradient land where autograd puts them: at a tie the mean of the two slopes, 1/2 - q,
// and where they do not compare (NaN) both, 1 - 2q.
template <typename T>
struct PinballBranches {
  T above, below;
  __device__ __forceinline__ PinballBranches(T d, T q) : above((T(1) - q) * d), below(q * -d) {}
};

struct QuantileLoss {
  static constexpr bool kOutputHasInputDtype = false;
  static constexpr bool kGradInOwnDtype = false;
  static constexpr bool kParamInLossDtype = false;
  template <typename Out, typename T>
  __device__ __forceinline__ static T value(T d, LossParam<T> q) {
    const PinballBranches<T> p(d, q.value);
    return isnan(p.above) || isnan(p.below) ? p.above + p.below : (p.above > p.below ? p.above : p.below);
  }
  template <typename Out, typename T>
  __device__ __forceinline__ static T grad(T d, LossParam<T> q) {
    const PinballBranches<T> p(d, q.value);
    if (p.above > p.below) return T(1) - q.value;
    if (p.above < p.below) return -q.value;
    return p.above == p.below ? T(0.5) - q.value : T(1) - (q.value + q.value);
  }
};

// A loss as CUDA autocast computes it (these losses are on its float32 list):
// 16-bit operands read as float32, the loss and both gradients in float32,
// each gradient rounded once into its operand's dtype when stored.
template <class Loss>
struct Float32Math : Loss {};

template <class Loss>
struct IsFloat32Math : std::false_type {};
template <class Loss>
struct IsFloat32Math<Float32Math<Loss>> : std::true_type {};

// The losses whose param may differ per element (a tensor of quantiles along the last
// dimension, a c per sample), read where it lies as a weight is (Weighted::param_per_element):
// their param is not rounded into the loss's dtype and has no inverse to precompute.
// `in_domain`: the param's domain (the table's last column); NaN is in none.
template <class Loss>
struct TakesParamPerElement : std::false_type {
  static constexpr bool kTargetWhereItLies = false;
};
template <>
struct TakesParamPerElement<PseudoHuberLoss> : std::true_type {
  template <typename T>
  __device__ __forceinline__ static bool in_domain(T c) { return c > T(0); }
  static constexpr bool kTargetWhereItLies = false;
};
template <>
struct TakesParamPerElement<QuantileLoss> : std::true_type {
  template <typename T>
  __device__ __forceinline__ static bool in_domain(T q) { return q >= T(0) && q <= T(1); }
  // Several quantiles against a (..., 1) target: the weighted kernels read the target where
  // it lies (LossProblem::broadcast_target), which only this loss's compile for.
  static constexpr bool kTargetWhereItLies = true;
};
template <class Loss>
struct TakesParamPerElement<Float32Math<Loss>> : TakesParamPerElement<Loss> {};

// The losses with value_and_grad: the loss and its derivative from one computation.
template <class Loss>
struct HasValueAndGrad : std::false_type {};
template <>
struct HasValueAndGrad<PseudoHuberLoss> : std::true_type {};
template <class Loss>
struct HasValueAndGrad<Float32Math<Loss>> : HasValueAndGrad<Loss> {};

}  // namespace fusedloss

#endif  // __CUDACC__
