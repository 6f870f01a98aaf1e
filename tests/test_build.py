"""The build: source assembly, cache location, and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedloss import build

SRC = Path(__file__).resolve().parents[1] / "src"


def test_read_source_pastes_local_includes_once():
    text = build.read_source("loss_kernels.cu")
    assert '#include "' not in text and "#pragma once" not in text
    assert text.count("struct LossProblem {") == 1
    assert "__global__" in text and "struct HuberLoss" in text
    host = build.read_source("fusedloss_ops.cpp")
    assert "TORCH_LIBRARY_IMPL(fusedloss, CUDA, m)" in host and "struct LossProblem {" in host


def test_build_root_honours_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import get_default_build_root

    assert build.build_root() == Path(get_default_build_root())


def test_package_ships_the_kernel_sources():
    names = {p.name for p in build.CSRC.iterdir()}
    assert {"launch.h", "dtypes.cuh", "losses.cuh", "elementwise.cuh", "loss_kernels.cu",
            "fusedloss_ops.cpp"} <= names


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "fusedloss", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_bench_without_gpu_says_so_and_exits_0():
    result = _cli("bench")
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.splitlines()
    assert "no CUDA device" in first
    assert any(line.startswith("mse") for line in rest)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_build_without_gpu_fails_cleanly():
    result = _cli("build")
    assert result.returncode == 1 and "no CUDA device" in result.stdout
