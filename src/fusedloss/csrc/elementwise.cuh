// The walk over contiguous elements that every kernel here shares.
// An op supplies `Chunk<W>` (registers for W consecutive elements), `load` and
// `apply`; the walk issues all loads of an unrolled step before the first use,
// so each thread keeps several 16-byte loads in flight.
#pragma once

#include <cstdint>

namespace fusedloss {

constexpr int kBlockThreads = 256;
// 4 x 256 threads per SM keep enough bytes in flight to reach HBM bandwidth
// while leaving 64 registers per thread.
constexpr int kBlocksPerSm = 4;
constexpr int kScalarUnroll = 4;

// W elements from `src + first`: 16-byte streaming loads when the chunk is a
// whole number of 16-byte words, scalar loads otherwise (W == 1).
template <int W, typename T>
__device__ __forceinline__ void load_chunk(T (&dst)[W], const T* __restrict__ src, int64_t first) {
  if constexpr (W * sizeof(T) % 16 == 0) {
    const uint4* words = reinterpret_cast<const uint4*>(src + first);
    uint4* out = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int k = 0; k < int(W * sizeof(T) / 16); ++k) out[k] = __ldcs(words + k);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) dst[k] = src[first + k];
  }
}

template <int W, typename T>
__device__ __forceinline__ void store_chunk(T* __restrict__ dst, int64_t first, const T (&src)[W]) {
  if constexpr (W * sizeof(T) % 16 == 0) {
    uint4* words = reinterpret_cast<uint4*>(dst + first);
    const uint4* in = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int k = 0; k < int(W * sizeof(T) / 16); ++k) words[k] = in[k];
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) dst[first + k] = src[k];
  }
}

// For outputs read back much later (gradients): evict-first, like the loads.
template <int W, typename T>
__device__ __forceinline__ void store_chunk_streaming(T* __restrict__ dst, int64_t first, const T (&src)[W]) {
  if constexpr (W * sizeof(T) % 16 == 0) {
    uint4* words = reinterpret_cast<uint4*>(dst + first);
    const uint4* in = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int k = 0; k < int(W * sizeof(T) / 16); ++k) __stcs(words + k, in[k]);
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) dst[first + k] = src[k];
  }
}

// The threads of a block share [first_element, first_element + num_chunks * W)
// in steps of kBlockThreads * U chunks.
template <int W, int U, class Op>
__device__ __forceinline__ void visit_chunks(Op& op, int64_t first_element, int64_t num_chunks) {
  for (int64_t base = threadIdx.x; base < num_chunks; base += int64_t(kBlockThreads) * U) {
    typename Op::template Chunk<W> chunks[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kBlockThreads;
      if (c < num_chunks) op.load(chunks[u], first_element + c * W);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * kBlockThreads;
      if (c < num_chunks) op.apply(chunks[u], first_element + c * W);
    }
  }
}

// The block walks range number `range` of the Schedule (by default its own):
// Op::kVec-wide chunks when all of the op's pointers are 16-byte aligned, then
// the range's tail one by one; else one by one.
template <class Op>
__device__ __forceinline__ void visit_block_range(Op& op, int64_t n, int64_t elements_per_block, bool vectorized,
                                                  int64_t range = blockIdx.x) {
  const int64_t begin = range * elements_per_block;
  const int64_t count = (n - begin < elements_per_block ? n - begin : elements_per_block);
  if (vectorized) {
    const int64_t num_chunks = count / Op::kVec;
    visit_chunks<Op::kVec, Op::kUnroll>(op, begin, num_chunks);
    visit_chunks<1, 1>(op, begin + num_chunks * Op::kVec, count - num_chunks * Op::kVec);
  } else {
    visit_chunks<1, kScalarUnroll>(op, begin, count);
  }
}

// Blocks own contiguous ranges, sized so that every SM gets kBlocksPerSm
// blocks, but no larger than kMaxChunksPerBlock: on big inputs many short-lived
// blocks balance the load across SMs better than one persistent wave (measured
// in benchmarks/reduce_variants.py). The schedule depends only on n, the op and
// the SM count, so a reduction's summation order is the same on every run.
constexpr int64_t kMaxChunksPerBlock = 4096;

struct Schedule {
  int64_t elements_per_block;
  int blocks;
};

template <class Op>
inline Schedule make_schedule(int64_t n, int num_sms) {
  const int64_t chunks = (n + Op::kVec - 1) / Op::kVec;
  const int64_t step = int64_t(kBlockThreads) * Op::kUnroll;
  const int64_t wave = int64_t(num_sms) * kBlocksPerSm;
  int64_t per_block = (chunks + wave - 1) / wave;
  per_block = per_block > 0 ? (per_block + step - 1) / step * step : step;
  per_block = per_block < kMaxChunksPerBlock ? per_block : (kMaxChunksPerBlock / step) * step;
  const int64_t blocks = (chunks + per_block - 1) / per_block;
  return {per_block * Op::kVec, int(blocks)};
}

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Sum over the block, in a fixed order; the result is valid in thread 0.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[kBlockThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kBlockThreads / 32 ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

}  // namespace fusedloss
