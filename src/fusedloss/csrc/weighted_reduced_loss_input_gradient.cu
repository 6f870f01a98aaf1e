// The weighted pass that also writes d loss / d input (weighted_reduction.cuh).
#include "weighted_reduction.cuh"

namespace fusedloss {

template cudaError_t launch_weighted_pass<Grads::kInput>(const LossProblem&, double*, void*, void*, void*, void*,
                                                         cudaStream_t);

}  // namespace fusedloss
