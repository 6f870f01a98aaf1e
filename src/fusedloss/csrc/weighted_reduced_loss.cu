// launch_weighted_reduced_loss, and its read-only pass (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

FUSEDLOSS_KERNELS_BEGIN

extern template cudaError_t launch_weighted_pass<Grads::kInput>(const LossProblem&, double*, void*, void*, void*,
                                                                void*, cudaStream_t);
extern template cudaError_t launch_weighted_pass<Grads::kInputAndTarget>(const LossProblem&, double*, void*, void*,
                                                                         void*, void*, cudaStream_t);
template cudaError_t launch_weighted_pass<Grads::kNone>(const LossProblem&, double*, void*, void*, void*, void*,
                                                        cudaStream_t);

int64_t weighted_reduced_loss_partials(const LossProblem& p, bool row_sums) {
  int64_t tiles = 0;
  with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    // The tiles are the same whichever gradients are written; twice as many partials with row sums.
    tiles = num_tiles<WeightedReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>>(p.numel);
    if (p.row_length > 0 && row_sums) tiles *= 2;
    return cudaSuccess;
  });
  return tiles;
}

cudaError_t launch_weighted_reduced_loss(const LossProblem& p, double* partials, void* grad_input, void* grad_target,
                                         void* grad_weight, void* out, cudaStream_t stream) {
  if (grad_target != nullptr) {
    return launch_weighted_pass<Grads::kInputAndTarget>(p, partials, grad_input, grad_target, grad_weight, out,
                                                        stream);
  }
  if (grad_input != nullptr) {
    return launch_weighted_pass<Grads::kInput>(p, partials, grad_input, nullptr, grad_weight, out, stream);
  }
  if (grad_weight != nullptr && p.row_length == 0) return cudaErrorInvalidValue;  // it goes with an operand's
  return launch_weighted_pass<Grads::kNone>(p, partials, nullptr, nullptr, grad_weight, out, stream);
}

FUSEDLOSS_KERNELS_END
