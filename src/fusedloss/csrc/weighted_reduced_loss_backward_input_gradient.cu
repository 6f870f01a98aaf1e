// Backward's weighted pass that writes d loss / d input (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

FUSEDLOSS_KERNELS_BEGIN

template cudaError_t launch_weighted_backward_pass<Grads::kInput>(const LossProblem&, const void*, void*, void*,
                                                                  void*, const BackwardOptions&, cudaStream_t);

FUSEDLOSS_KERNELS_END
