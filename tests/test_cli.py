"""The command line: --version, info, and the bench sizing itself to the free GPU memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import fusedloss
from fusedloss.bench import large

SRC = str(Path(fusedloss.__file__).resolve().parents[1])


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([sys.executable, "-m", "fusedloss", *args], capture_output=True, text=True, env=environment,
                          timeout=120)


def test_version():
    result = _cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"fusedloss {fusedloss.__version__}"


def test_info_says_where_each_family_comes_from(tmp_path):
    result = _cli("info", env={"TORCH_EXTENSIONS_DIR": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"fusedloss {fusedloss.__version__}; torch ")
    for family in ("plain", "weighted", "likelihood"):
        (line,) = [line for line in lines if line.startswith(f"{family} kernels: ")]
        assert "wheel" in line or str(tmp_path) in line  # the wheel's, or where a build would go
    assert any(line.startswith("C++ autograd: ") for line in lines)


def test_a_failed_command_reports_on_stderr():
    result = _cli("build", "--family", "nonexistent")
    assert result.returncode != 0 and result.stdout == "" and "nonexistent" in result.stderr


def test_the_bench_halves_its_shape_until_it_fits(capsys):
    assert large.fitting_shape((32768, 32768), 80 * 2**30) == (32768, 32768)
    assert capsys.readouterr().out == ""
    assert large.fitting_shape((32768, 32768), 10 * 2**30) == (8192, 32768)
    assert "10.0 GiB of GPU memory free" in capsys.readouterr().out


def test_the_bench_compares_like_with_like():
    """Each bench case's fused and eager systems compute the same loss and gradient (on the
    CPU, at small sizes), so the timed rows compare like with like."""
    from fusedloss.bench import other_losses

    cases = other_losses.quantile_cases("cpu", shapes=((4, 6),))
    cases += other_losses.elementwise_cases(1 << 10, torch.float32, "cpu")
    cases += [other_losses.per_sample_case((4, 2, 8, 8), torch.float32, "cpu")]
    cases += other_losses.tensor_param_cases((4, 2, 8, 8), torch.float32, "cpu")
    assert len(cases) == 8
    for case in cases:
        fused, eager = case.fused(case.p, case.t), case.eager(case.p, case.t)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6, msg=case.label)
        grads = [torch.autograd.grad(loss, case.p)[0] for loss in (fused, eager)]
        torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-7, msg=case.label)
        assert case.nbytes >= 2 * case.p.numel() * case.p.element_size()
