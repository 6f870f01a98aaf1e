// launch_pointwise_loss_backward: the gradients of reduction='none' in one pass.
#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

cudaError_t launch_pointwise_loss_backward(const LossProblem& p, const void* grad_output,
                                           bool grad_output_is_scalar, void* grad_input, void* grad_target,
                                           cudaStream_t stream) {
  return with_gradient_op<PointwiseLossBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles) {
    using Op = decltype(op);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    op.grad_output_is_scalar = grad_output_is_scalar;
    elementwise_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
