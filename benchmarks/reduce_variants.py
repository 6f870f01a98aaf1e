"""Experiment: which launch shape and load flavour reaches HBM read bandwidth for
a fp32 sum of squared differences at 2^30 elements (the reduced-loss pass).

Run on the device: PYTHONPATH=src python benchmarks/reduce_variants.py
Each variant is timed next to torch.compile in the same process; see NOTES.md.
"""

from __future__ import annotations

import statistics

import torch
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <cstdint>
template <int HINT>
__device__ __forceinline__ float4 load4(const float4* p) {
  if constexpr (HINT == 256) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
  } else if constexpr (HINT == 128) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
  } else {
    return __ldcs(p);
  }
}

template <int THREADS>
__device__ double block_sum(double v) {
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

// CHUNK == 0: grid-stride over the whole array; else each block owns CHUNK vectors.
template <int THREADS, int U, int HINT, int CHUNK>
__global__ void __launch_bounds__(THREADS) sq_diff_sum(const float4* p, const float4* t, int64_t nvec, double* out) {
  double acc = 0;
  int64_t begin, end, stride;
  if (CHUNK == 0) { begin = int64_t(blockIdx.x) * THREADS + threadIdx.x; end = nvec; stride = int64_t(gridDim.x) * THREADS; }
  else { begin = int64_t(blockIdx.x) * CHUNK + threadIdx.x; end = min(nvec, int64_t(blockIdx.x + 1) * CHUNK); stride = THREADS; }
  for (int64_t i = begin; i < end; i += stride * U) {
    float4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) if (i + u * stride < end) { a[u] = load4<HINT>(p + i + u * stride); b[u] = load4<HINT>(t + i + u * stride); }
#pragma unroll
    for (int u = 0; u < U; ++u) if (i + u * stride < end) {
      float dx = a[u].x - b[u].x, dy = a[u].y - b[u].y, dz = a[u].z - b[u].z, dw = a[u].w - b[u].w;
      acc += double(dx * dx + dy * dy + dz * dz + dw * dw);
    }
  }
  double s = block_sum<THREADS>(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

__global__ void finish(const double* partials, int n, double* out) {
  double v = 0;
  for (int i = threadIdx.x; i < n; i += 1024) v += partials[i];
  v = block_sum<1024>(v);
  if (threadIdx.x == 0) *out = v;
}

template <int THREADS, int U, int HINT, int CHUNK>
void run(torch::Tensor p, torch::Tensor t, torch::Tensor partials, torch::Tensor out, int64_t blocks) {
  auto stream = at::cuda::getCurrentCUDAStream();
  sq_diff_sum<THREADS, U, HINT, CHUNK><<<blocks, THREADS, 0, stream>>>(
      (const float4*)p.data_ptr(), (const float4*)t.data_ptr(), p.numel() / 4, partials.data_ptr<double>());
  finish<<<1, 1024, 0, stream>>>(partials.data_ptr<double>(), blocks, out.data_ptr<double>());
}
"""

VARIANTS = {
    # name: (threads, unroll, hint, chunk_vectors, blocks_per_sm or None for chunked)
    "gs 256x4 u4 ldcs (current)": (256, 4, 0, 0, 4),
    "gs 256x4 u4 L2::256B": (256, 4, 256, 0, 4),
    "gs 256x4 u4 L2::128B": (256, 4, 128, 0, 4),
    "gs 256x8 u2 ldcs": (256, 2, 0, 0, 8),
    "gs 256x8 u2 L2::256B": (256, 2, 256, 0, 8),
    "gs 512x4 u2 L2::256B": (512, 2, 256, 0, 4),
    "gs 256x2 u8 L2::256B": (256, 8, 256, 0, 2),
    "chunk 16K 256 u4 L2::256B": (256, 4, 256, 16384, None),
    "chunk 32K 256 u4 L2::256B": (256, 4, 256, 32768, None),
    "chunk 16K 256 u4 ldcs": (256, 4, 0, 16384, None),
    "chunk 8K 512 u2 L2::256B": (512, 2, 256, 8192, None),
}


def main() -> None:
    instantiations = sorted({v[:4] for v in VARIANTS.values()})
    cpp_decls = "\n".join(
        f"void run_{a}_{b}_{c}_{d}(torch::Tensor p, torch::Tensor t, torch::Tensor s, torch::Tensor o, int64_t g);"
        for a, b, c, d in instantiations
    )
    cuda_defs = "\n".join(
        f"void run_{a}_{b}_{c}_{d}(torch::Tensor p, torch::Tensor t, torch::Tensor s, torch::Tensor o, int64_t g)"
        f" {{ run<{a},{b},{c},{d}>(p, t, s, o, g); }}"
        for a, b, c, d in instantiations
    )
    module = load_inline(
        "reduce_variants",
        cpp_sources=cpp_decls,
        cuda_sources="#include <ATen/cuda/CUDAContext.h>\n" + CUDA + cuda_defs,
        functions=[f"run_{a}_{b}_{c}_{d}" for a, b, c, d in instantiations],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 1 << 30
    p = torch.rand(n, device="cuda") * torch.rand((), device="cuda")
    t = torch.rand(n, device="cuda")
    reference = ((p.double() - t.double()) ** 2).sum().item()

    def median_ms(fn, reps=30):
        for _ in range(3):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in events:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events)

    results = {}
    compiled = torch.compile(lambda a, b: torch.mean((a - b) ** 2))
    results["torch.compile seed mse"] = median_ms(lambda: compiled(p, t))
    import fusedloss

    results["fusedloss.mse_loss"] = median_ms(lambda: fusedloss.mse_loss(p, t))
    out = torch.empty((), dtype=torch.float64, device="cuda")
    for name, (threads, unroll, hint, chunk, bps) in VARIANTS.items():
        blocks = sms * bps if chunk == 0 else -(-(n // 4) // chunk)
        partials = torch.empty(blocks, dtype=torch.float64, device="cuda")
        fn = getattr(module, f"run_{threads}_{unroll}_{hint}_{chunk}")
        results[name] = median_ms(lambda: fn(p, t, partials, out, blocks))
        assert abs(out.item() - reference) / reference < 1e-6, name
    results["torch.compile seed mse (again)"] = median_ms(lambda: compiled(p, t))
    for name, ms in results.items():
        print(f"{name:34} {ms:7.3f} ms  {8 * n / ms / 1e9:5.2f} TB/s")


if __name__ == "__main__":
    main()
