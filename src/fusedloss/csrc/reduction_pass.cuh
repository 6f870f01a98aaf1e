// The reduction's one pass over the operands, for each Grads: the read-only
// pass and the two gradient-writing ones are instantiated in their own
// translation units (reduced_loss*.cu), so that they compile in parallel.
#pragma once

#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

// Launches the pass that sums the loss of `p` into `sum` (zeroed scratch of
// scratch_bytes(tiles)) and writes the gradients kGrads names.
template <Grads kGrads>
cudaError_t launch_reduction_pass(const LossProblem& p, Word* sum, void* grad_input, void* grad_target, bool mean,
                                  cudaStream_t stream);

// The whole reduction of a problem of at most kBlockwiseMaxTiles tiles, with
// no gradient, into `out`, using `block_sums` (blockwise_scratch_bytes; null
// when that is 0) (reduced_loss_blockwise.cu).
int64_t blockwise_scratch_bytes(const LossProblem& p);
cudaError_t launch_blockwise_reduction(const LossProblem& p, void* block_sums, bool mean, void* out,
                                       cudaStream_t stream);

template <Grads kGrads>
cudaError_t launch_reduction_pass(const LossProblem& p, Word* sum, void* grad_input, void* grad_target, bool mean,
                                  cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using In = decltype(in);
    using Tgt = decltype(tgt);
    using Op = ReducedLossOp<decltype(loss), In, Tgt, kGrads>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.grad_input = static_cast<In*>(grad_input);
    op.grad_target = static_cast<Tgt*>(grad_target);
    using T = typename Op::T;
    op.reduction_scale = mean ? 1.0 / double(p.numel) : 1.0;
    op.expected_grad_output = double(static_cast<T>(p.expected_grad_output));
    const int copies = scratch_copies<T>(tiles);
    if constexpr (kGrads == Grads::kNone) {
      constexpr int kSmall = scratch_copies<T>(0);
      constexpr int kLarge = scratch_copies<T>(kLargeScratchFromTiles);
      const auto kernel = copies == kLarge ? reduced_loss_kernel<kLarge, Op> : reduced_loss_kernel<kSmall, Op>;
      kernel<<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, sum, copies);
    } else {
      reduced_loss_kernel<0, Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, sum, copies);
    }
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
