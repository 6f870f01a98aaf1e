"""Experiment: what a tile's hand-off of its partial sum costs, at 2^30 fp32 elements.

The tiles' partials used to be stored one per tile (memory in proportion to N)
and folded afterwards. `exact_sum.cuh` instead adds them with integer atomics
into a few KiB. This probe runs the fp32 MSE tile (forward only: read 2N; and
with the gradient: read 2N + write N) with these ends of the block:
    store     one double per tile (the old design)
    exact     ExactSum::add as shipped from 2^22 elements: 16 copies, one per 128-byte line
    distinct  three atomics per tile, each to its own address (no contention)
    exact4k   ExactSum::add, 64 copies 4 KiB apart
    exact128  ExactSum::add, 64 copies 128 bytes apart
    one       one atomic per tile, all to one address
    lines K   ExactSum::add, K copies 128 bytes apart (K = 2, 4, 8, 16)
    cluster C clusters of C blocks sum their partials in the leader's shared
              memory, which adds them into 4 lines (C = 4, 8)
next to the shipped op and a copy, each taking turns with the copy. Run on the device:
    OUT=... PYTHONPATH=src python benchmarks/sum_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from fusedloss import bench, build

CUDA = build.read_source("elementwise.cuh") + build.read_source("exact_sum.cuh") + r"""
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
using namespace fusedloss;
namespace cg = cooperative_groups;

template <int kTail>
__device__ __forceinline__ void hand_off(double total, unsigned tile, Word* words, double* partials) {
  if constexpr (kTail == 0) {
    partials[tile] = total;
  } else if constexpr (kTail == 1) {
    ExactSum<float>::add(words + (tile % 16) * ExactSum<float>::kCopyWords, total);
  } else if constexpr (kTail == 2) {
    const Word bits = Word(__double_as_longlong(total));
#pragma unroll
    for (int k = 0; k < 3; ++k) atomicAdd(words + 4 * Word(tile) + k, (bits >> (20 * k)) & 0xfffff);
  } else if constexpr (kTail == 3) {
    ExactSum<float>::add(words + (tile % 64) * 512, total);
  } else if constexpr (kTail == 4) {
    ExactSum<float>::add(words + (tile % 64) * 16, total);
  } else if constexpr (kTail == 5) {
    atomicAdd(words + 1, Word(__double_as_longlong(total)) & 0xfffff);
  } else {
    constexpr unsigned kLines = 1u << (kTail - 5);  // 6..9: 2, 4, 8, 16 lines
    ExactSum<float>::add(words + (tile % kLines) * 16, total);
  }
}

template <int kCluster, bool kGrad>
__global__ void __launch_bounds__(256, 8) mse_cluster(const float4* p, const float4* t, float4* g, Word* words,
                                                      double* partials, float scale) {
  constexpr int kChunks = kGrad ? 1 : 2;
  const int64_t first = int64_t(blockIdx.x) * kChunks * 256 + threadIdx.x;
  float4 a[kChunks], b[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    a[c] = p[first + c * 256];
    b[c] = t[first + c * 256];
  }
  double sum = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const float4 d = make_float4(a[c].x - b[c].x, a[c].y - b[c].y, a[c].z - b[c].z, a[c].w - b[c].w);
    sum += double(d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w);
    if constexpr (kGrad) {
      g[first + c * 256] = make_float4(2 * d.x * scale, 2 * d.y * scale, 2 * d.z * scale, 2 * d.w * scale);
    }
  }
  const double total = block_sum(sum);
  __shared__ double cluster_partials[kCluster];
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) cluster.map_shared_rank(cluster_partials, 0)[cluster.block_rank()] = total;
  cluster.sync();
  if (cluster.block_rank() == 0 && threadIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < kCluster; ++i) s += cluster_partials[i];
    ExactSum<float>::add(words + (blockIdx.x / kCluster % 4) * 16, s);
  }
}

template <int kCluster, bool kGrad>
void launch_cluster(int64_t blocks, cudaStream_t stream, const float4* p, const float4* t, float4* g, Word* w,
                    double* partials, float scale) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(256);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kCluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, mse_cluster<kCluster, kGrad>, p, t, g, w, partials, scale));
}

template <int kTail, bool kGrad>
__global__ void __launch_bounds__(256, 8) mse_tile(const float4* p, const float4* t, float4* g, Word* words,
                                                   double* partials, float scale) {
  constexpr int kChunks = kGrad ? 1 : 2;
  const int64_t first = int64_t(blockIdx.x) * kChunks * 256 + threadIdx.x;
  float4 a[kChunks], b[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    a[c] = p[first + c * 256];
    b[c] = t[first + c * 256];
  }
  double sum = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const float4 d = make_float4(a[c].x - b[c].x, a[c].y - b[c].y, a[c].z - b[c].z, a[c].w - b[c].w);
    sum += double(d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w);
    if constexpr (kGrad) {
      g[first + c * 256] = make_float4(2 * d.x * scale, 2 * d.y * scale, 2 * d.z * scale, 2 * d.w * scale);
    }
  }
  const double total = block_sum(sum);
  if (threadIdx.x == 0) hand_off<kTail>(total, blockIdx.x, words, partials);
}

