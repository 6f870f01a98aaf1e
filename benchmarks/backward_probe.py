"""Experiment: the backward of a mean loss when grad_output != 1, at 2^30 elements.

Today the forward writes the gradient (read 2N + write N) and backward scales it
in place (read N + write N): 10 bytes per bf16 element, as torch.compile moves
(its forward reads 2N, its backward reads 2N again and writes N), but in a mix
with more writes. This probe times, side by side with the shipped step and
compile's:
- the scale pass as one wave whose blocks take tiles from an atomic counter
  (tiles in launch order, as with one block per tile, but the launch still
  returns at once when told to), next to the shipped grid-stride wave;
- a backward that recomputes the gradient from input and target after a
  forward that wrote none (compile's traffic): one block per tile, forwards and
  backwards (backwards, the first tiles it reads are those the forward left in
  L2), grid-stride, and counter-fed in both directions.
Results: results/probes/backward_probe.txt; what came of them: NOTES.md,
"Gradient in backward when grad_output != 1".
Run on the device:
    OUT=... PYTHONPATH=src python benchmarks/backward_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

import fusedloss
from fusedloss import bench, build

CUDA = build.read_source("loss_kernels.cu") + r"""
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
using namespace fusedloss;

// One wave; a block takes its next tile from `counter` (zeroed before the launch)
// while it walks the current one. Returns at once when *gate == 1.
template <bool kReverse, class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) counter_fed_kernel(Op op, int64_t n, int64_t tiles,
                                                                                  unsigned long long* counter,
                                                                                  const float* gate) {
  if (*gate == 1.0f) return;
  __shared__ unsigned long long next[2];
  if (threadIdx.x == 0) next[0] = atomicAdd(counter, 1ull);
  __syncthreads();
  for (int i = 0;; i ^= 1) {
    const int64_t tile = int64_t(next[i]);
    if (tile >= tiles) return;
    if (threadIdx.x == 0) next[i ^ 1] = atomicAdd(counter, 1ull);
    visit_tile<true>(op, n, kReverse ? tiles - 1 - tile : tile);
    __syncthreads();
  }
}

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) backwards_kernel(Op op, int64_t n) {
  visit_tile<true>(op, n, int64_t(gridDim.x) - 1 - blockIdx.x);
}

template <class Op>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSm) grid_stride_kernel(Op op, int64_t n, int64_t tiles,
                                                                                  const float* gate) {
  if (*gate == 1.0f) return;
#pragma unroll 1
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) visit_tile<true>(op, n, tile);
}

int64_t one_wave() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return int64_t(sms) * kBlocksPerSm;
}

