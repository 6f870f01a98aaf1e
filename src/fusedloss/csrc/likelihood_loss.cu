// The Gaussian and Poisson negative log-likelihoods (likelihood.h): a mean or sum in one
// pass that also writes the operands' gradients for the grad_output expected, and the
// backward that recomputes them in place where grad_output is another; the loss per element
// (reduction='none') in one pass, and its backward for a grad_output per element in another.
// Every operand has the loss's dtype and shape; the math is float32 (float64 for float64
// operands).
#include <cmath>
#include <type_traits>

#include "dispatch.cuh"
#include "kernels.cuh"
#include "likelihood.h"

FUSEDLOSS_KERNELS_BEGIN

namespace {

// One element's loss and its derivatives in input, target and var.
template <typename T>
struct LikelihoodTerms {
  T loss, d_input, d_target, d_var;
};

__device__ __forceinline__ float approximate_log2(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 1 / x and log(x), or, with kApprox, the hardware's approximations, each within an ulp or
// two of float32: for results stored in 16 bits, whose rounding hides that, and whose passes
// IEEE's division and logarithm would make bound by arithmetic. They flush a subnormal x to 0,
// so such an x (a subnormal eps) takes IEEE's.
template <bool kApprox, typename T>
__device__ __forceinline__ T reciprocal(T x) {
  if constexpr (kApprox) {
    if (__builtin_expect(x > T(0) && x < NormalRange<float>::kMin, 0)) return T(1) / x;
    return approximate_reciprocal(x);
  } else {
    return T(1) / x;
  }
}
template <bool kApprox, typename T>
__device__ __forceinline__ T logarithm(T x) {
  if constexpr (kApprox) {
    if (__builtin_expect(x > T(0) && x < NormalRange<float>::kMin, 0)) return log(x);
    return approximate_log2(x) * 0.693147180559945309f;
  } else {
    return log(x);
  }
}

// PyTorch's formulas: for the Gaussian, var clamped at eps (the clamp passes var's gradient
// through, as PyTorch's does), a negative var NaN (likelihood.py reports it so, where PyTorch's
// check would wait for the GPU) and NaN kept; for the Poisson loss of a log rate,
// exp(input) - target input; of a rate, input - target log(input + eps); with kStirling (the
// Poisson loss's `full`), plus target log(target) - target + log(2 pi target) / 2 where target
// > 1 (NaN kept), whose derivative in target is log(target) + 1 / (2 target); as PyTorch's
// gradient has it, NaN at an infinite target (its product rule's inf / inf, where the loss is
// NaN too) and at a target <= 0 (the masked term's zero gradient times log(target)). A gradient's
// product and sum are one fma, written out: left to the compiler, the forward's pass and
// backward's could contract them differently, and a gradient predicted in the forward would
// not have the bits of one computed in backward.
template <bool kApprox, typename T>
__device__ __forceinline__ void add_stirling(LikelihoodTerms<T>& terms, T t) {
  if (t <= T(1)) {
    if (t <= T(0)) terms.d_target = T(NAN);
    return;
  }
  const T log_t = logarithm<kApprox>(t);
  // log(2 pi target) / 2 from log(target): one logarithm an element
  terms.loss += t * log_t - t + fma(T(0.5), log_t, T(0.91893853320467274178));
  terms.d_target = t == T(INFINITY) ? T(NAN) : fma(T(0.5), reciprocal<kApprox>(t), log_t + terms.d_target);
}

template <Likelihood kKind, bool kApprox, bool kStirling, typename T>
__device__ __forceinline__ LikelihoodTerms<T> likelihood_terms(T p, T t, T var, T eps, T constant) {
  if constexpr (kKind == Likelihood::kGaussian) {
    const T v = var < T(0) ? T(NAN) : (var < eps ? eps : var);
    const T d = p - t;
    const T inverse = reciprocal<kApprox>(v);
    const T q = kApprox ? d * inverse : d / v;
    return {T(0.5) * (logarithm<kApprox>(v) + d * q) + constant, q, -q, T(0.5) * fma(-q, q, inverse)};
  } else if constexpr (kKind == Likelihood::kPoissonLogRate) {
    // exp2 of a product rounded once: within a few ulps of float32, below 16-bit rounding
    const T rate = kApprox ? approximate_exp2(p * 1.44269504088896341f) : exp(p);
    LikelihoodTerms<T> terms{rate - t * p, rate - t, -p, T(0)};
    if constexpr (kStirling) add_stirling<kApprox>(terms, t);
    return terms;
  } else {
    const T shifted = p + eps;
    const T log_shifted = logarithm<kApprox>(shifted);
    LikelihoodTerms<T> terms{p - t * log_shifted,
                             kApprox ? fma(-t, reciprocal<kApprox>(shifted), T(1)) : T(1) - t / shifted, -log_shifted,
                             T(0)};
    if constexpr (kStirling) add_stirling<kApprox>(terms, t);
    return terms;
  }
}

// The tile walk's op (elementwise.cuh): the loss summed (kForward) and each gradient whose
// pointer is set, times `factor` (the reduction's scale times grad_output), rounded once;
// with kPointwise, the loss per element times `factor` (the scale) into `loss_out`
// (kForward), or each gradient times `factor` times the element's grad_output.
template <Likelihood kKind, typename S, bool kForward, bool kPointwise = false>
struct LikelihoodOp {
  using T = std::conditional_t<std::is_same_v<S, double>, double, float>;
  static constexpr bool kHasVar = kKind == Likelihood::kGaussian;
  static constexpr int kVec = 16 / sizeof(S);
  static constexpr int kChunksPerThread = 2;
  static constexpr int kChunksInFlight = 2;
  static constexpr int kBlocksPerSm = 4;

  static constexpr bool kReadsGradOutput = kPointwise && !kForward;
  template <int W>
  struct Chunk {
    S input[W], target[W], var[kHasVar ? W : 1], grad_output[kReadsGradOutput ? W : 1];
  };

  const S* __restrict__ input;
  const S* __restrict__ target;
  const S* __restrict__ var;
  S* __restrict__ grad_input;
  S* __restrict__ grad_target;
  S* __restrict__ grad_var;
  S* __restrict__ loss_out;
  const S* __restrict__ grad_output;
  T eps, constant, factor;
  bool stirling;
  double sum;

  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& chunk, int64_t first) const {
    load_chunk(chunk.input, input, first);
    load_chunk(chunk.target, target, first);
    if constexpr (kHasVar) load_chunk(chunk.var, var, first);
    if constexpr (kReadsGradOutput) load_chunk(chunk.grad_output, grad_output, first);
  }

  // The Stirling term's test once a chunk, not once an element: the pass without it keeps
  // its own code (the 16-bit one is near the bound of its arithmetic).
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& chunk, int64_t first) {
    if constexpr (kHasVar) {
      apply_terms<false>(chunk, first);
    } else if (stirling) {
      apply_terms<true>(chunk, first);
    } else {
      apply_terms<false>(chunk, first);
    }
  }