template <int kTail>
void run_tail(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor words, torch::Tensor partials,
              bool grad) {
  const int64_t n = p.numel();
  const int64_t tile = grad ? 1024 : 2048;
  TORCH_CHECK(n % tile == 0);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto args = std::make_tuple((const float4*)p.data_ptr<float>(), (const float4*)t.data_ptr<float>(),
                                    (float4*)g.data_ptr<float>(), (Word*)words.data_ptr<int64_t>(),
                                    partials.data_ptr<double>(), 1.0f / n);
  if constexpr (kTail >= 10) {
    constexpr int kCluster = kTail == 10 ? 4 : 8;
    if (grad) {
      std::apply([&](auto... a) { launch_cluster<kCluster, true>(n / tile, stream, a...); }, args);
    } else {
      std::apply([&](auto... a) { launch_cluster<kCluster, false>(n / tile, stream, a...); }, args);
    }
  } else if (grad) {
    std::apply([&](auto... a) { mse_tile<kTail, true><<<n / tile, 256, 0, stream>>>(a...); }, args);
  } else {
    std::apply([&](auto... a) { mse_tile<kTail, false><<<n / tile, 256, 0, stream>>>(a...); }, args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void probe(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor words, torch::Tensor partials,
           int64_t tail, bool grad) {
  switch (tail) {
    case 0: return run_tail<0>(p, t, g, words, partials, grad);
    case 1: return run_tail<1>(p, t, g, words, partials, grad);
    case 2: return run_tail<2>(p, t, g, words, partials, grad);
    case 3: return run_tail<3>(p, t, g, words, partials, grad);
    case 4: return run_tail<4>(p, t, g, words, partials, grad);
    case 5: return run_tail<5>(p, t, g, words, partials, grad);
    case 6: return run_tail<6>(p, t, g, words, partials, grad);
    case 7: return run_tail<7>(p, t, g, words, partials, grad);
    case 8: return run_tail<8>(p, t, g, words, partials, grad);
    case 9: return run_tail<9>(p, t, g, words, partials, grad);
    case 10: return run_tail<10>(p, t, g, words, partials, grad);
    default: return run_tail<11>(p, t, g, words, partials, grad);
  }
}
"""
CPP = ("void probe(torch::Tensor p, torch::Tensor t, torch::Tensor g, torch::Tensor words, "
       "torch::Tensor partials, int64_t tail, bool grad);")
TAILS = ["store", "exact", "distinct", "exact4k", "exact128", "one", "lines 2", "lines 4", "lines 8", "lines 16",
         "cluster 4", "cluster 8"]


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    build.load()
    mod = load_inline("sum_probe", cpp_sources=CPP, cuda_sources=CUDA, functions=["probe"],
                      extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90"])
    n = 1 << 30
    p, t = bench.seed_inputs((n,), torch.float32, "cuda")
    g = torch.empty_like(p)
    words = torch.zeros(1 << 23, dtype=torch.int64, device="cuda")
    partials = torch.empty(1 << 20, dtype=torch.float64, device="cuda")
    copy, copy_bytes = bench.device_copy()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp32 MSE tiles at 2^30 elements; "
             "each taking turns with a 2 GiB copy"]
    print(lines[0], flush=True)
    for grad in (False, True):
        nbytes = (3 if grad else 2) * n * 4
        fns = {f"shipped reduced_loss{' + grad' if grad else ''}":
               lambda gr=grad: torch.ops.fusedloss.reduced_loss.default(p, t, "mse", 0.0, "mean", [gr, False])}
        for tail, name in enumerate(TAILS):
            fns[f"{'grad' if grad else 'fwd '} {name}"] = lambda k=tail, gr=grad: mod.probe(p, t, g, words,
                                                                                             partials, k, gr)
        for name, fn in fns.items():
            with torch.no_grad():
                ms = bench.time_side_by_side({"v": fn, "copy": copy}, warmup_s=0.1)
            copy_tbs = copy_bytes / ms["copy"] / 1e9
            lines.append(f"{name:32} {ms['v']:7.3f} ms {nbytes / ms['v'] / 1e9:5.2f} TB/s "
                         f"{nbytes / ms['v'] / 1e9 / copy_tbs:6.1%} of copy ({copy_tbs:.2f} TB/s)")
            print(lines[-1], flush=True)
    with open(out / "sum_probe.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
