"""Experiment: one small tile per block, and what its partial sums cost.

`store_probe.py` found that blocks of 256 threads with one 16-byte vector per
thread per tensor, in launch order, reach 97% of copy on the fused pass (read
input + read target + write gradient) at every placement of the gradient, where
the shipped loop (ranges of 4096 vectors) reaches 89%. This probe separates that
tile's costs at 2^30 elements of Smooth L1, fp32 and bf16: load and store cache
policy, block partial sums against warp partial sums against none, and the
forward-only pass (read 2N, partial sums). References in the same run: inductor's
own backward kernel (torch.compile of aten.smooth_l1_loss_backward), inductor's
forward reduction, and a copy. Run on the device:
    OUT=... PYTHONPATH=src python benchmarks/tile_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from fusedloss import bench

CUDA = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cstdint>

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// LOAD 0: ld.global.cs; 1: plain ld.global; 2: ld.global.nc
template <int LOAD> __device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (LOAD == 0) return __ldcs(p);
  else if constexpr (LOAD == 1) return *p;
  else return __ldg(p);
}
// STORE 0: plain; 1: st.global.cs
template <int STORE> __device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if constexpr (STORE == 0) *p = v;
  else __stcs(p, v);
}

// SUMS 0: none; 1: one per block; 2: one per warp
template <int THREADS, int SUMS>
__device__ __forceinline__ void write_partial(double v, double* sums) {
  if constexpr (SUMS == 0) return;
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if constexpr (SUMS == 2) {
    if (threadIdx.x % 32 == 0) sums[int64_t(blockIdx.x) * (THREADS / 32) + threadIdx.x / 32] = v;
  } else {
    __shared__ double s[THREADS / 32];
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
      v = threadIdx.x < THREADS / 32 ? s[threadIdx.x] : 0.0;
      for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
      if (threadIdx.x == 0) sums[blockIdx.x] = v;
    }
  }
}

// One tile of THREADS * U vectors per block, blocks in launch order; g == nullptr: forward only.
template <typename T, int THREADS, int U, int LOAD, int STORE, int SUMS>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS) tile_pass(const uint4* p, const uint4* t, uint4* g,
                                                                    int64_t nvec, float scale, double* sums) {
  constexpr int V = 16 / sizeof(T);
  const int64_t first = int64_t(blockIdx.x) * THREADS * U + threadIdx.x;
  uint4 a[U], b[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t i = first + u * THREADS;
    if (i < nvec) { a[u] = load16<LOAD>(p + i); b[u] = load16<LOAD>(t + i); }
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
      if (g != nullptr) store16<STORE>(g + i, *reinterpret_cast<const uint4*>(out));
    }
  }
  write_partial<THREADS, SUMS>(double(s), sums);
}

template <typename T, int THREADS, int U, int LOAD, int STORE, int SUMS>
void tile(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor sums, bool write) {
  const int64_t nvec = p.numel() * p.element_size() / 16;
  const int64_t blocks = (nvec + THREADS * U - 1) / (THREADS * U);
  TORCH_CHECK(sums.numel() >= blocks * (SUMS == 2 ? THREADS / 32 : 1));
  tile_pass<T, THREADS, U, LOAD, STORE, SUMS><<<blocks, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)p.data_ptr(), (const uint4*)t.data_ptr(), write ? (uint4*)g.data_ptr() : nullptr, nvec,
      1.0f / p.numel(), sums.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

DTYPES = {"float": torch.float32, "__nv_bfloat16": torch.bfloat16}
# (threads, vectors per thread, load, store, sums)
TILES = [(256, 1, 0, 1, 1), (256, 1, 0, 1, 0), (256, 1, 0, 1, 2), (256, 1, 1, 0, 1), (256, 1, 2, 1, 1),
         (128, 1, 1, 0, 0), (128, 1, 0, 1, 1), (256, 2, 0, 1, 1), (512, 1, 0, 1, 1)]
SUM_NAMES = {0: "no sums", 1: "block sums", 2: "warp sums"}


def build_module():
    sigs, defs = [], []
    for ct in DTYPES:
        for cfg in TILES:
            name = f"tile_{ct[-4:]}_" + "_".join(map(str, cfg))
            sigs.append(f"void {name}(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor s, bool w);")
            defs.append(sigs[-1][:-1] + f" {{ tile<{ct},{','.join(map(str, cfg))}>(p, t, g, s, w); }}")
    names = [s.split("(")[0].split()[-1] for s in sigs]
    return load_inline("tile_probe", cpp_sources="\n".join(sigs), cuda_sources=CUDA + "\n".join(defs),
                       functions=names, extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    mod = build_module()
    n = 1 << 30
    print(torch.cuda.get_device_name(), torch.__version__)
    for ct, dtype in DTYPES.items():
        p, t = bench.seed_inputs((n,), dtype, "cuda")
        t = (t * 3).to(dtype)  # both branches of Smooth L1
        g = torch.empty_like(p)
        sums = torch.empty(1 << 25, dtype=torch.float64, device="cuda")
        one = torch.ones((), dtype=dtype, device="cuda")
        inductor_backward = torch.compile(lambda go, x, y: torch.ops.aten.smooth_l1_loss_backward(go, x, y, 1, 1.0))
        inductor_forward = torch.compile(F.smooth_l1_loss)
        copy, copy_bytes = bench.device_copy()
        with torch.no_grad():
            ref = F.smooth_l1_loss(p.double(), t.double()).item()
            expected = torch.clamp(p.float() - t.float(), -1, 1).div_(n).to(dtype)
            print("inductor backward matches:", torch.equal(inductor_backward(one, p, t), expected))
        grad_bytes, loss_bytes = 3 * n * p.element_size(), 2 * n * p.element_size()
        fns = {"inductor backward (3N, no sums)": (lambda: inductor_backward(one, p, t), grad_bytes),
               "inductor forward (2N)": (lambda: inductor_forward(p, t), loss_bytes)}
        for cfg in TILES:
            threads, u, load, store, sum_kind = cfg
            fn = getattr(mod, f"tile_{ct[-4:]}_" + "_".join(map(str, cfg)))
            for write in (True, False):
                if not write and (load, store) != (0, 1):
                    continue
                name = (f"{'grad' if write else 'fwd '} tile {threads}x{u} load {load} store {store} "
                        f"{SUM_NAMES[sum_kind]}")
                g.fill_(float("nan"))
                sums.fill_(float("nan"))
                fn(p, t, g, sums, write)
                if write:
                    assert torch.equal(g, expected), name
                if sum_kind:
                    blocks = -(-n * p.element_size() // 16 // (threads * u)) * (threads // 32 if sum_kind == 2 else 1)
                    total = sums[:blocks].sum().item() / n
                    assert abs(total - ref) <= 1e-6 * abs(ref), (name, total, ref)
                fns[name] = ((lambda f=fn, w=write: f(p, t, g, sums, w)), grad_bytes if write else loss_bytes)
        lines = [f"== Smooth L1, {dtype}, 2^30 elements; each taking turns with a 2 GiB copy"]
        for name, (fn, nbytes) in fns.items():
            ms = bench.time_side_by_side({"v": fn, "copy": copy}, warmup_s=0.1)
            copy_tbs = copy_bytes / ms["copy"] / 1e9
            lines.append(f"{name:48} {ms['v']:7.3f} ms {nbytes / ms['v'] / 1e9:5.2f} TB/s "
                         f"{nbytes / ms['v'] / 1e9 / copy_tbs:6.1%} of copy ({copy_tbs:.2f} TB/s)")
            print(lines[-1], flush=True)
        with open(out / "tile_probe.txt", "a") as f:
            f.write("\n".join(lines) + "\n")
        del p, t, g, sums, expected, copy, fns
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
