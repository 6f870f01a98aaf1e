// launch_pointwise_loss: reduction='none' in one pass.
#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN

cudaError_t launch_pointwise_loss(const LossProblem& p, void* out, cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = PointwiseLossOp<decltype(loss), decltype(in), decltype(tgt)>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (tiles == 0) return cudaSuccess;
    Op op = make_op<Op>(p);
    op.out = static_cast<typename Op::Out*>(out);
    elementwise_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel);
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
