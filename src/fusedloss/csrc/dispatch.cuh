// From a LossProblem's run-time loss and dtypes to the compile-time types the
// ops take: every launcher instantiates its kernel for each loss in the table
// (losses.cuh) and each dtype pair through these.
#pragma once

#include <type_traits>

#include "launch.h"
#include "loss_ops.cuh"

namespace fusedloss {

template <class F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    case DType::kFloat64: f(double{}); break;
  }
}

template <typename T>
constexpr DType dtype_of();

// with_dtype for the input: only the shard's dtype in a sharded build (launch.h).
template <class F>
void with_input_dtype(DType dtype, F&& f) {
#ifdef FUSEDLOSS_SHARD_INPUT
  if (dtype == dtype_of<FUSEDLOSS_SHARD_INPUT>()) f(FUSEDLOSS_SHARD_INPUT{});
#else
  with_dtype(dtype, f);
#endif
}

template <class F>
void with_loss(LossKind loss, F&& f) {
#define FUSEDLOSS_LOSS_CASE(Name, name, param, domain) \
  case LossKind::k##Name: f(Name##Loss{}); break;
  switch (loss) { FUSEDLOSS_FOR_EACH_LOSS(FUSEDLOSS_LOSS_CASE) }
#undef FUSEDLOSS_LOSS_CASE
}

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, __half>) return DType::kFloat16;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::kBFloat16;
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
}

// A build may leave the autocast kernels out (the KernelBench files, which
// compile every kernel in one translation unit); such a build rejects an
// autocast problem with cudaErrorInvalidValue.
#ifdef FUSEDLOSS_NO_AUTOCAST_KERNELS
constexpr bool kAutocastKernels = false;
#else
constexpr bool kAutocastKernels = true;
#endif

// Whether Loss's own kernels for this pair already compute as autocast does:
// in float32, with a float32 loss and both gradients computed in float32 (as
// for every pair PyTorch promotes to float32, except where Huber's loss and
// Smooth L1's gradients keep an operand's dtype).
template <class Loss, typename In, typename Tgt>
constexpr bool computes_as_autocast() {
  using Op = PairOp<Loss, In, Tgt>;
  return std::is_same_v<typename Op::Out, float> && std::is_same_v<typename Op::InputGradDtype, float> &&
         std::is_same_v<typename Op::TargetGradDtype, float>;
}

// Calls f(Loss{}, In{}, Tgt{}) for the problem's loss and dtype pair. fp64 is
// taken only paired with fp64; the host code converts the other operand. A
// problem under autocast (a pair reads_under_autocast names) takes Loss's own
// kernels where they compute as autocast does, Float32Math<Loss>'s otherwise.
template <class F>
cudaError_t with_problem_types(const LossProblem& p, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  with_input_dtype(p.input_dtype, [&](auto in) {
    with_dtype(p.target_dtype, [&](auto tgt) {
      using In = decltype(in);
      using Tgt = decltype(tgt);
      if constexpr (std::is_same_v<In, double> == std::is_same_v<Tgt, double>) {
        if (!p.autocast) {
          with_loss(p.loss, [&](auto loss) { err = f(loss, in, tgt); });
        } else if constexpr (kAutocastKernels && !std::is_same_v<In, double>) {
          with_loss(p.loss, [&](auto loss) {
            using Loss = decltype(loss);
            if constexpr (computes_as_autocast<Loss, In, Tgt>()) {
              err = f(loss, in, tgt);
            } else {
              err = f(Float32Math<Loss>{}, in, tgt);
            }
          });
        }
      }
    });
  });
  return err;
}

template <Grads kGrads>
using GradsConstant = std::integral_constant<Grads, kGrads>;

// The same, with a fourth argument: the Grads that writing these gradients takes.
template <class F>
cudaError_t with_problem_types(const LossProblem& p, bool writes_input, bool writes_target, F&& f) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    if (writes_target) return f(loss, in, tgt, GradsConstant<Grads::kInputAndTarget>{});
    if (writes_input) return f(loss, in, tgt, GradsConstant<Grads::kInput>{});
    return f(loss, in, tgt, GradsConstant<Grads::kNone>{});
  });
}

// The param converted to dtype D, as PyTorch converts beta and delta (1e6 is inf in fp16).
template <typename D, typename T>
LossParam<T> loss_param_in(double param) {
  const T value = to_opmath(Convert<D>::from(static_cast<T>(param)));
  return LossParam<T>{value, value != T(0) ? T(1) / value : T(0)};
}

template <class Op>
Op make_op(const LossProblem& p) {
  Op op{};
  op.input = static_cast<const typename Op::InT*>(p.input);
  op.target = static_cast<const typename Op::TgtT*>(p.target);
  using T = typename Op::T;
  constexpr bool kRounded = Op::LossT::kParamInLossDtype;
  op.param = loss_param_in<std::conditional_t<kRounded, typename Op::Out, T>, T>(p.param);
  op.input_grad_param = loss_param_in<std::conditional_t<kRounded, typename Op::InputGradDtype, T>, T>(p.param);
  op.target_grad_param = loss_param_in<std::conditional_t<kRounded, typename Op::TargetGradDtype, T>, T>(p.param);
  return op;
}

// Calls f(op, tiles) with an OpT for the gradients that grad_input and
// grad_target ask for, its operands and gradient pointers set; nothing to do
// when none is asked for or the problem is empty.
template <template <class, typename, typename, Grads> class OpT, class F>
cudaError_t with_gradient_op(const LossProblem& p, void* grad_input, void* grad_target, F&& f) {
  return with_problem_types(p, grad_input != nullptr, grad_target != nullptr,
                                           [&](auto loss, auto in, auto tgt, auto grads) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = OpT<decltype(loss), In, Tgt, grads()>;
    if constexpr (grads() == Grads::kNone) {
      return cudaSuccess;
    } else {
      const int64_t tiles = num_tiles<Op>(p.numel);
      if (tiles == 0) return cudaSuccess;
      Op op = make_op<Op>(p);
      op.grad_input = static_cast<In*>(grad_input);
      op.grad_target = static_cast<Tgt*>(grad_target);
      return f(op, tiles);
    }
  });
}

}  // namespace fusedloss
