// Backward's weighted pass that writes d loss / d input (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

namespace fusedloss {

template cudaError_t launch_weighted_backward_pass<Grads::kInput>(const LossProblem&, const void*, void*, void*,
                                                                  void*, const BackwardOptions&, cudaStream_t);

}  // namespace fusedloss
