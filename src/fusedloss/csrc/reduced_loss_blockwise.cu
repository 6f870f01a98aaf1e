// launch_blockwise_reduction: a small or middling mean or sum in one or two
// launches, with no scratch to zero (reduction_pass.cuh).
#include "reduction_pass.cuh"

namespace fusedloss {

int64_t blockwise_scratch_bytes(const LossProblem& p) {
  int64_t bytes = 0;
  with_problem_types<true>(p, [&](auto loss, auto in, auto tgt) {
    using Op = ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>;
    const int64_t blocks = blockwise_blocks(num_tiles<Op>(p.numel));
    bytes = blocks > 1 ? blocks * ExactSum<typename Op::T>::kCopyWords * int64_t(sizeof(Word)) : 0;
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_blockwise_reduction(const LossProblem& p, void* block_sums, bool mean, void* out,
                                       cudaStream_t stream) {
  return with_problem_types<true>(p, [&](auto loss, auto in, auto tgt) {
    using Op = ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>;
    using Out = typename Op::Out;
    const int64_t tiles = num_tiles<Op>(p.numel);
    const int64_t blocks = blockwise_blocks(tiles);
    Word* sums = static_cast<Word*>(block_sums);
    blockwise_reduced_loss_kernel<Op><<<blocks, kBlockThreads, 0, stream>>>(make_op<Op>(p), p.numel, tiles, sums,
                                                                              mean, static_cast<Out*>(out));
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || blocks == 1) return err;
    finish_blockwise_reduction_kernel<typename Op::T, Out><<<1, kBlockThreads, 0, stream>>>(
        sums, int(blocks), p.numel, mean, static_cast<Out*>(out));
    return cudaGetLastError();
  });
}

}  // namespace fusedloss
