// The walk over contiguous elements that every kernel here shares.
// An op supplies `Chunk<W>` (registers for W consecutive elements), `load` and
// `apply`; the walk issues all loads of a step before the first use, so each
// thread keeps its 16-byte loads of every operand in flight together.
#pragma once

#include <cstdint>

namespace fusedloss {

constexpr int kBlockThreads = 256;
// 8 x 256 threads per SM at 32 registers each: with two 16-byte loads in flight
// per thread, enough bytes in flight to stream at HBM bandwidth.
constexpr int kBlocksPerSm = 8;

// W elements from `src + first`: 16-byte loads when the chunk is a whole number
// of 16-byte words, scalar loads otherwise (W == 1, a tile's tail). Plain
// loads: evict-first (ld.global.cs) ones lose bandwidth on this access pattern.
template <int W, typename T>
__device__ __forceinline__ void load_chunk(T (&dst)[W], const T* __restrict__ src, int64_t first) {
  if constexpr (W * sizeof(T) % 16 == 0) {
    const uint4* words = reinterpret_cast<const uint4*>(src + first);
    uint4* out = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int k = 0; k < int(W * sizeof(T) / 16); ++k) out[k] = words[k];
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

// The threads of a block share [first_element, first_element + num_chunks * W)
// in steps of kBlockThreads * U chunks.
template <int W, int U, class Op>
__device__ __forceinline__ void visit_chunks(Op& op, int64_t first_element, int64_t num_chunks) {
#pragma unroll 1
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

template <class Op>
constexpr int64_t kTileElements = int64_t(kBlockThreads) * Op::kVec * Op::kChunksPerThread;

// The block walks tile number `tile` (by default its own): Op::kChunksPerThread
// Op::kVec-wide chunks per thread, Op::kChunksInFlight loaded at once, then
// the tile's tail one by one. The op's pointers are 16-byte aligned (launch.h).
template <class Op>
__device__ __forceinline__ void visit_tile(Op& op, int64_t n, int64_t tile = blockIdx.x) {
  const int64_t begin = tile * kTileElements<Op>;
  const int64_t count = (n - begin < kTileElements<Op> ? n - begin : kTileElements<Op>);
  const int64_t num_chunks = count / Op::kVec;
  visit_chunks<Op::kVec, Op::kChunksInFlight>(op, begin, num_chunks);
  visit_chunks<1, 1>(op, begin + num_chunks * Op::kVec, count - num_chunks * Op::kVec);
}

// One tile of kBlockThreads * Op::kChunksPerThread chunks per block, blocks in
// launch order: the scheduler hands out the next tile as a block retires, so
// the whole GPU streams through a narrow window of each tensor, which keeps
// DRAM pages open (docs/design.md, "Tiles"); blocks that own long ranges
// scatter the accesses. The tiles depend only on n and the op, so a
// reduction's partial sums are the same on every run.
template <class Op>
inline int64_t num_tiles(int64_t n) {
  return (n + kTileElements<Op> - 1) / kTileElements<Op>;
}

// Sum over a block of kThreads threads, in a fixed order; the result is valid in thread 0.
template <int kThreads = kBlockThreads>
__device__ __forceinline__ double block_sum(double v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024);
  __shared__ double warp_sums[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

}  // namespace fusedloss