  template <bool kStirling, int W>
  __device__ __forceinline__ void apply_terms(const Chunk<W>& chunk, int64_t first) {
    S gi[W], gt[W], gv[kHasVar ? W : 1], losses[kPointwise && kForward ? W : 1];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      T v = T(0);
      if constexpr (kHasVar) v = to_opmath(chunk.var[k]);
      const LikelihoodTerms<T> terms = likelihood_terms<kKind, sizeof(S) == 2, kStirling>(
          to_opmath(chunk.input[k]), to_opmath(chunk.target[k]), v, eps, constant);
      if constexpr (kPointwise && kForward) {
        losses[k] = Convert<S>::from(terms.loss * factor);
        continue;
      }
      if constexpr (kForward) sum += double(terms.loss);
      T times = factor;
      if constexpr (kReadsGradOutput) times *= to_opmath(chunk.grad_output[k]);
      gi[k] = Convert<S>::from(terms.d_input * times);
      gt[k] = Convert<S>::from(terms.d_target * times);
      if constexpr (kHasVar) gv[k] = Convert<S>::from(terms.d_var * times);
    }
    if constexpr (kPointwise && kForward) {
      store_chunk(loss_out, first, losses);
      return;
    }
    if (grad_input != nullptr) store_chunk(grad_input, first, gi);
    if (grad_target != nullptr) store_chunk(grad_target, first, gt);
    if constexpr (kHasVar) {
      if (grad_var != nullptr) store_chunk(grad_var, first, gv);
    }
  }
};

// finish_weighted_reduction_kernel's factor: the reduction's scale.
struct ReductionScale {
  double scale;
  __device__ __forceinline__ double factor() const { return scale; }
};

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) likelihood_loss_kernel(Op op, int64_t n,
                                                                                          double* partials) {
  op.sum = 0.0;
  visit_tile(op, n);
  const double total = block_sum(op.sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// From the last tile (the forward just read it, so it may still be in L2), gridDim.x apart.
// Notes grad_output in `history` (when set) and whether it was not the one expected;
// correcting in place, returns at once where the forward's gradients are this grad_output's.
template <class Op, typename S>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) likelihood_backward_kernel(
    Op op, int64_t n, int64_t tiles, const S* grad_output, double scale, double expected_grad_output,
    double* history, bool correct_in_place) {
  using T = typename Op::T;
  const T go = to_opmath(*grad_output);
  const bool expected = same_bits(go, T(expected_grad_output));
  if (history != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    history[0] = double(go);
    history[1] = expected ? 0.0 : 1.0;
  }
  if (correct_in_place && expected) return;
  op.factor = T(scale * double(go));
#pragma unroll 1
  for (int64_t tile = tiles - 1 - blockIdx.x; tile >= 0; tile -= gridDim.x) visit_tile(op, n, tile);
}

// Calls f(kind, S{}) for the problem's loss and dtype.
template <class F>
cudaError_t with_likelihood(const LikelihoodProblem& p, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  with_input_dtype(p.input_dtype, [&](auto s) {
    switch (p.kind) {
      case Likelihood::kGaussian:
        err = f(std::integral_constant<Likelihood, Likelihood::kGaussian>{}, s);
        break;
      case Likelihood::kPoissonLogRate:
        err = f(std::integral_constant<Likelihood, Likelihood::kPoissonLogRate>{}, s);
        break;
      case Likelihood::kPoissonRate:
        err = f(std::integral_constant<Likelihood, Likelihood::kPoissonRate>{}, s);
        break;
    }
  });
  return err;
}

template <class Op, typename S>
Op make_likelihood_op(const LikelihoodProblem& p, void* grad_input, void* grad_target, void* grad_var) {
  using T = typename Op::T;
  Op op{};
  op.input = static_cast<const S*>(p.input);
  op.target = static_cast<const S*>(p.target);
  op.var = static_cast<const S*>(p.var);
  op.grad_input = static_cast<S*>(grad_input);
  op.grad_target = static_cast<S*>(grad_target);
  op.grad_var = static_cast<S*>(grad_var);
  op.eps = T(p.eps);
  op.constant = T(p.constant);
  op.stirling = p.stirling;
  // as the backward's for this grad_output: the same bits
  op.factor = T(p.scale * double(T(p.expected_grad_output)));
  return op;
}

}  // namespace

