// launch_reduced_loss_backward (a mean's or sum's gradients recomputed in
// backward) and launch_scale_in_place (the fused gradients scaled in backward).
#include <algorithm>

#include "dispatch.cuh"
#include "kernels.cuh"

namespace fusedloss {

cudaError_t launch_reduced_loss_backward(const LossProblem& p, const void* grad_output, bool mean, void* grad_input,
                                         void* grad_target, int32_t* history, cudaStream_t stream) {
  return with_gradient_op<ReducedLossBackwardOp>(p, grad_input, grad_target, [&](auto op, int64_t tiles) {
    using Op = decltype(op);
    op.grad_scale = static_cast<typename Op::T>(mean ? 1.0 / double(p.numel) : 1.0);
    op.grad_output = static_cast<const typename Op::Out*>(grad_output);
    reduced_loss_backward_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, p.numel, history);
    return cudaGetLastError();
  });
}

cudaError_t launch_scale_in_place(void* data, DType dtype, int64_t numel, const void* scale, DType scale_dtype,
                                  int num_sms, int32_t* history, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  with_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    const int64_t tiles = num_tiles<ScaleOp<S>>(numel);
    if (tiles == 0) return;
    const int64_t wave = std::min<int64_t>(tiles, int64_t(num_sms) * kBlocksPerSm);
    scale_in_place_kernel<S><<<wave, kBlockThreads, 0, stream>>>(static_cast<S*>(data), numel, tiles, scale,
                                                                 scale_dtype, history);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace fusedloss
