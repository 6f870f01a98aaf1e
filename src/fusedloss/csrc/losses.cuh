// The four losses as functions of d = input - target. `value` and `grad`
// (d loss / d input) follow PyTorch's kernels branch for branch, so NaN and the
// region boundaries land where PyTorch puts them.
#pragma once

namespace fusedloss {

struct MseLoss {
  static constexpr bool kOutputHasInputDtype = false;
  template <typename T>
  __device__ __forceinline__ static T value(T d, T) { return d * d; }
  template <typename T>
  __device__ __forceinline__ static T grad(T d, T) { return d + d; }
};

struct L1Loss {
  static constexpr bool kOutputHasInputDtype = false;
  template <typename T>
  __device__ __forceinline__ static T value(T d, T) { return fabs(d); }
  // torch.sgn: 0 at d == 0 and for NaN.
  template <typename T>
  __device__ __forceinline__ static T grad(T d, T) { return T((d > T(0)) - (d < T(0))); }
};

// beta > 0: torch.nn.functional sends beta == 0 to L1, and so does fusedloss.
struct SmoothL1Loss {
  static constexpr bool kOutputHasInputDtype = false;
  template <typename T>
  __device__ __forceinline__ static T value(T d, T beta) {
    const T z = fabs(d);
    return z < beta ? T(0.5) * z * z / beta : z - T(0.5) * beta;
  }
  template <typename T>
  __device__ __forceinline__ static T grad(T d, T beta) {
    return d < -beta ? T(-1) : (d > beta ? T(1) : d / beta);
  }
};

// PyTorch's huber_loss returns the input's dtype, not the promoted one.
struct HuberLoss {
  static constexpr bool kOutputHasInputDtype = true;
  template <typename T>
  __device__ __forceinline__ static T value(T d, T delta) {
    const T z = fabs(d);
    return z < delta ? T(0.5) * z * z : delta * (z - T(0.5) * delta);
  }
  template <typename T>
  __device__ __forceinline__ static T grad(T d, T delta) {
    return d < -delta ? -delta : (d > delta ? delta : d);
  }
};

}  // namespace fusedloss
