"""Experiment: why the fused training step runs slower when other work takes turns with it.

At 2^30 fp32 elements, times the Smooth L1 step alone and taking turns with a
device copy, the eager step and the compiled step; the raw forward op (which
writes the gradient) alone and taking turns with a copy, with the address of
the gradient buffer it got; and the raw op with the target at several offsets
from its allocation. Run on the device:
    PYTHONPATH=src python benchmarks/interleave_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusedloss
from fusedloss import bench, build

N = 1 << 30


def main() -> None:
    build.load()
    p, t = bench.seed_inputs((N,), torch.float32, "cuda")
    p.requires_grad_(True)
    compiled = torch.compile(F.smooth_l1_loss)

    def step(fn):
        def run():
            p.grad = None
            fn(p, t).backward()
        return run

    fused, eager, compile_step = step(fusedloss.smooth_l1_loss), step(F.smooth_l1_loss), step(compiled)
    copy, _ = bench.device_copy()
    print(f"step alone            {bench.time_ms(fused):.3f} ms")
    for name, other in (("copy", copy), ("eager", eager), ("compile", compile_step), ("sleep", lambda: torch.cuda._sleep(2_000_000))):
        ms = bench.time_side_by_side({"fused": fused, name: other})
        print(f"step with {name:8}    {ms['fused']:.3f} ms   ({name} {ms[name]:.3f} ms)")
    p.grad = None

    grad_ptrs = set()

    def op():
        _, grad, _ = torch.ops.fusedloss.reduced_loss.default(p, t, "smooth_l1", 1.0, "mean", [True, False])
        grad_ptrs.add(grad.data_ptr())

    with torch.no_grad():
        print(f"op alone              {bench.time_ms(op):.3f} ms  grad buffers {sorted(hex(a) for a in grad_ptrs)}")
        grad_ptrs.clear()
        ms = bench.time_side_by_side({"op": op, "copy": copy})
        print(f"op with copy          {ms['op']:.3f} ms  grad buffers {sorted(hex(a) for a in grad_ptrs)}")
        print(f"p {p.data_ptr():#x} t {t.data_ptr():#x}")
        for shift in (0, 4 << 10, 64 << 10, 1 << 20, 2 << 20, (3 << 20) + (4 << 10)):
            buffer = torch.empty(N + shift // 4, device="cuda")
            shifted = buffer[shift // 4:]
            shifted.copy_(t)

            def op_shifted():
                torch.ops.fusedloss.reduced_loss.default(p, shifted, "smooth_l1", 1.0, "mean", [True, False])

            print(f"target shifted {shift:>8} B: op {bench.time_ms(op_shifted):.3f} ms")
            del buffer, shifted


if __name__ == "__main__":
    main()
