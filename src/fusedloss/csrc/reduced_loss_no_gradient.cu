// The read-only reduction pass (reduction_pass.cuh).
#include "reduction_pass.cuh"

FUSEDLOSS_KERNELS_BEGIN

template cudaError_t launch_reduction_pass<Grads::kNone>(const LossProblem&, Word*, void*, void*, bool, cudaStream_t);

FUSEDLOSS_KERNELS_END
