// The weighted pass that also writes d loss / d input (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

FUSEDLOSS_KERNELS_BEGIN

template cudaError_t launch_weighted_pass<Grads::kInput>(const LossProblem&, double*, void*, void*, void*, void*,
                                                         cudaStream_t);

FUSEDLOSS_KERNELS_END
