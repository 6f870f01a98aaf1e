"""Experiment: the in-place gradient scaling pass (read N + write N) at 2^30 elements.

`(loss * 0.5).backward()` scales the fused gradient in place. The shipped kernel
is one wave of blocks striding over the tiles, so that with a scale of 1 the
launch returns at once; it keeps one 16-byte load per thread in flight. This
probe walks the same tiles (`elementwise.cuh`'s `visit_tile`) with 1, 2 and 4
loads in flight per thread, as one wave and as one block per tile, next to the
shipped `scale_`, PyTorch's in-place `mul_`, and a copy, each taking turns with
the copy. It also times each one-wave variant with a scale of 1. Run on the device:
    OUT=... PYTHONPATH=src python benchmarks/scale_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import fusedloss  # noqa: F401  (registers torch.ops.fusedloss)
from fusedloss import bench, build

CUDA = build.read_source("dtypes.cuh") + build.read_source("elementwise.cuh") + r"""
#include <ATen/cuda/CUDAContext.h>
using namespace fusedloss;

template <typename S, int kChunks>
struct ProbeScaleOp {
  static constexpr int kVec = 16 / sizeof(S);
  static constexpr int kChunksPerThread = kChunks;
  template <int W>
  struct Chunk {
    alignas(16) S data[W];
  };
  S* __restrict__ data;
  float scale;
  template <int W>
  __device__ __forceinline__ void load(Chunk<W>& c, int64_t first) const { load_chunk(c.data, data, first); }
  template <int W>
  __device__ __forceinline__ void apply(const Chunk<W>& c, int64_t first) const {
    alignas(16) S scaled[W];
#pragma unroll
    for (int k = 0; k < W; ++k) scaled[k] = Convert<S>::from(to_opmath(c.data[k]) * scale);
    store_chunk(data, first, scaled);
  }
};

template <typename S, int kChunks, bool kOneWave>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) scale_kernel(S* data, int64_t n, int64_t tiles,
                                                                            const float* scale) {
  const float s = *scale;
  if (s == 1.0f) return;
  ProbeScaleOp<S, kChunks> op{data, s};
  if constexpr (kOneWave) {
#pragma unroll 1
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) visit_tile<true>(op, n, tile);
  } else {
    visit_tile<true>(op, n);
  }
}

template <typename S, int kChunks, bool kOneWave>
void launch(torch::Tensor data, torch::Tensor scale) {
  using Op = ProbeScaleOp<S, kChunks>;
  const int64_t n = data.numel();
  const int64_t tiles = num_tiles<Op>(n);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = kOneWave ? std::min<int64_t>(tiles, sms * kBlocksPerSm) : tiles;
  scale_kernel<S, kChunks, kOneWave><<<blocks, kBlockThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<S*>(data.data_ptr()), n, tiles, scale.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scale_variant(torch::Tensor data, torch::Tensor scale, int64_t chunks, bool one_wave) {
  TORCH_CHECK(data.is_contiguous() && data.data_ptr() != nullptr);
  const bool bf16 = data.scalar_type() == at::kBFloat16;
#define FUSEDLOSS_PROBE_CASE(C)                                                            \
  if (chunks == C) {                                                                     \
    if (bf16) return one_wave ? launch<__nv_bfloat16, C, true>(data, scale)              \
                              : launch<__nv_bfloat16, C, false>(data, scale);            \
    return one_wave ? launch<float, C, true>(data, scale) : launch<float, C, false>(data, scale); \
  }
  FUSEDLOSS_PROBE_CASE(1)
  FUSEDLOSS_PROBE_CASE(2)
  FUSEDLOSS_PROBE_CASE(4)
  TORCH_CHECK(false, "chunks must be 1, 2 or 4");
}
"""
CPP = "void scale_variant(torch::Tensor data, torch::Tensor scale, int64_t chunks, bool one_wave);"


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    build.load()
    mod = load_inline("scale_probe", cpp_sources=CPP, cuda_sources=CUDA, functions=["scale_variant"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    n = 1 << 30
    copy, copy_bytes = bench.device_copy()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 2^30 elements, in place; "
             "each taking turns with a 2 GiB copy"]
    print(lines[0], flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.randn(n, device="cuda").to(dtype)
        half = torch.tensor(0.5, device="cuda")
        one = torch.tensor(1.0, device="cuda")
        variants = {"shipped scale_ (one wave, 1 load)": lambda s: torch.ops.fusedloss.scale_(g, s),
                    "torch mul_": lambda s: g.mul_(s)}
        for chunks in (1, 2, 4):
            for one_wave in (True, False):
                name = f"{'one wave' if one_wave else 'per tile'}, {chunks} load{'s' if chunks > 1 else ''}"
                variants[name] = lambda s, c=chunks, w=one_wave: mod.scale_variant(g, s, c, w)
        # Each variant must scale every element exactly once (0.5 is exact in both dtypes).
        for name, fn in variants.items():
            before = g.clone()
            fn(half)
            assert torch.equal(g, before * 0.5), name
            fn(one)
            assert torch.equal(g, before * 0.5), name
        del before
        nbytes = 2 * n * g.element_size()
        for name, fn in variants.items():
            g.normal_()  # keep the values away from subnormals
            ms = bench.time_side_by_side({"v": lambda f=fn: f(half), "copy": copy}, warmup_s=0.1)
            copy_tbs = copy_bytes / ms["copy"] / 1e9
            line = (f"{str(dtype):15} {name:36} {ms['v']:7.3f} ms {nbytes / ms['v'] / 1e9:5.2f} TB/s "
                    f"{nbytes / ms['v'] / 1e9 / copy_tbs:6.1%} of copy ({copy_tbs:.2f} TB/s)")
            if "mul_" not in name:
                line += f"   scale 1: {bench.time_ms(lambda f=fn: f(one)) * 1e3:7.1f} us"
            lines.append(line)
            print(line, flush=True)
        del g
        torch.cuda.empty_cache()
    with open(out / "scale_probe.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