int64_t likelihood_partials(const LikelihoodProblem& p) {
  int64_t tiles = 0;
  with_likelihood(p, [&](auto kind, auto s) {
    tiles = num_tiles<LikelihoodOp<decltype(kind)::value, decltype(s), true>>(p.numel);
    return cudaSuccess;
  });
  return tiles;
}

cudaError_t launch_likelihood_loss(const LikelihoodProblem& p, double* partials, void* grad_input, void* grad_target,
                                   void* grad_var, void* out, cudaStream_t stream) {
  return with_likelihood(p, [&](auto kind, auto s) {
    using S = decltype(s);
    using Op = LikelihoodOp<decltype(kind)::value, S, true>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles > 0) {
      const Op op = make_likelihood_op<Op, S>(p, grad_input, grad_target, grad_var);
      likelihood_loss_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, partials);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    // An empty mean is 0 times 1 / 0: NaN, as in PyTorch.
    finish_weighted_reduction_kernel<S><<<1, kFinishThreads, 0, stream>>>(partials, tiles, ReductionScale{p.scale},
                                                                           static_cast<S*>(out));
    return cudaGetLastError();
  });
}

cudaError_t launch_likelihood_backward(const LikelihoodProblem& p, const void* grad_output,
                                       const BackwardOptions& options, void* grad_input, void* grad_target,
                                       void* grad_var, cudaStream_t stream) {
  return with_likelihood(p, [&](auto kind, auto s) {
    using S = decltype(s);
    using Op = LikelihoodOp<decltype(kind)::value, S, false>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    const Op op = make_likelihood_op<Op, S>(p, grad_input, grad_target, grad_var);
    const int64_t wave = int64_t(options.num_sms > 0 ? options.num_sms : 1) * Op::kBlocksPerSm;
    const int64_t blocks = options.correct_in_place && wave < tiles ? wave : tiles;
    likelihood_backward_kernel<Op, S><<<blocks, kBlockThreads, 0, stream>>>(
        op, p.numel, tiles, static_cast<const S*>(grad_output), p.scale, p.expected_grad_output, options.history,
        options.correct_in_place);
    return cudaGetLastError();
  });
}

// One tile a block (kernels.cuh's elementwise_kernel); set_pointers(op, S{}) sets the
// op's outputs and, backward, its grad_output.
template <bool kForward, class SetPointers>
cudaError_t launch_pointwise_pass(const LikelihoodProblem& p, cudaStream_t stream, SetPointers&& set_pointers) {
  return with_likelihood(p, [&](auto kind, auto s) {
    using S = decltype(s);
    using Op = LikelihoodOp<decltype(kind)::value, S, kForward, true>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    Op op = make_likelihood_op<Op, S>(p, nullptr, nullptr, nullptr);
    set_pointers(op, s);
    elementwise_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

cudaError_t launch_likelihood_pointwise(const LikelihoodProblem& p, void* out, cudaStream_t stream) {
  return launch_pointwise_pass<true>(p, stream, [&](auto& op, auto s) { op.loss_out = static_cast<decltype(s)*>(out); });
}

cudaError_t launch_likelihood_pointwise_backward(const LikelihoodProblem& p, const void* grad_output, void* grad_input,
                                                 void* grad_target, void* grad_var, cudaStream_t stream) {
  return launch_pointwise_pass<false>(p, stream, [&](auto& op, auto s) {
    using S = decltype(s);
    op.grad_input = static_cast<S*>(grad_input);
    op.grad_target = static_cast<S*>(grad_target);
    op.grad_var = static_cast<S*>(grad_var);
    op.grad_output = static_cast<const S*>(grad_output);
  });
}

FUSEDLOSS_KERNELS_END
