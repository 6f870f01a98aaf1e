// launch_weighted_reduced_loss_backward (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

namespace fusedloss {

cudaError_t launch_weighted_reduced_loss_backward(const LossProblem& p, const void* grad_output, void* grad_input,
                                                  void* grad_target, void* grad_weight, cudaStream_t stream) {
  if (grad_weight != nullptr && grad_input == nullptr && grad_target == nullptr) {
    return cudaErrorInvalidValue;  // it goes with an operand's gradient
  }
  return with_gradient_op<WeightedReducedLossBackwardOp, true>(p, grad_input, grad_target,
                                                                [&](auto op, int64_t tiles) {
    using Op = decltype(op);
    set_weights(op, p, grad_weight);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    reduced_loss_backward_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, nullptr);
    return cudaGetLastError();
  });
}

}  // namespace fusedloss
