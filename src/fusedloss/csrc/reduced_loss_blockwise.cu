// launch_blockwise_reduction: a small or middling mean or sum in one launch,
// with no scratch to zero (reduction_pass.cuh).
#include <algorithm>
#include <array>
#include <atomic>

#include "reduction_pass.cuh"

FUSEDLOSS_KERNELS_BEGIN
namespace {

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
