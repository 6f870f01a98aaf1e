// The weighted pass that also writes d loss / d target, and d loss / d input
// where its pointer is set (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

FUSEDLOSS_KERNELS_BEGIN

template cudaError_t launch_weighted_pass<Grads::kInputAndTarget>(const LossProblem&, double*, void*, void*, void*,
                                                                  void*, cudaStream_t);

FUSEDLOSS_KERNELS_END
