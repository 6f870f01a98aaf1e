// The weighted reductions (launch.h): the plain reductions' ops with a
// Weighted policy. The forward's pass and backward's for each Grads are
// instantiated in translation units of their own (weighted_reduced_loss*.cu),
// so that they compile in parallel.
#pragma once

#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

template <class Loss, typename In, typename Tgt, Grads kGrads>
using WeightedReducedLossOp = ReducedLossOp<Loss, In, Tgt, kGrads, Weighted<opmath_t<In, Tgt>>>;

template <class Loss, typename In, typename Tgt, Grads kGrads>
using WeightedReducedLossBackwardOp = ReducedLossBackwardOp<Loss, In, Tgt, kGrads, Weighted<opmath_t<In, Tgt>>>;

template <class Op>
void set_weights(Op& op, const LossProblem& p, void* grad_weight) {
  using Stored = typename decltype(op.weights)::Stored;
  op.weights.weight = static_cast<const Stored*>(p.weight.weight);
  op.weights.layout = p.weight;
  op.weights.scale = p.scale;
  op.weights.grad = grad_weight;
  op.weights.per_row = p.row_length > 0;
  op.weights.param_per_element = p.param_per_element;
  op.weights.broadcast_target = p.broadcast_target;
}

// A param per element only for the losses that take one, given in the weight's place, with
// no gradient of it to write and no rows; a target read where it lies only beside one, for
// the losses compiled for it.
template <class Loss>
bool weighted_problem_fits(const LossProblem& p, const void* grad_weight) {
  const bool broadcast_target = p.broadcast_target.weight != nullptr;
  if (!p.param_per_element) return !broadcast_target;
  return TakesParamPerElement<Loss>::value && (!broadcast_target || TakesParamPerElement<Loss>::kTargetWhereItLies) &&
         grad_weight == nullptr && p.row_length == 0 && p.weight.weight != nullptr;
}

// The pass that sums each tile into `partials` and writes the gradients kGrads
// names (and the weight's, with either), then the launch that adds the partials
// up into `out`; with rows and `grad_weight`, the one that adds each row's unweighted
// partials (the second half of `partials`) into it instead.
template <Grads kGrads>
cudaError_t launch_weighted_pass(const LossProblem& p, double* partials, void* grad_input, void* grad_target,
                                 void* grad_weight, void* out, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = WeightedReducedLossOp<decltype(loss), In, Tgt, kGrads>;
    if (!weighted_problem_fits<decltype(loss)>(p, grad_weight)) return cudaErrorInvalidValue;
    const int64_t tiles = num_tiles<Op>(p.numel);
    const bool per_row = p.row_length > 0;
    static_assert(kRowTilingMultiple % kTileElements<Op> == 0, "rows of kRowTilingMultiple are whole tiles");
    const bool row_sums = per_row && grad_weight != nullptr;
    double* row_partials = row_sums ? partials + tiles : nullptr;
    Op op = make_op<Op>(p);
    set_weights(op, p, per_row ? nullptr : grad_weight);
    op.expected_grad_output = double(static_cast<typename Op::T>(p.expected_grad_output));
    if (tiles > 0) {
      op.grad_input = static_cast<In*>(grad_input);
      op.grad_target = static_cast<Tgt*>(grad_target);
      weighted_reduced_loss_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, partials, row_partials);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    using Out = typename Op::Out;
    finish_weighted_reduction_kernel<Out><<<1, kFinishThreads, 0, stream>>>(partials, tiles, op.weights,
                                                                           static_cast<Out*>(out));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || !row_sums) return err;
    finish_rows_kernel<double><<<unsigned(p.numel / p.row_length), kBlockThreads, 0, stream>>>(
        row_partials, p.row_length / kTileElements<Op>, p.row_length, false, static_cast<double*>(grad_weight));
    return cudaGetLastError();
  });
}

// Backward's pass for a one-element grad_output: the gradients kGrads names (and
// the weight's, with either), recomputed, or corrected in place (BackwardOptions).
template <Grads kGrads>
cudaError_t launch_weighted_backward_pass(const LossProblem& p, const void* grad_output, void* grad_input,
                                          void* grad_target, void* grad_weight, const BackwardOptions& options,
                                          cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = WeightedReducedLossBackwardOp<decltype(loss), In, Tgt, kGrads>;
    if (!weighted_problem_fits<decltype(loss)>(p, grad_weight)) return cudaErrorInvalidValue;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.grad_input = static_cast<In*>(grad_input);
    op.grad_target = static_cast<Tgt*>(grad_target);
    set_weights(op, p, grad_weight);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    return launch_backward_kernel(op, p, tiles, options, stream);
  });
}

FUSEDLOSS_KERNELS_END