// mode: 0 one block per tile, 1 grid-stride wave, 2 counter-fed, 3 counter-fed backwards, 4 one block per tile backwards
template <class Op>
void launch(const Op& op, int64_t n, int64_t mode, torch::Tensor counter, torch::Tensor gate) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t tiles = num_tiles<Op>(n);
  const float* g = gate.data_ptr<float>();
  auto* c = reinterpret_cast<unsigned long long*>(counter.data_ptr());
  if (mode == 0) {
    elementwise_kernel<true, Op><<<tiles, kBlockThreads, 0, stream>>>(op, n);
  } else if (mode == 4) {
    backwards_kernel<Op><<<tiles, kBlockThreads, 0, stream>>>(op, n);
  } else if (mode == 1) {
    grid_stride_kernel<Op><<<std::min(tiles, one_wave()), kBlockThreads, 0, stream>>>(op, n, tiles, g);
  } else {
    C10_CUDA_CHECK(cudaMemsetAsync(c, 0, 8, stream));
    if (mode == 2) counter_fed_kernel<false, Op><<<std::min(tiles, one_wave()), kBlockThreads, 0, stream>>>(op, n, tiles, c, g);
    else counter_fed_kernel<true, Op><<<std::min(tiles, one_wave()), kBlockThreads, 0, stream>>>(op, n, tiles, c, g);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename S>
void scale_typed(torch::Tensor data, torch::Tensor scale, int64_t mode, torch::Tensor counter) {
  ScaleOp<S> op{static_cast<S*>(data.data_ptr()), 0.5f};
  launch(op, data.numel(), mode, counter, scale);
}

void scale_variant(torch::Tensor data, torch::Tensor scale, int64_t mode, torch::Tensor counter) {
  if (data.scalar_type() == at::kBFloat16) return scale_typed<__nv_bfloat16>(data, scale, mode, counter);
  return scale_typed<float>(data, scale, mode, counter);
}

// Smooth L1 (beta = 1) gradient of a mean, times grad_output, from input and target.
template <typename S>
void recompute_typed(torch::Tensor p, torch::Tensor t, torch::Tensor go, torch::Tensor grad, int64_t mode,
                     torch::Tensor counter, torch::Tensor gate) {
  using Op = PointwiseLossBackwardOp<SmoothL1Loss, S, S, Grads::kInput>;
  const LossProblem problem{LossKind::kSmoothL1, 1.0, p.data_ptr(), DType::kFloat32, t.data_ptr(), DType::kFloat32,
                            p.numel()};
  Op op = make_op<Op>(problem);
  op.grad_output = static_cast<const S*>(go.data_ptr());
  op.grad_output_is_scalar = true;
  op.grad_input = static_cast<S*>(grad.data_ptr());
  launch(op, p.numel(), mode, counter, gate);
}

void recompute_variant(torch::Tensor p, torch::Tensor t, torch::Tensor go, torch::Tensor grad, int64_t mode,
                       torch::Tensor counter, torch::Tensor gate) {
  if (p.scalar_type() == at::kBFloat16) return recompute_typed<__nv_bfloat16>(p, t, go, grad, mode, counter, gate);
  return recompute_typed<float>(p, t, go, grad, mode, counter, gate);
}
"""
CPP = """
void scale_variant(torch::Tensor data, torch::Tensor scale, int64_t mode, torch::Tensor counter);
void recompute_variant(torch::Tensor p, torch::Tensor t, torch::Tensor go, torch::Tensor grad, int64_t mode,
                       torch::Tensor counter, torch::Tensor gate);
"""
MODES = {0: "one block per tile", 1: "grid-stride wave", 2: "counter-fed wave", 3: "counter-fed wave, backwards",
         4: "one block per tile, backwards"}


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    build.load()
    mod = load_inline("backward_probe", cpp_sources=CPP, cuda_sources=CUDA,
                      functions=["scale_variant", "recompute_variant"],
                      extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90"])
    n = 1 << 30
    copy, copy_bytes = bench.device_copy()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    half = torch.tensor(0.5, device="cuda")
    one = torch.tensor(1.0, device="cuda")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 2^30 elements; "
             "each taking turns with a 2 GiB copy"]
    print(lines[0], flush=True)

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    for dtype in (torch.bfloat16, torch.float32):
        # -- the scale pass alone (in place, read N + write N)
        g = torch.randn(n, device="cuda").to(dtype)
        variants = {"shipped scale_": lambda s: torch.ops.fusedloss.scale_(g, s)}
        for mode in (0, 1, 2, 4):
            variants[MODES[mode]] = lambda s, m=mode: mod.scale_variant(g, s, m, counter)
        for name, fn in variants.items():
            before = g.clone()
            fn(half)
            assert torch.equal(g, before * 0.5), name
            del before
        nbytes = 2 * n * g.element_size()
        for name, fn in variants.items():
            g.normal_()
            ms = bench.time_side_by_side({"v": lambda f=fn: f(half), "copy": copy}, warmup_s=0.1)
            copy_tbs = copy_bytes / ms["copy"] / 1e9
            line = (f"{str(dtype):15} scale, {name:30} {ms['v']:7.3f} ms {nbytes / ms['v'] / 1e9 / copy_tbs:6.1%}"
                    f" of copy ({copy_tbs:.2f} TB/s)")
            if name not in (MODES[0], MODES[4]):
                line += f"   scale 1: {bench.time_ms(lambda f=fn: f(one)) * 1e3:6.1f} us"
            emit(line)
        del g
        torch.cuda.empty_cache()

        # -- whole steps, Smooth L1 mean, (loss * 0.5).backward()
        p, t = bench.seed_inputs((n,), dtype, "cuda")
        p.requires_grad_(True)
        compiled = bench._fresh_compile(F.smooth_l1_loss)
        go = torch.tensor(0.5 / n, device="cuda", dtype=dtype)  # the mean's 1/N, times 0.5: a power of two
        gate_off = torch.tensor(0.0, device="cuda")
        grad = torch.empty_like(p)

        def autograd_step(fn):
            def run():
                p.grad = None
                (fn(p, t) * 0.5).backward()
            return run

        def fused_then_counter_scale():
            _, grad_input, _ = torch.ops.fusedloss.reduced_loss(p.detach(), t, "smooth_l1", 1.0, "mean", [True, False])
            mod.scale_variant(grad_input, half, 2, counter)

        def forward_then_recompute(mode):
            def run():
                torch.ops.fusedloss.reduced_loss(p.detach(), t, "smooth_l1", 1.0, "mean", [False, False])
                mod.recompute_variant(p.detach(), t, go, grad, mode, counter, gate_off)
            return run

        # The recomputed gradient must be what the fused forward wrote, times 0.5.
        p.grad = None
        (fusedloss.smooth_l1_loss(p, t) * 0.5).backward()
        for mode in MODES:
            grad.fill_(float("nan"))
            forward_then_recompute(mode)()
            assert torch.equal(grad, p.grad), MODES[mode]
        p.grad = None

        steps = {"shipped fused step": autograd_step(fusedloss.smooth_l1_loss),
                 "torch.compile step": autograd_step(compiled),
                 "fused fwd+grad, counter-fed scale": fused_then_counter_scale}
        for mode in MODES:
            steps[f"no-grad fwd + recompute, {MODES[mode]}"] = forward_then_recompute(mode)
        ms = bench.time_side_by_side({**steps, "copy": copy})
        for name in steps:
            emit(f"{str(dtype):15} step, {name:52} {ms[name]:7.3f} ms  "
                 f"x compile {ms['torch.compile step'] / ms[name]:5.3f}")
        del p, t, grad, compiled
        torch.cuda.empty_cache()
    (out / "backward_probe.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
