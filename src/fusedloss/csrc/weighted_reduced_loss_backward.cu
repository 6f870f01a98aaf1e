// launch_weighted_reduced_loss_backward, and backward's pass that writes d loss /
// d target, and d loss / d input where its pointer is set (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

FUSEDLOSS_KERNELS_BEGIN

extern template cudaError_t launch_weighted_backward_pass<Grads::kInput>(const LossProblem&, const void*, void*,
                                                                         void*, void*, const BackwardOptions&,
                                                                         cudaStream_t);
template cudaError_t launch_weighted_backward_pass<Grads::kInputAndTarget>(const LossProblem&, const void*, void*,
                                                                           void*, void*, const BackwardOptions&,
                                                                           cudaStream_t);

cudaError_t launch_weighted_reduced_loss_backward(const LossProblem& p, const void* grad_output, void* grad_input,
                                                  void* grad_target, void* grad_weight,
                                                  const BackwardOptions& options, cudaStream_t stream) {
  if (grad_target != nullptr) {
    return launch_weighted_backward_pass<Grads::kInputAndTarget>(p, grad_output, grad_input, grad_target,
                                                                 grad_weight, options, stream);
  }
  if (grad_input != nullptr) {
    return launch_weighted_backward_pass<Grads::kInput>(p, grad_output, grad_input, nullptr, grad_weight, options,
                                                        stream);
  }
  // The weight's gradient goes with an operand's; nothing asked for is nothing to do.
  return grad_weight != nullptr ? cudaErrorInvalidValue : cudaSuccess;
}

FUSEDLOSS_KERNELS_END
