// launch_blockwise_reduction: a small or middling mean or sum in one launch,
// with no scratch to zero (reduction_pass.cuh).
#include <algorithm>
#include <array>
#include <atomic>

#include <cooperative_groups.h>

#include "reduction_pass.cuh"

FUSEDLOSS_KERNELS_BEGIN
namespace {

// A reduction with no gradient to write, of up to kBlockwiseMaxTiles tiles,
// in one launch without zeroed scratch: each block walks every gridDim.x-th
// tile and adds each tile's sum exactly into its own copy of the digits in
// shared memory. One block rounds its copy into `out`. More blocks are
// launched cooperatively: each stores its copy in `block_sums`, and after a
// grid-wide barrier block 0 folds them word by word (the flags by OR, the
// digits by addition, whose sum the spare bits of each word absorb, as in
// ExactSum) and rounds. The sum is exact, so the result has the bits the
// one-tile-per-block reduction gives.
template <class Op>
__global__ void __launch_bounds__(kBlockThreads) blockwise_reduced_loss_kernel(Op op, int64_t n, int64_t tiles,
                                                                                Word* block_sums, bool mean,
                                                                                typename Op::Out* out) {
  using Sum = ExactSum<typename Op::T>;
  constexpr int kWords = Sum::kCopyWords;
  __shared__ Word words[kWords];
  for (int i = threadIdx.x; i < kWords; i += kBlockThreads) words[i] = 0;
  __syncthreads();
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    op.sum = 0.0;
    visit_tile(op, n, tile);
    const double total = block_sum(op.sum);
    if (threadIdx.x == 0) Sum::add(words, total);
    __syncthreads();  // the next tile's block_sum reuses its shared partials
  }
  if (gridDim.x > 1) {
    for (int i = threadIdx.x; i < kWords; i += kBlockThreads) block_sums[blockIdx.x * kWords + i] = words[i];
    cooperative_groups::this_grid().sync();
    if (blockIdx.x != 0) return;
    // Every thread folds a share of the copies, so that their loads are in
    // flight together, then a thread per word folds the shares. Word 0 holds
    // flags (OR), the rest digits (integer addition): the order changes no bit.
    static_assert(kBlockThreads % kWords == 0);
    constexpr int kShares = kBlockThreads / kWords;
    __shared__ Word shares[kBlockThreads];
    const int word = threadIdx.x % kWords;
    const auto fold = [word](Word folded, Word w) { return word == 0 ? (folded | w) : folded + w; };
    Word folded = 0;
#pragma unroll 4
    for (unsigned b = threadIdx.x / kWords; b < gridDim.x; b += kShares) {
      folded = fold(folded, block_sums[b * kWords + word]);
    }
    shares[threadIdx.x] = folded;
    __syncthreads();
    if (threadIdx.x < kWords) {
      folded = 0;
      for (int s = 0; s < kShares; ++s) folded = fold(folded, shares[s * kWords + word]);
      words[word] = folded;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double total = Sum::total(words, 1);
    // An empty mean is 0 / 0 = NaN, as in PyTorch.
    *out = Convert<typename Op::Out>::from(mean ? total / double(n) : total);
  }
}

// How many blocks of the kernel the current GPU holds at once, looked up once per device.
template <class Op>
int64_t resident_blocks() {
  static std::array<std::atomic<int64_t>, 64> cache{};  // 0: not looked up yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= int(cache.size())) return 1;
  int64_t blocks = cache[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, blockwise_reduced_loss_kernel<Op>, kBlockThreads, 0) !=
            cudaSuccess) {
      return 1;
    }
    blocks = std::max<int64_t>(1, int64_t(sms) * per_sm);
    cache[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

// One block up to kSingleBlockMaxTiles tiles, else kBlockwiseTilesPerBlock
// tiles each, no more than the GPU holds at once (a cooperative launch needs
// them all resident).
inline int64_t wanted_blocks(int64_t tiles) {
  return tiles <= kSingleBlockMaxTiles ? 1 : (tiles + kBlockwiseTilesPerBlock - 1) / kBlockwiseTilesPerBlock;
}

}  // namespace

int64_t blockwise_scratch_bytes(const LossProblem& p) {
  int64_t bytes = 0;
  with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>;
    const int64_t tiles = num_tiles<Op>(p.numel);
    const int64_t blocks = wanted_blocks(tiles);  // the launch may take fewer
    bytes = blocks > 1 ? blocks * ExactSum<typename Op::T>::kCopyWords * int64_t(sizeof(Word)) : 0;
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_blockwise_reduction(const LossProblem& p, void* block_sums, bool mean, void* out,
                                       cudaStream_t stream) {
  return with_problem_types(p, [&](auto loss, auto in, auto tgt) {
    using Op = ReducedLossOp<decltype(loss), decltype(in), decltype(tgt), Grads::kNone>;
    using Out = typename Op::Out;
    Op op = make_op<Op>(p);
    int64_t n = p.numel;
    int64_t tiles = num_tiles<Op>(n);
    Word* sums = static_cast<Word*>(block_sums);
    Out* result = static_cast<Out*>(out);
    const int64_t blocks = std::min(wanted_blocks(tiles), resident_blocks<Op>());
    if (blocks == 1) {
      blockwise_reduced_loss_kernel<Op><<<1, kBlockThreads, 0, stream>>>(op, n, tiles, sums, mean, result);
      return cudaGetLastError();
    }
    void* args[] = {&op, &n, &tiles, &sums, &mean, &result};
    return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(blockwise_reduced_loss_kernel<Op>),
                                       dim3(unsigned(blocks)), dim3(kBlockThreads), args, 0, stream);
  });
}

FUSEDLOSS_KERNELS_END
