// launch_per_sample_loss: a loss reduced over its trailing dimensions, one value per row
// of them (dim=(1, 2, 3) of a batch), in one pass and a short launch that adds up each
// row's tiles.
#include "dispatch.cuh"
#include "kernels.cuh"

FUSEDLOSS_KERNELS_BEGIN
namespace {

// Block (tile, row) sums that tile of the row into partials[row * gridDim.x + tile]. Each
// row starts on a 16-byte boundary (the host checks it), so the op's pointers, moved to
// the row, load as they do for a whole reduction.
template <class Op>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) per_sample_loss_kernel(Op op, int64_t row_length,
                                                                                          double* partials) {
  const int64_t row = blockIdx.y;
  op.input += row * row_length;
  op.target += row * row_length;
  op.begin();
  op.sum = 0.0;
  visit_tile(op, row_length, blockIdx.x);
  const double total = block_sum(op.sum);
  if (threadIdx.x == 0) partials[row * gridDim.x + blockIdx.x] = total;
}

template <class Loss, typename In, typename Tgt>
using PerSampleOp = ReducedLossOp<Loss, In, Tgt, Grads::kNone>;

}  // namespace

int64_t per_sample_loss_partials(const LossProblem& p, int64_t rows) {
  int64_t count = 0;
  with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    count = rows > 0 ? rows * num_tiles<PerSampleOp<decltype(loss), decltype(in), decltype(tgt)>>(p.numel / rows) : 0;
    return cudaSuccess;
  });
  return count;
}

cudaError_t launch_per_sample_loss(const LossProblem& p, int64_t rows, double* partials, bool mean, void* out,
                                   cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = PerSampleOp<decltype(loss), decltype(in), decltype(tgt)>;
    if (rows == 0) return cudaSuccess;
    const int64_t row_length = p.numel / rows;
    const int64_t tiles = num_tiles<Op>(row_length);
    if (rows > kPerSampleMaxRows || tiles > int64_t(0x7fffffff)) return cudaErrorInvalidValue;
    if (tiles > 0) {
      Op op = make_op<Op>(p);
      op.reduction_scale = 1.0;
      op.expected_grad_output = 1.0;
      per_sample_loss_kernel<Op><<<dim3(unsigned(tiles), unsigned(rows)), kBlockThreads, 0, stream>>>(op, row_length,
                                                                                                     partials);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    finish_rows_kernel<typename Op::Out><<<unsigned(rows), kBlockThreads, 0, stream>>>(
        partials, tiles, row_length, mean, static_cast<typename Op::Out*>(out));
    return cudaGetLastError();
  });
}

FUSEDLOSS_KERNELS_END
