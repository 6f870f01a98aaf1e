// launch_reduced_loss: a mean or sum in one pass (reduction_pass.cuh), then
// one short launch that rounds the exact sum; a small or middling one with no
// gradient to write blockwise (reduced_loss_blockwise.cu), with no scratch to zero.
// The passes are instantiated in reduced_loss_*.cu, one translation unit each,
// so that they compile in parallel.
#include "reduction_pass.cuh"

FUSEDLOSS_KERNELS_BEGIN

extern template cudaError_t launch_reduction_pass<Grads::kNone>(const LossProblem&, Word*, void*, void*, bool,
                                                                cudaStream_t);
extern template cudaError_t launch_reduction_pass<Grads::kInput>(const LossProblem&, Word*, void*, void*, bool,
                                                                 cudaStream_t);
extern template cudaError_t launch_reduction_pass<Grads::kInputAndTarget>(const LossProblem&, Word*, void*, void*,
                                                                          bool, cudaStream_t);

int64_t reduced_loss_scratch_bytes(const LossProblem& p, bool writes_gradients) {
  int64_t bytes = 0;
  with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    const int64_t tiles = num_tiles<ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>>(p.numel);
    bytes = !writes_gradients && tiles <= kBlockwiseMaxTiles ? blockwise_scratch_bytes(p) : scratch_bytes(tiles);
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_reduced_loss(const LossProblem& p, void* scratch, void* grad_input, void* grad_target,
                                bool mean, void* out, cudaStream_t stream) {
  Word* sum = static_cast<Word*>(scratch);
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    // The tiles, and so the scratch, are the same whichever gradients are written.
    using Op = ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>;
    using T = typename Op::T;
    const int64_t tiles = num_tiles<Op>(p.numel);
    if (grad_input == nullptr && grad_target == nullptr && tiles <= kBlockwiseMaxTiles) {
      return launch_blockwise_reduction(p, scratch, mean, out, stream);
    }
    if (tiles > (int64_t(1) << kMaxTilesLog2)) return cudaErrorInvalidValue;  // the digits could overflow
    cudaError_t err = cudaMemsetAsync(sum, 0, scratch_bytes(tiles), stream);
    if (err != cudaSuccess) return err;
    if (grad_target != nullptr) {
      err = launch_reduction_pass<Grads::kInputAndTarget>(p, sum, grad_input, grad_target, mean, stream);
    } else if (grad_input != nullptr) {
      err = launch_reduction_pass<Grads::kInput>(p, sum, grad_input, grad_target, mean, stream);
    } else {
      err = launch_reduction_pass<Grads::kNone>(p, sum, grad_input, grad_target, mean, stream);
    }
    if (err != cudaSuccess) return err;
    using Out = typename Op::Out;
    finish_reduction_kernel<T, Out><<<1, kMaxScratchWords, 0, stream>>>(sum, scratch_copies<T>(tiles), p.numel, mean,
                                                                         static_cast<Out*>(out));
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
