// launch_pointwise_loss_backward_broadcast: reduction='none' backward with a
// grad_output read as a weight is (the Weighted policy), in a translation unit
// of its own so that it compiles beside the other backward.
#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

template <class Loss, typename In, typename Tgt, Grads kGrads>
using BroadcastGradOutputBackwardOp = PointwiseLossBackwardOp<Loss, In, Tgt, kGrads, Weighted<opmath_t<In, Tgt>>>;

cudaError_t launch_pointwise_loss_backward_broadcast(const LossProblem& p, const ElementWeight& grad_output,
                                                     void* grad_input, void* grad_target, cudaStream_t stream) {
  return with_gradient_op<BroadcastGradOutputBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles) {
    using Op = decltype(op);
    using Stored = typename decltype(op.weights)::Stored;
    op.weights.weight = static_cast<const Stored*>(grad_output.weight);
    op.weights.layout = grad_output;
    op.weights.grad = nullptr;
    elementwise_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
