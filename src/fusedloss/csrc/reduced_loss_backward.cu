// launch_reduced_loss_backward: a mean's or sum's gradients for grad_output,
// recomputed in backward, or corrected in place where the forward expected
// another grad_output.
#include <algorithm>

#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

cudaError_t launch_reduced_loss_backward(const LossProblem& p, const void* grad_output, bool mean, void* grad_input,
                                         void* grad_target, const BackwardOptions& options, cudaStream_t stream) {
  return with_gradient_op<ReducedLossBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles) {
    using Op = decltype(op);
    op.reduction_scale = mean ? 1.0 / double(p.numel) : 1.0;
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    return launch_backward_kernel(op, p, tiles, options, stream);
  });
}

FUSEDLOSS_KERNELS_END
