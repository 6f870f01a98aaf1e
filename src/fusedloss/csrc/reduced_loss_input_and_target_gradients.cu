// The reduction pass that also writes d loss / d target, and d loss / d input
// where its pointer is set (reduction_pass.cuh).
#include "reduction_pass.cuh"

FUSEDLOSS_KERNELS_BEGIN

template cudaError_t launch_reduction_pass<Grads::kInputAndTarget>(const LossProblem&, Word*, void*, void*, bool,
                                                                   cudaStream_t);

FUSEDLOSS_KERNELS_END
