// The kernels: each runs one op (loss_ops.cuh) over the tiles of its problem,
// one tile per block (elementwise.cuh).
#pragma once

#include "exact_sum.cuh"
#include "launch.h"
#include "loss_ops.cuh"

namespace fusedloss {

// One block per tile; each adds its tile's sum into copy blockIdx.x % copies
// of the exact sum, the count fixed by kCopies, or read from `copies` where
// kCopies is 0. The read-only pass fixes it: read at run time, it costs the
// read-only fp32 MSE and L1 kernels a register spill and some of their
// bandwidth; the gradient-writing passes read it (docs/design.md).
template <int kCopies, class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) reduced_loss_kernel(Op op, int64_t n, Word* sum,
                                                                                  int copies) {
  using Sum = ExactSum<typename Op::T>;
  static_assert(kTileElements<Op> <= Sum::kMaxTileValues);
  op.begin();
  op.sum = 0.0;
  visit_tile(op, n);
  const double total = block_sum(op.sum);
  const unsigned copy = blockIdx.x & unsigned((kCopies > 0 ? kCopies : copies) - 1);  // a power of two
  if (threadIdx.x == 0) Sum::add(sum + copy * Sum::kCopyWords, total);
}

// The blockwise reduction's bounds (its kernel: reduced_loss_blockwise.cu).
constexpr int64_t kBlockwiseMaxTiles = 1024;
// Up to kSingleBlockMaxTiles tiles, one block: a grid-wide barrier would cost
// more than the block's walk.
constexpr int64_t kSingleBlockMaxTiles = 4;
constexpr int64_t kBlockwiseTilesPerBlock = 4;

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) elementwise_kernel(Op op, int64_t n) {
  visit_tile(op, n);
}

// Whether two values have the same bits: a prediction of grad_output holds only
// then (-0 is not 0, and a NaN that was seen is expected again).
template <typename T>
__device__ __forceinline__ bool same_bits(T a, T b) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return __float_as_uint(a) == __float_as_uint(b);
  } else {
    return __double_as_longlong(a) == __double_as_longlong(b);
  }
}

// The gradients of a mean or sum for grad_output, over `tiles` tiles walked from
// the last (the forward just read those, so the first ones this walk reads are
// still in L2), gridDim.x apart: one tile per block, or, when correcting the
// forward's gradients, one wave that returns at once where they were computed
// for this grad_output. Notes in `history` (host memory, when set) grad_output and
// whether it was not the one expected.
template <class Op>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) reduced_loss_backward_kernel(
    Op op, int64_t n, int64_t tiles, double* history, bool correct_in_place, double expected_grad_output) {
  using T = typename Op::T;
  const T go = to_opmath(*op.grad_output);
  const bool expected = same_bits(go, T(expected_grad_output));
  if (history != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    history[0] = double(go);
    history[1] = expected ? 0.0 : 1.0;
  }
  if (correct_in_place && expected) return;
  op.begin(go);
#pragma unroll 1
  for (int64_t tile = tiles - 1 - blockIdx.x; tile >= 0; tile -= gridDim.x) visit_tile(op, n, tile);
}

template <class Op>
cudaError_t launch_backward_kernel(const Op& op, const LossProblem& p, int64_t tiles, const BackwardOptions& options,
                                   cudaStream_t stream) {
  const int64_t sms_wave = int64_t(options.num_sms) * Op::kBlocksPerSm;
  const int64_t wave = sms_wave > 1 ? sms_wave : 1;
  const int64_t blocks = options.correct_in_place && wave < tiles ? wave : tiles;
  reduced_loss_backward_kernel<Op><<<blocks, kBlockThreads, 0, stream>>>(
      op, p.numel, tiles, options.history, options.correct_in_place, p.expected_grad_output);
  return cudaGetLastError();
}

// A weighted reduction's pass: each tile's sum (of either sign) into its slot
// of `partials`, and the gradients the op writes. Where the weight is constant along
// rows of whole tiles (op.weights.per_row), each tile's loss is summed unweighted, into
// its slot of `row_partials` where that is set, and times its row's weight into
// `partials`.
template <class Op>
__global__ void __launch_bounds__(kBlockThreads, Op::kBlocksPerSm) weighted_reduced_loss_kernel(Op op, int64_t n,
                                                                                                double* partials,
                                                                                                double* row_partials) {
  op.begin();
  op.sum = 0.0;
  visit_tile(op, n);
  const double total = block_sum(op.sum);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = op.weights.per_row ? row_weight() * total : total;  // noted by this thread
    if (row_partials != nullptr) row_partials[blockIdx.x] = total;
  }
}

// Each row's `tiles_per_row` partials added in a fixed order by a block of its own,
// divided by `row_length` for a mean, rounded once: the same bits on every run.
template <typename Out>
__global__ void __launch_bounds__(kBlockThreads) finish_rows_kernel(const double* partials, int64_t tiles_per_row,
                                                                    int64_t row_length, bool mean, Out* out) {
  const double* row = partials + blockIdx.x * tiles_per_row;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < tiles_per_row; i += kBlockThreads) sum += row[i];
  const double total = block_sum(sum);
  // An empty mean is 0 / 0 = NaN, as in PyTorch.
  if (threadIdx.x == 0) out[blockIdx.x] = Convert<Out>::from(mean ? total / double(row_length) : total);
}

// The partials added in a fixed order, times the scale, rounded once, by one
// block. Each thread keeps kFinishLoadsInFlight loads in flight: a walk that
// waits for each load before the next is bound by latency.
constexpr int kFinishThreads = 1024;
constexpr int kFinishLoadsInFlight = 8;

template <typename Out, class Weights>
__global__ void __launch_bounds__(kFinishThreads) finish_weighted_reduction_kernel(const double* partials,
                                                                                   int64_t count, Weights weights,
                                                                                   Out* out) {
  constexpr int64_t kStride = kFinishThreads;
  double sums[kFinishLoadsInFlight] = {};
  int64_t i = threadIdx.x;
  for (; i + (kFinishLoadsInFlight - 1) * kStride < count; i += kFinishLoadsInFlight * kStride) {
#pragma unroll
    for (int j = 0; j < kFinishLoadsInFlight; ++j) sums[j] += partials[i + j * kStride];
  }
#pragma unroll
  for (int j = 0; j < kFinishLoadsInFlight; ++j) {
    if (i + j * kStride < count) sums[j] += partials[i + j * kStride];
  }
  double sum = 0.0;
#pragma unroll
  for (int j = 0; j < kFinishLoadsInFlight; ++j) sum += sums[j];
  const double total = block_sum<kFinishThreads>(sum);
  if (threadIdx.x == 0) *out = Convert<Out>::from(total * weights.factor());
}

template <typename T, typename Out>
__global__ void __launch_bounds__(kMaxScratchWords) finish_reduction_kernel(const Word* sum, int copies,
                                                                            int64_t numel, bool mean, Out* out) {
  __shared__ Word words[kMaxScratchWords];
  if (threadIdx.x < copies * ExactSum<T>::kCopyWords) words[threadIdx.x] = sum[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    const double total = ExactSum<T>::total(words, copies);
    // An empty mean is 0 / 0 = NaN, as in PyTorch.
    *out = Convert<Out>::from(mean ? total / double(numel) : total);
  }
}

}  // namespace fusedloss
