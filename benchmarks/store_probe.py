"""Experiment: how blocks should split the read-2N-write-N pass, and at what cache policy.

At 2^30 elements of Smooth L1 (beta 1), fp32 and bf16, times raw variants of the
fused pass (read input + read target + write gradient, block partial sums): the
loop fusedloss shipped before (blocks owning ranges of 4096 or 1024 16-byte
vectors) and one tile per block of THREADS x U vectors; and an in-place scale
(read N + write N) split the same ways. The gradient buffer sits at four
placements in a fresh allocation, to see whether the addresses matter. The
library's step, the compiled step and a copy are timed in the same run.
Results: results/probes/store_probe_tiles.txt. (results/probes/
store_probe_policies.txt came from this script's first form, which timed load
and store cache policies taking turns with the compiled step and profiled its
kernels.) Run on the device:
    OUT=... PYTHONPATH=src python benchmarks/store_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

import fusedloss
from fusedloss import bench, build

CUDA = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cstdint>

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// LOAD 0: ld.global.cs (as shipped); 1: .cs with a 256-byte L2 prefetch; 2: .nc, no L1, 256-byte prefetch.
template <int LOAD> __device__ __forceinline__ uint4 load16(const uint4* p) {
  uint4 r;
  if constexpr (LOAD == 0) {
    r = __ldcs(p);
  } else if constexpr (LOAD == 1) {
    asm("ld.global.cs.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  }
  return r;
}

// STORE 0: plain; 1: st.global.cs (as shipped); 2: L2 evict_first policy; 3: L2 evict_last policy.
template <int STORE> __device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if constexpr (STORE == 0) {
    *p = v;
  } else if constexpr (STORE == 1) {
    __stcs(p, v);
  } else {
    uint64_t policy;
    if constexpr (STORE == 2) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    else asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
  }
}

__device__ double block_sum(double v) {
  __shared__ double s[8];
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < 8 ? s[threadIdx.x] : 0.0;
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

constexpr int kUnroll = 4;

// Blocks walk ranges blockIdx.x, blockIdx.x + gridDim.x, ... of `range_vecs` 16-byte vectors.
template <typename T, int LOAD, int STORE, bool REDUCE>
__global__ void __launch_bounds__(256, 4) fused_pass(const uint4* p, const uint4* t, uint4* g, int64_t nvec,
                                                    int64_t range_vecs, float scale, double* sums) {
  constexpr int V = 16 / sizeof(T);
  double acc = 0;
  const int64_t num_ranges = (nvec + range_vecs - 1) / range_vecs;
  for (int64_t range = blockIdx.x; range < num_ranges; range += gridDim.x) {
    const int64_t end = min(nvec, (range + 1) * range_vecs);
    for (int64_t i = range * range_vecs + threadIdx.x; i < end; i += 256 * kUnroll) {
      uint4 a[kUnroll], b[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * 256 < end) { a[u] = load16<LOAD>(p + i + u * 256); b[u] = load16<LOAD>(t + i + u * 256); }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * 256 < end) {
          const T* x = reinterpret_cast<const T*>(&a[u]);
          const T* y = reinterpret_cast<const T*>(&b[u]);
          alignas(16) T out[V];
          float s = 0;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float d = as_float(x[k]) - as_float(y[k]);
            const float z = fabsf(d);
            s += z < 1.f ? 0.5f * z * z : z - 0.5f;
            out[k] = from_float<T>(fminf(fmaxf(d, -1.f), 1.f) * scale);
          }
          if (REDUCE) acc += double(s);
          store16<STORE>(g + i + u * 256, *reinterpret_cast<const uint4*>(out));
        }
      }
    }
  }
  if (REDUCE) {
    const double total = block_sum(acc);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
  }
}

// dst = src * scale (in place when dst == src), 16-byte vectors, grid as above.
template <typename T, int STORE>
__global__ void __launch_bounds__(256, 4) scale_pass(const uint4* src, uint4* dst, int64_t nvec, int64_t range_vecs,
                                                    float scale) {
  constexpr int V = 16 / sizeof(T);
  const int64_t num_ranges = (nvec + range_vecs - 1) / range_vecs;
  for (int64_t range = blockIdx.x; range < num_ranges; range += gridDim.x) {
    const int64_t end = min(nvec, (range + 1) * range_vecs);
    for (int64_t i = range * range_vecs + threadIdx.x; i < end; i += 256 * kUnroll) {
      uint4 a[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) if (i + u * 256 < end) a[u] = __ldcs(src + i + u * 256);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * 256 < end) {
          const T* x = reinterpret_cast<const T*>(&a[u]);
          alignas(16) T out[V];
#pragma unroll
          for (int k = 0; k < V; ++k) out[k] = from_float<T>(as_float(x[k]) * scale);
          store16<STORE>(dst + i + u * 256, *reinterpret_cast<const uint4*>(out));
        }
      }
    }
  }
}

template <int THREADS>
__device__ double block_sum_of(double v) {
  __shared__ double s[THREADS / 32];
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < THREADS / 32 ? s[threadIdx.x] : 0.0;
    for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// One tile of THREADS * U vectors per block, blocks in launch order (as inductor's pointwise kernels).
template <typename T, int THREADS, int U, int STORE>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS) tile_pass(const uint4* p, const uint4* t, uint4* g,
                                                                    int64_t nvec, float scale, double* sums) {
  constexpr int V = 16 / sizeof(T);
  const int64_t first = int64_t(blockIdx.x) * THREADS * U + threadIdx.x;
  uint4 a[U], b[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t i = first + u * THREADS;
    if (i < nvec) { a[u] = __ldcs(p + i); b[u] = __ldcs(t + i); }
  }
  float s = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t i = first + u * THREADS;
    if (i < nvec) {
      const T* x = reinterpret_cast<const T*>(&a[u]);
      const T* y = reinterpret_cast<const T*>(&b[u]);
      alignas(16) T out[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = as_float(x[k]) - as_float(y[k]);
        const float z = fabsf(d);
        s += z < 1.f ? 0.5f * z * z : z - 0.5f;
        out[k] = from_float<T>(fminf(fmaxf(d, -1.f), 1.f) * scale);
      }
      store16<STORE>(g + i, *reinterpret_cast<const uint4*>(out));
    }
  }
  const double total = block_sum_of<THREADS>(double(s));
  if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

template <typename T, int THREADS, int U, int STORE>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS) tile_scale(const uint4* src, uint4* dst, int64_t nvec,
                                                                     float scale) {
  constexpr int V = 16 / sizeof(T);
  const int64_t first = int64_t(blockIdx.x) * THREADS * U + threadIdx.x;
  uint4 a[U];
#pragma unroll
  for (int u = 0; u < U; ++u) if (first + u * THREADS < nvec) a[u] = __ldcs(src + first + u * THREADS);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t i = first + u * THREADS;
    if (i < nvec) {
      const T* x = reinterpret_cast<const T*>(&a[u]);
      alignas(16) T out[V];
#pragma unroll
      for (int k = 0; k < V; ++k) out[k] = from_float<T>(as_float(x[k]) * scale);
      store16<STORE>(dst + i, *reinterpret_cast<const uint4*>(out));
    }
  }
}

template <typename T, int THREADS, int U, int STORE>
void tile(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor sums) {
  const int64_t nvec = p.numel() * p.element_size() / 16;
  const int64_t blocks = (nvec + THREADS * U - 1) / (THREADS * U);
  TORCH_CHECK(sums.numel() >= blocks);
  tile_pass<T, THREADS, U, STORE><<<blocks, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)p.data_ptr(), (const uint4*)t.data_ptr(), (uint4*)g.data_ptr(), nvec, 1.0f / p.numel(),
      sums.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int THREADS, int U, int STORE>
void tscale(torch::Tensor src, torch::Tensor dst) {
  const int64_t nvec = src.numel() * src.element_size() / 16;
  const int64_t blocks = (nvec + THREADS * U - 1) / (THREADS * U);
  tile_scale<T, THREADS, U, STORE><<<blocks, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)src.data_ptr(), (uint4*)dst.data_ptr(), nvec, -1.0f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int LOAD, int STORE, bool REDUCE>
void fused(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor sums, int64_t range_vecs, int64_t grid) {
  const int64_t nvec = p.numel() * p.element_size() / 16;
  const int64_t ranges = (nvec + range_vecs - 1) / range_vecs;
  const int blocks = grid > 0 ? int(grid) : int(ranges);
  TORCH_CHECK(sums.numel() >= blocks);
  fused_pass<T, LOAD, STORE, REDUCE><<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)p.data_ptr(), (const uint4*)t.data_ptr(), (uint4*)g.data_ptr(), nvec, range_vecs,
      1.0f / p.numel(), sums.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int STORE>
void scale(torch::Tensor src, torch::Tensor dst, int64_t range_vecs, int64_t grid) {
  // by -1: the data never decays to zeros, which can move faster than real data
  const int64_t nvec = src.numel() * src.element_size() / 16;
  const int64_t ranges = (nvec + range_vecs - 1) / range_vecs;
  const int blocks = grid > 0 ? int(grid) : int(ranges);
  scale_pass<T, STORE><<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)src.data_ptr(), (uint4*)dst.data_ptr(), nvec, range_vecs, -1.0f);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

DTYPES = {"float": torch.float32, "__nv_bfloat16": torch.bfloat16}
# (load policy, store policy, with block sums): the first is the shipped loop
FUSED = [(0, 1, True), (0, 0, True), (0, 2, True), (0, 3, True), (1, 1, True), (2, 1, True), (0, 1, False)]
SCALE_STORES = (0, 1)
# (threads, vectors per thread, store policy) for one tile per block
TILES = [(128, 1, 1), (128, 2, 1), (256, 1, 1), (256, 2, 1), (256, 4, 1), (512, 1, 1),
         (128, 1, 0), (256, 1, 0), (256, 2, 0)]
# the gradient buffer at these byte offsets into a fresh allocation
PLACEMENTS = (0, 2 << 20, (96 << 20) + (4 << 10), (1 << 30) + (6 << 20))


def build_module():
    sigs, defs = [], []
    for ct in DTYPES:
        for load, store, reduce in FUSED:
            name = f"fused_{ct[-4:]}_{load}{store}{int(reduce)}"
            sigs.append(f"void {name}(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor s, int64_t r, int64_t w);")
            defs.append(sigs[-1][:-1] + f" {{ fused<{ct},{load},{store},{'true' if reduce else 'false'}>(p, t, g, s, r, w); }}")
        for store in SCALE_STORES:
            name = f"scale_{ct[-4:]}_{store}"
            sigs.append(f"void {name}(torch::Tensor a, torch::Tensor b, int64_t r, int64_t w);")
            defs.append(sigs[-1][:-1] + f" {{ scale<{ct},{store}>(a, b, r, w); }}")
        for threads, u, store in TILES:
            name = f"tile_{ct[-4:]}_{threads}_{u}_{store}"
            sigs.append(f"void {name}(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor s);")
            defs.append(sigs[-1][:-1] + f" {{ tile<{ct},{threads},{u},{store}>(p, t, g, s); }}")
            name = f"tscale_{ct[-4:]}_{threads}_{u}_{store}"
            sigs.append(f"void {name}(torch::Tensor a, torch::Tensor b);")
            defs.append(sigs[-1][:-1] + f" {{ tscale<{ct},{threads},{u},{store}>(a, b); }}")
    names = [s.split("(")[0].split()[-1] for s in sigs]
    return load_inline("store_probe", cpp_sources="\n".join(sigs), cuda_sources=CUDA + "\n".join(defs),
                       functions=names, extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    build.load()
    mod = build_module()
    n = 1 << 30
    print(torch.cuda.get_device_name(), torch.__version__)
    for ct, dtype in DTYPES.items():
        p, t = bench.seed_inputs((n,), dtype, "cuda")
        t = (t * 3).to(dtype)  # both branches of Smooth L1
        p.requires_grad_(True)
        sums = torch.empty(1 << 22, dtype=torch.float64, device="cuda")
        compiled = torch.compile(F.smooth_l1_loss)

        def step(fn):
            def run():
                p.grad = None
                fn(p, t).backward()
            return run

        copy, copy_bytes = bench.device_copy()
        steps = bench.time_side_by_side({"library": step(fusedloss.smooth_l1_loss), "compile": step(compiled),
                                         "copy": copy})
        copy_tbs = copy_bytes / steps["copy"] / 1e9
        nbytes = 3 * n * p.element_size()
        lines = [f"== Smooth L1, {dtype}, 2^30 elements, copy {copy_tbs:.2f} TB/s; library step {steps['library']:.3f} ms "
                 f"({nbytes / steps['library'] / 1e9 / copy_tbs:.1%}), compile step {steps['compile']:.3f} ms"]
        print(lines[-1], flush=True)
        with torch.no_grad():
            ref = F.smooth_l1_loss(p.double(), t.double()).item()
            expected = torch.clamp(p.float() - t.float(), -1, 1).div_(n).to(dtype)
        pool = torch.empty(n * p.element_size() + PLACEMENTS[-1] + (1 << 20), dtype=torch.uint8, device="cuda")
        variants = {}
        for load, store, reduce in FUSED[:1]:
            fn = getattr(mod, f"fused_{ct[-4:]}_{load}{store}{int(reduce)}")
            for range_vecs in (4096, 1024):
                variants[f"shipped loop, ranges of {range_vecs} vec"] = (
                    lambda g, f=fn, r=range_vecs: f(p.detach(), t, g, sums, r, 0),
                    (n * p.element_size() // 16 + range_vecs - 1) // range_vecs)
        for threads, u, store in TILES:
            fn = getattr(mod, f"tile_{ct[-4:]}_{threads}_{u}_{store}")
            variants[f"tile {threads} thr x {u} vec, store {store}"] = (
                lambda g, f=fn: f(p.detach(), t, g, sums), (n * p.element_size() // 16 + threads * u - 1) // (threads * u))
        for name, (fn, blocks) in variants.items():
            row = []
            for offset in PLACEMENTS:
                g = pool[offset: offset + n * p.element_size()].view(dtype)
                g.fill_(float("nan"))
                sums.fill_(float("nan"))
                fn(g)
                total = sums[:blocks].sum().item() / n
                assert torch.equal(g, expected), name
                assert abs(total - ref) <= 1e-6 * abs(ref), (name, total, ref)
                ms = bench.time_side_by_side({"v": lambda: fn(g)}, warmup_s=0.1)["v"]
                row.append(f"{ms:6.3f} ms {nbytes / ms / 1e9 / copy_tbs:6.1%}")
            lines.append(f"{name:40} " + " | ".join(row))
            print(lines[-1], flush=True)
        scales = {f"shipped scale loop, store {s}": getattr(mod, f"scale_{ct[-4:]}_{s}") for s in SCALE_STORES}
        lines.append("-- scale in place (read N + write N), same placements")
        for name, fn in list(scales.items()) + [
                (f"tile scale {th} thr x {u} vec, store {st}", getattr(mod, f"tscale_{ct[-4:]}_{th}_{u}_{st}"))
                for th, u, st in TILES]:
            row = []
            for offset in PLACEMENTS:
                g = pool[offset: offset + n * p.element_size()].view(dtype)
                g.copy_(expected)
                run = (lambda f=fn, g=g: f(g, g, 1024, 0)) if name.startswith("shipped") else (lambda f=fn, g=g: f(g, g))
                ms = bench.time_side_by_side({"v": run}, warmup_s=0.1)["v"]
                row.append(f"{ms:6.3f} ms {2 * n * p.element_size() / ms / 1e9 / copy_tbs:6.1%}")
            lines.append(f"{name:40} " + " | ".join(row))
            print(lines[-1], flush=True)
        with open(out / "store_probe.txt", "a") as f:
            f.write("\n".join(lines) + "\n")
        del p, t, sums, pool, expected, copy, compiled, variants
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
