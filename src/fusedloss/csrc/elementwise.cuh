// A grid-stride walk over contiguous elements that every kernel here shares.
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

template <int W, int U, class Op>
__device__ __forceinline__ void visit_chunks(Op& op, int64_t first_element, int64_t num_chunks) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < num_chunks;
       base += stride * U) {
    typename Op::template Chunk<W> chunks[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * stride;
      if (c < num_chunks) op.load(chunks[u], first_element + c * W);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = base + u * stride;
      if (c < num_chunks) op.apply(chunks[u], first_element + c * W);
    }
  }
}

// Every element of [0, n) exactly once: Op::kVec-wide chunks when all of the
// op's pointers are 16-byte aligned, then the tail one by one; else one by one.
template <class Op>
__device__ __forceinline__ void visit_all(Op& op, int64_t n, bool vectorized) {
  if (vectorized) {
    const int64_t num_chunks = n / Op::kVec;
    visit_chunks<Op::kVec, Op::kUnroll>(op, 0, num_chunks);
    visit_chunks<1, 1>(op, num_chunks * Op::kVec, n - num_chunks * Op::kVec);
  } else {
    visit_chunks<1, kScalarUnroll>(op, 0, n);
  }
}

// Grid size from the SM count; it depends only on n, the op and the device, so
// a reduction's summation order is the same on every run.
template <class Op>
inline int grid_size(int64_t n, int num_sms) {
  const int64_t per_block = int64_t(kBlockThreads) * Op::kVec * Op::kUnroll;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int64_t most = int64_t(num_sms) * kBlocksPerSm;
  return int(wanted < most ? wanted : most);
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
