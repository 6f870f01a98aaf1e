"""Experiment: the forward pass that also writes the gradient (read 2N, write N).

Compares loop shapes for fp32 and bf16, MSE and Huber, at 2^30 elements, with a
device copy as the ceiling. Run on the device:
    PYTHONPATH=src python benchmarks/grad_variants.py
"""

from __future__ import annotations

import statistics

import torch
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cstdint>

__device__ __forceinline__ float f(float x) { return x; }
__device__ __forceinline__ float f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T cvt(float x);
template <> __device__ __forceinline__ float cvt<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <int LOSS> __device__ __forceinline__ float value(float d) {
  if (LOSS == 0) return d * d;
  float z = fabsf(d); return z < 1.f ? 0.5f * z * z : (z - 0.5f);
}
template <int LOSS> __device__ __forceinline__ float grad(float d) {
  if (LOSS == 0) return d + d;
  return d < -1.f ? -1.f : (d > 1.f ? 1.f : d);
}

template <typename T> struct alignas(16) Vec { T v[16 / sizeof(T)]; };

__device__ double block_sum(double v) {
  __shared__ double s[8];
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) { v = threadIdx.x < 8 ? s[threadIdx.x] : 0.0;
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o); }
  return v;
}

// PIPE: loads for the next step are issued before the current step is processed.
template <typename T, int LOSS, int U, int PIPE, int STCS, int BPS>
__global__ void __launch_bounds__(256, BPS) fwd_grad(const Vec<T>* p, const Vec<T>* t, Vec<T>* g, int64_t nvec,
                                                     int64_t per_block, float scale, double* sums) {
  constexpr int V = 16 / sizeof(T);
  const int64_t begin = int64_t(blockIdx.x) * per_block;
  const int64_t end = min(nvec, begin + per_block);
  double acc = 0;
  auto process = [&](const Vec<T>& a, const Vec<T>& b, int64_t i) {
    Vec<T> out; float s = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) { float d = f(a.v[k]) - f(b.v[k]); s += value<LOSS>(d); out.v[k] = cvt<T>(grad<LOSS>(d) * scale); }
    acc += double(s);
    if (STCS) __stcs(reinterpret_cast<uint4*>(g + i), *reinterpret_cast<uint4*>(&out));
    else g[i] = out;
  };
  auto load = [&](Vec<T>& dst, const Vec<T>* src, int64_t i) {
    *reinterpret_cast<uint4*>(&dst) = __ldcs(reinterpret_cast<const uint4*>(src + i));
  };
  if (!PIPE) {
    for (int64_t i = begin + threadIdx.x; i < end; i += 256 * U) {
      Vec<T> a[U], b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) if (i + u * 256 < end) { load(a[u], p, i + u * 256); load(b[u], t, i + u * 256); }
#pragma unroll
      for (int u = 0; u < U; ++u) if (i + u * 256 < end) process(a[u], b[u], i + u * 256);
    }
  } else {
    Vec<T> a[U], b[U];
    int64_t i = begin + threadIdx.x;
#pragma unroll
    for (int u = 0; u < U; ++u) if (i + u * 256 < end) { load(a[u], p, i + u * 256); load(b[u], t, i + u * 256); }
    for (; i < end; i += 256 * U) {
      Vec<T> na[U], nb[U];
      const int64_t j = i + 256 * U;
#pragma unroll
      for (int u = 0; u < U; ++u) if (j + u * 256 < end) { load(na[u], p, j + u * 256); load(nb[u], t, j + u * 256); }
#pragma unroll
      for (int u = 0; u < U; ++u) if (i + u * 256 < end) process(a[u], b[u], i + u * 256);
#pragma unroll
      for (int u = 0; u < U; ++u) { a[u] = na[u]; b[u] = nb[u]; }
    }
  }
  double s = block_sum(acc);
  if (threadIdx.x == 0) sums[blockIdx.x] = s;
}

template <typename T, int LOSS, int U, int PIPE, int STCS, int BPS>
void run(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor sums, int64_t per_block) {
  const int64_t nvec = p.numel() * p.element_size() / 16;
  const int blocks = (nvec + per_block - 1) / per_block;
  fwd_grad<T, LOSS, U, PIPE, STCS, BPS><<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const Vec<T>*)p.data_ptr(), (const Vec<T>*)t.data_ptr(), (Vec<T>*)g.data_ptr(), nvec, per_block,
      1.0f / p.numel(), sums.data_ptr<double>());
}
"""

# (dtype, loss, unroll, pipelined, streaming stores, blocks per SM, vectors per block)
VARIANTS = [
    (dt, loss, u, pipe, stcs, bps, chunk)
    for dt in ("float", "__nv_bfloat16")
    for loss in (0, 1)
    for (u, pipe, stcs, bps, chunk) in [
        (4, 0, 1, 4, 16384),  # as shipped
        (4, 0, 0, 4, 16384),
        (2, 1, 1, 4, 16384),
        (2, 0, 1, 8, 16384),
        (4, 0, 1, 4, 4096),
        (8, 0, 1, 2, 16384),
    ]
]


def main() -> None:
    names = [f"run_{i}" for i in range(len(VARIANTS))]
    decls = "\n".join(f"void {n}(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor s, int64_t c);"
                      for n in names)
    defs = "\n".join(
        f"void {n}(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor s, int64_t c)"
        f" {{ run<{dt},{loss},{u},{pipe},{stcs},{bps}>(p, t, g, s, c); }}"
        for n, (dt, loss, u, pipe, stcs, bps, _) in zip(names, VARIANTS)
    )
    module = load_inline("grad_variants", cpp_sources=decls, cuda_sources=CUDA + defs, functions=names,
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    n = 1 << 30

    def median_ms(fn, reps=15):
        for _ in range(3):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)

    src = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e9
    del src, dst
    print(f"copy {copy_tbs:.2f} TB/s")
    sums = torch.empty(1 << 20, dtype=torch.float64, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.rand(n, device="cuda", dtype=dtype)
        t = torch.rand(n, device="cuda", dtype=dtype)
        g = torch.empty_like(p)
        for name, (dt, loss, u, pipe, stcs, bps, chunk) in zip(names, VARIANTS):
            if (dt == "float") != (dtype == torch.float32):
                continue
            fn = getattr(module, name)
            ms = median_ms(lambda: fn(p, t, g, sums, chunk))
            tbs = 3 * n * p.element_size() / ms / 1e9
            print(f"{dt:14} loss={'mse' if loss == 0 else 'huber':5} U={u} pipe={pipe} stcs={stcs} bps={bps} "
                  f"chunk={chunk:5d}: {ms:6.3f} ms {tbs:5.2f} TB/s {100 * tbs / copy_tbs:5.1f}% copy")
        del p, t, g


if __name__ == "__main__":
    main()
